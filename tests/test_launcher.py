"""LocalCluster hardening: ranks die with their parent, slow is not stuck, failures say why, the store stays on
loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ditsp.distributed import shm_gather
from ditsp.distributed.comm import Comm
from ditsp.distributed.heartbeat import Progress
from ditsp.distributed.launcher import LocalCluster, RankError

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux") and Path("/proc/self/stat").exists()


# -- helpers run on the ranks -----------------------------------------------------


def nap(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


def echo(ctx, x):
    return x


def give_lock(ctx):
    return threading.Lock()


def stuck_here(seconds):
    time.sleep(seconds)


def rank1_hangs(ctx):
    """Rank 1 sleeps in ``stuck_here``; rank 0 waits for it inside an all-reduce."""
    if ctx.rank == 1:
        stuck_here(60)
    torch.distributed.all_reduce(torch.zeros(1), group=ctx.group)


def burn(seconds):
    """Compute for ``seconds`` of wall time: no collective, no heartbeat, only CPU time."""
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x += sum(i * i for i in range(1000))
    return x


def computes_past_the_window(ctx, seconds):
    burn(seconds)
    return ctx.rank


def rank1_computes_rank0_waits(ctx, seconds):
    """Rank 0 waits in an all-reduce (no CPU) while rank 1 computes: a slow call, not a stuck one."""
    if ctx.rank == 1:
        burn(seconds)
    torch.distributed.all_reduce(torch.ones(1), group=ctx.group)
    return ctx.rank


def rank1_hangs_rank0_spins(ctx):
    """Rank 0 waits for rank 1 in the shared-memory all-gather, which spins (uses CPU) while it waits."""
    comm = Comm.of(ctx.group)
    rows = [4] * ctx.world_size
    for _ in range(shm_gather.AFTER_CALLS + 2):  # past the calls after which the Comm sets shared memory up
        comm.all_gather_rows(torch.ones(4), rows)
    if ctx.rank == 1:
        stuck_here(60)
    comm.all_gather_rows(torch.ones(4), rows)
    return bool(comm._shm)


def abort_on_rank1(ctx):
    if ctx.rank == 1:
        os.abort()
    return ctx.rank


# -- processes --------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    if LINUX:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


PARENT = textwrap.dedent("""
    import sys
    from ditsp.distributed.launcher import LocalCluster
    from tests.test_launcher import nap

    if __name__ == "__main__":
        cluster = LocalCluster(2, timeout_s=300, fork=sys.argv[1] == "fork")
        print(" ".join(map(str, cluster.pids)), flush=True)
        cluster.run(nap, 300)
""")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_ranks_die_with_their_parent(tmp_path, start):
    """kill -9 / kill -TERM of the parent, TERM to its process group, and the watchdog alone; spawned
    ranks and ranks forked from the parent alike."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    ways = ["kill9", "term", "term-group", "kill9-watchdog-only"]
    parents, ranks = {}, {}
    for way in ways:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if way == "kill9-watchdog-only":
            env["DITSP_NO_PDEATHSIG"] = "1"
        parents[way] = subprocess.Popen([sys.executable, str(script), start], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        for way, p in parents.items():
            ranks[way] = [int(x) for x in p.stdout.readline().split()]
        for way, pids in ranks.items():
            assert len(pids) == 2 and all(_alive(pid) for pid in pids), (way, pids)
        time.sleep(0.5)  # the nap is posted and running
        for way, p in parents.items():
            if way == "term-group":
                os.killpg(p.pid, signal.SIGTERM)
            else:
                os.kill(p.pid, signal.SIGKILL if way.startswith("kill9") else signal.SIGTERM)
        for p in parents.values():
            p.wait(timeout=10)
        end = time.monotonic() + 8.0
        while time.monotonic() < end and any(_alive(pid) for pids in ranks.values() for pid in pids):
            time.sleep(0.1)
        left = {way: [pid for pid in pids if _alive(pid)] for way, pids in ranks.items()}
        assert not any(left.values()), f"ranks outlived their parent: {left}"
    finally:
        for way, p in parents.items():
            for pid in ranks.get(way, []):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            if p.poll() is None:
                p.kill()


FORKED = textwrap.dedent("""
    import atexit, json, os, signal, sys, threading
    from ditsp.distributed.launcher import LocalCluster
    from tests.test_launcher import what_a_rank_inherited

    if __name__ == "__main__":
        threads, other_thread = int(sys.argv[2]), sys.argv[3] == "1"
        sys.modules["parent_only_marker"] = object()  # in a forked rank's sys.modules, never a spawned one's
        atexit.register(lambda: open(sys.argv[1], "a").write(f"{os.getpid()}\\n"))
        signal.signal(signal.SIGTERM, lambda *a: None)
        if other_thread:
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        with LocalCluster(2, timeout_s=60, threads=threads, fork=True) as cluster:
            print(json.dumps(cluster.run(what_a_rank_inherited)), flush=True)
""")


def what_a_rank_inherited(ctx):
    return {"forked": "parent_only_marker" in sys.modules, "sigterm_default": signal.getsignal(signal.SIGTERM)
            == signal.SIG_DFL, "pid": os.getpid()}


@pytest.mark.skipif(not LINUX, reason="fork")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads,other_thread,forked", [(1, False, True), (2, False, False), (1, True, False)])
def test_fork_only_where_safe_and_the_parents_handlers_stay_the_parents(tmp_path, threads, other_thread, forked):
    """``fork=True`` forks the ranks from a one-thread parent whose ranks compute on one thread each, else
    spawns them; a forked rank drops the parent's exit and SIGTERM handlers (the exit handler runs once,
    in the parent)."""
    script, ran = tmp_path / "parent.py", tmp_path / "atexit.txt"
    script.write_text(FORKED)
    out = subprocess.run([sys.executable, str(script), str(ran), str(threads), str(int(other_thread))], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)
    assert [r["forked"] for r in ranks] == [forked, forked]
    assert all(r["sigterm_default"] for r in ranks)
    (runner,) = ran.read_text().split()  # the parent's exit handler ran once, in the parent
    assert int(runner) not in {r["pid"] for r in ranks}


# -- failures say why -------------------------------------------------------------


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match=r"threads must be an integer >= 1.*got 0"):
        LocalCluster(2, threads=0)
    with pytest.raises(ValueError, match="world_size"):
        LocalCluster(0)


# "At once" below: the calls' no-progress window (an hour) is far past the test's own timeout, so a failure
# that waited for it would fail the test instead of passing slowly; no test here times a busy machine.
AT_ONCE = 3600.0


@pytest.mark.timeout(120)
def test_unpicklable_call_fails_at_once_and_keeps_the_cluster(clusters):
    c = clusters(2)
    calls = c._calls
    with pytest.raises(RankError, match="cannot send the call to the ranks") as e:
        c.run(lambda ctx: 1, timeout_s=AT_ONCE)
    assert "pickle" in str(e.value).splitlines()[0]
    with pytest.raises(RankError, match=r"echo: cannot send the call.*(pickle|Lock)"):
        c.run(echo, threading.Lock(), timeout_s=AT_ONCE)
    assert c._calls == calls  # refused before anything was sent
    assert c.alive and c.run(echo, 5) == [5, 5]


@pytest.mark.timeout(120)
def test_unpicklable_result_says_so_at_once(clusters):
    with pytest.raises(RankError) as e:
        clusters(2).run(give_lock, timeout_s=AT_ONCE)
    first = str(e.value).splitlines()[0]
    assert first.startswith("give_lock failed on 2 ranks: ranks 0, 1: the result (lock) cannot be pickled back")


# -- slow is not stuck -----------------------------------------------------------


def _use_cpu(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_cpu_time_is_progress_outside_waits_only():
    p = Progress(window_s=10.0, start=0.0)
    me = os.getpid()
    assert p.look("spin", 1.0, me, beat=0, wait=1) == 0.0  # inside a wait (odd)
    _use_cpu(0.2)
    assert p.look("spin", 2.0, me, beat=0, wait=1) == 0.0  # the same wait throughout: its CPU is no progress
    _use_cpu(0.2)
    assert p.look("spin", 3.0, me, beat=0, wait=2) == 3.0  # the wait ended, the CPU since is computing
    assert p.look("beats", 1.0, None, beat=5) == 0.0
    assert p.look("beats", 2.0, None, beat=5) == 0.0  # no CPU reading, no heartbeat: no progress
    assert p.look("beats", 3.0, None, beat=6) == 3.0  # a heartbeat


@pytest.mark.timeout(120)
def test_ranks_computing_past_the_window_without_collectives_are_not_stuck(clusters):
    """The no-progress window is 2 s; the ranks compute for 6 s with no collective and no heartbeat (a heavy
    step on a busy machine). Before, the call was declared stuck after 2 s."""
    assert clusters(2).run(computes_past_the_window, 6.0, timeout_s=2.0) == [0, 1]


@pytest.mark.timeout(120)
def test_a_rank_waiting_on_a_computing_peer_is_not_stuck(clusters):
    """Rank 0 waits in a collective (no CPU) while rank 1 computes for 6 s: the call progresses."""
    assert clusters(2).run(rank1_computes_rank0_waits, 6.0, timeout_s=2.0) == [0, 1]


@pytest.mark.timeout(90)
def test_a_spin_wait_is_not_progress(clusters):
    """The shared-memory all-gather burns CPU while it waits; that CPU does not keep a stuck call alive (here it
    would run until rank 1 woke after 60 s and then pass)."""
    with pytest.raises(RankError) as e:
        clusters(2).run(rank1_hangs_rank0_spins, timeout_s=2)
    first = str(e.value).splitlines()[0]
    assert "ranks 0, 1 made no progress for 2 s" in first and "rank 1 in stuck_here (tests/test_launcher.py:" in first
    if shm_gather.enabled() and os.uname().machine in shm_gather._ORDERED_STORES:
        assert "rank 0 in _wait (ditsp/distributed/shm_gather.py:" in first


@pytest.mark.timeout(120)
def test_hung_rank_reports_every_threads_stack(clusters):
    """Found stuck one 2 s window after both ranks stopped (rank 1 sleeps 60 s: the test's timeout bounds it)."""
    with pytest.raises(RankError) as e:
        clusters(2).run(rank1_hangs, timeout_s=2)
    msg = str(e.value)
    first = msg.splitlines()[0]  # one line: both ranks, and where each one's call waits
    assert first.startswith("rank1_hangs failed on 2 ranks: ranks 0, 1 made no progress for 2 s "
                            "(no heartbeat, no CPU time outside waits): rank 0 in all_reduce (torch/distributed/")
    assert " from rank1_hangs (tests/test_launcher.py:" in first
    assert first.endswith(", rank 1 in stuck_here (tests/test_launcher.py:%d)" % (stuck_here.__code__.co_firstlineno + 1))
    rank1 = msg.split("--- rank 1")[1]
    assert "stuck_here" in rank1 and "rank1_hangs" in rank1  # the stack of the hung rank, innermost function
    assert "all_reduce" in msg.split("--- rank 0")[1].split("--- rank 1")[0]  # its peer waits in the collective
    assert "_watch_parent" in rank1  # every thread, not just the main one


@pytest.mark.timeout(60)
def test_crashed_rank_reports_its_signal_and_stack(clusters):
    with pytest.raises(RankError) as e:
        clusters(2).run(abort_on_rank1, timeout_s=30)
    msg = str(e.value)
    assert msg.splitlines()[0].startswith("abort_on_rank1 failed on 2 ranks: rank 1: died of SIGABRT (exit code -6)")
    assert "abort_on_rank1" in msg.split("--- rank 1 ---")[1]  # the crash stack faulthandler wrote
    assert "rank 0" not in msg.splitlines()[0]  # rank 0's answer came through


@pytest.mark.timeout(120)
def test_rank_that_fails_at_start_reports_its_exception(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(RankError) as e:
        LocalCluster(2, timeout_s=AT_ONCE)
    first = str(e.value).splitlines()[0]
    assert first.startswith("start-up failed on 2 ranks: ranks 0, 1: RuntimeError: ") and "no-such-if0" in first
    assert "exit code" not in first


# -- the rendezvous store and gloo stay on loopback ----------------------------------


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket the given processes own."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                out.append((addr, int(port, 16)))
    return out


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_store_and_ranks_listen_on_loopback_only(clusters):
    c = clusters(2)
    assert c.store_address[0] == "127.0.0.1"
    assert c.run(echo, None) == [None, None]
    port = c.store_address[1]
    store = [(a, p) for a, p in _listening([os.getpid()]) if p == port]
    assert store and all(a in LOOPBACK_HEX for a, _ in store), store
    ranks = _listening(c.pids)
    assert all(a in LOOPBACK_HEX for a, _ in ranks), f"a rank listens beyond loopback: {ranks}"
