"""The pull scheduler on elastic spot groups (ditsp.rl.scheduler, ditsp.rl.spot), on real spawned workers
and a small task: preemptions from a trace (SIGTERM mid-request, SIGKILL after the grace period) return the
unfinished units and every request still finishes exactly once with the right results; SP groups re-form
after losing a member; a task that keeps failing and a run left without workers stop in one line; no worker
outlives a killed trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.rl.leases import Request, RequestQueue
from ditsp.rl.scheduler import SpotPool
from ditsp.rl.trace import parse

pytestmark = [pytest.mark.timeout(300), pytest.mark.ranks]  # spot workers are processes


class Toy:
    """A unit's result is a pure function of (prompt, seed), summed over the group (a collective per unit).
    ``hold``: on that worker a unit never ends by itself (only a preemption ends it); ``deaf``: that worker
    also ignores SIGTERM; ``bad``: the prompt whose units raise."""

    def __init__(self, hold: str | None = None, deaf: bool = False, bad: int | None = None):
        self.hold, self.deaf, self.bad = hold, deaf, bad

    def run(self, ctx, request, seed):
        me = os.environ["DITSP_RL_WORKER"]
        if request.prompt == self.bad:
            raise ValueError(f"prompt {request.prompt} cannot be sampled")
        if me == self.hold:
            if self.deaf:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            time.sleep(600)
        time.sleep(0.05)  # a unit takes a moment: every worker gets work
        x = torch.tensor([float(seed)])
        if ctx.world_size > 1:
            Comm.of(ctx.group).all_reduce(x)
        return {"value": 1000 * request.prompt + seed, "sum": float(x), "world": ctx.world_size, "who": me}


def _requests(n: int, seeds=(1, 2, 3)):
    q = RequestQueue()
    reqs = [Request(f"r{p}", "explore", 0, p, tuple(seeds)) for p in range(n)]
    for r in reqs:
        q.submit(r)
    return q, [r.id for r in reqs]


def _run(task, trace: str, requests: int = 6, group_size: int = 1):
    q, ids = _requests(requests)
    pool = SpotPool(task, parse(trace, "trace"), q, group_size=group_size, timeout_s=60)
    pool.start()
    try:
        q.wait(ids, 120, pool.check)
    finally:
        pool.close()
    return q, ids, pool


def _exactly_once(q, ids) -> None:
    a = q.audit()
    assert a["finished"] == a["requests"] == len(ids)
    assert a["units_kept"] == a["units"]
    for rid in ids:
        p = int(rid[1:])
        res = q.results(rid)
        assert sorted(res) == [1, 2, 3]
        assert all(v["value"] == 1000 * p + s and v["sum"] == s * v["world"] for s, v in res.items())


def test_a_worker_preempted_mid_request_loses_nothing():
    q, ids, pool = _run(Toy(hold="spot0"), "0 join spot0\n0 join spot1\n2 leave spot0 0.5\n")
    _exactly_once(q, ids)
    leave = next(e for e in pool.events if e["event"] == "leave")
    assert leave["busy"], pool.events  # it held a request when SIGTERM came
    assert q.audit()["returned"] >= 1 and q.audit()["returned_units"] >= 1
    assert all(v["who"] == "spot1" for rid in ids for v in q.results(rid).values())
    exit0 = next(e for e in pool.events if e["event"] == "exit" and e["who"] == "spot0")
    assert exit0["note"] == "preempted" and exit0["exit_code"] in (0, None)  # left on SIGTERM, no SIGKILL
    assert not any(e["event"] == "kill" for e in pool.events)


def test_a_worker_deaf_to_sigterm_is_killed_when_the_grace_is_over():
    q, ids, pool = _run(Toy(hold="spot0", deaf=True), "0 join spot0\n0 join spot1\n2 leave spot0 0.3\n")
    _exactly_once(q, ids)
    assert any(e["event"] == "kill" and e["who"] == "spot0" for e in pool.events), pool.events
    exit0 = next(e for e in pool.events if e["event"] == "exit" and e["who"] == "spot0")
    assert exit0["exit_code"] == -signal.SIGKILL


def test_an_sp_group_that_loses_a_member_re_forms_and_finishes_the_work():
    # Only spot0 and spot1 join at 0: the pool forms no group smaller than 2 while a worker is still starting,
    # so they form one group of 2 whichever is ready first; spot2 joins at 1 (a group of 1, or spot0's partner
    # later). spot1 holds its unit until preempted at 6 (seconds of margin for the pair to form and take a
    # lease under load), so its group holds a lease then; its partner re-forms.
    q, ids, pool = _run(Toy(hold="spot1"), "0 join spot0\n0 join spot1\n1 join spot2\n6 leave spot1 0.5\n",
                        requests=8, group_size=2)
    _exactly_once(q, ids)
    forms = [e for e in pool.events if e["event"] == "form"]
    first = next(e for e in forms if "spot1.0" in e["who"])
    assert first["world"] == 2, pool.events  # spot1 runs in a group of 2 ...
    partner = next(k for k in first["who"].split("+") if k != "spot1.0")
    assert any(partner in e["who"] and e["t"] >= 6 for e in forms), pool.events  # ... whose survivor re-forms
    assert q.audit()["returned"] >= 1


def test_a_task_that_keeps_failing_stops_the_pool_in_one_line():
    q, ids = _requests(3)
    pool = SpotPool(Toy(bad=1), parse("0 join spot0\n", "trace"), q, timeout_s=60)
    pool.start()
    try:
        with pytest.raises(RuntimeError) as e:
            q.wait(ids, 120, pool.check)
    finally:
        pool.close()
    assert str(e.value).startswith("spot workers failed request r1 2 times: ValueError: prompt 1 cannot be sampled")
    assert "\n" not in str(e.value)


def test_pending_work_with_no_worker_left_and_none_to_come_is_an_error():
    q, ids = _requests(2)
    pool = SpotPool(Toy(hold="spot0"), parse("0 join spot0\n1 leave spot0 0.2\n", "t.txt"), q, timeout_s=60)
    pool.start()
    try:
        with pytest.raises(RuntimeError, match=r"2 request\(s\) pending and no spot worker left \(the trace has no "
                                               r"join after leave spot0 at 1 s\)"):
            q.wait(ids, 120, pool.check)
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


TRAINER = """
import sys, time
from ditsp.rl.leases import Request, RequestQueue
from ditsp.rl.scheduler import SpotPool
from ditsp.rl.trace import steady
from tests.test_rl_scheduler import Toy
if __name__ == "__main__":
    q = RequestQueue()
    q.submit(Request("r0", "explore", 0, 0, (1,)))
    pool = SpotPool(Toy(hold="spot0"), steady(2), q, timeout_s=60)
    pool.start()
    print(*[w.proc.pid for w in pool.workers], flush=True)
    time.sleep(600)
"""


def test_no_spot_worker_outlives_a_killed_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root, env=env,
                         start_new_session=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(x) for x in pids)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    end = time.monotonic() + 60  # bounded: a stuck orphan fails here
    while any(_alive(x) for x in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(_alive(x) for x in pids), "spot workers outlived their trainer"
