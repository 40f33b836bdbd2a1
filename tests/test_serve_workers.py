"""`ditsp serve`'s worker processes (issue 44 items 1, 5 and 12): weights that fail to load stop the server
in one line instead of respawning workers without end; workers that keep dying are replaced a bounded number
of times, then the server stops; no worker outlives a server killed with SIGKILL, not even one still
starting; `--sp` is bounded by the machine and nonsensical timeouts are refused before anything starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ditsp.cli import main
from ditsp.serve import Settings
from ditsp.serve import controller as controller_mod
from ditsp.serve import handles
from ditsp.serve.store import JobStore

from .test_serve import Server as WorkerServer

pytestmark = pytest.mark.timeout(300)
SERVE = [sys.executable, "-c", "import sys; from ditsp.cli import main; sys.exit(main())", "serve", "--port", "0"]


def children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat and stat[0] != "Z" and int(stat[1]) == pid:
                out.add(int(name))
    return out


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # an orphan's zombie is not reaped in every container


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def has_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def nan_dit(tmp_path_factory):
    """The tiny DiT with one NaN (what issue 44 loaded)."""
    from safetensors.torch import save_file

    from ditsp.models.seedvr2.nadit.model import build_model

    sd = {k: v.clone().contiguous() for k, v in build_model("tiny").state_dict().items()}
    first = next(k for k, v in sd.items() if v.dtype.is_floating_point and v.numel() > 1)
    sd[first].view(-1)[0] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "nan.safetensors"
    save_file(sd, str(path))
    return str(path)


def test_weights_that_fail_to_load_stop_the_server_in_one_line(tmp_path, nan_dit):
    """Before: 46 worker processes 6.5 s after start, /healthz 503 for ever, the server never stopped."""
    p = subprocess.Popen(SERVE + ["--sp", "1", "--random-weights", "--dit", nan_dit, "--data-dir", str(tmp_path / "d")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    try:
        end = time.monotonic() + 240  # a stuck server, not a slow one: loading the tiny model takes seconds
        while p.poll() is None and time.monotonic() < end:
            seen |= children(p.pid)
            time.sleep(0.05)
        assert p.poll() == 1, "the server did not stop"
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ditsp serve: error: cannot load the weights: "), err[-2000:]
    assert "NaN" in lines[-1] or "non-finite" in lines[-1], lines[-1]
    assert "Traceback" not in err, err[-3000:]
    assert 1 <= len(seen) <= 2, seen  # the one worker (and multiprocessing's resource tracker): none respawned
    for _ in range(150):  # a child notices its parent's end on its own (the resource tracker by its pipe): 15 s
        if not [q for q in seen if alive(q)]:
            break
        __import__("time").sleep(0.1)
    assert not [q for q in seen if alive(q)]


def test_jobs_are_refused_once_the_weights_failed(tmp_path, nan_dit):
    """Before: /healthz said 503 for ever while POST /v1/jobs answered 201 and the job never ran."""
    srv = WorkerServer(Settings(data_dir=str(tmp_path / "d"), sp=2, random_weights=True, dit=nan_dit))
    try:
        controller = srv.app.state.controller
        assert controller.failed.wait(240), "the controller did not give up"
        assert controller.error.startswith("cannot load the weights: ")
        assert controller._next_index == 2  # no worker was spawned after the first two
        assert not controller.members + controller.joining
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/jobs", files={"file": ("x.mp4", b"0" * 100)})
            assert r.status_code == 503 and r.json()["detail"].startswith("the server cannot run jobs: cannot load")
            h = c.get("/healthz")
            assert h.status_code == 503 and h.json()["status"] == "failed"
    finally:
        srv.close()


class DyingWorker(handles.Worker):
    """A worker whose process ends at once, before its hello (as one that crashes while importing)."""

    started: list = []

    def __init__(self, index, port, timeout_s=60.0, threads=1):
        ctx = multiprocessing.get_context("fork")
        self.index, self.ready, self._ids = index, False, 0
        self.answers, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=os._exit, args=(3,))
        self.proc.start()
        writer.close()
        DyingWorker.started.append(self)


def test_workers_that_keep_dying_are_replaced_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Before: a worker ending before its hello crashed the scheduler (EOFError), and a failing worker was
    replaced without bound."""
    monkeypatch.setattr(controller_mod, "Worker", DyingWorker)
    monkeypatch.setattr(controller_mod, "RESPAWN_WAIT_S", (0.01, 0.04))
    DyingWorker.started = []
    store = JobStore(tmp_path / "d")
    ctl = controller_mod.Controller(store, None, 2)
    try:
        ctl.start()
        assert ctl.failed.wait(120), "the controller did not give up"
        assert len(DyingWorker.started) == 2 + ctl.max_failures, len(DyingWorker.started)
        assert ctl.error.startswith("no rank is left and none is started (") and "exit code 3" in ctl.error
        assert "\n" not in ctl.error and ctl.refusal().startswith("the server cannot run jobs: no rank is left")
    finally:
        ctl.stop()
        store.close()


def test_replacements_wait_longer_after_each_failure_in_a_row(tmp_path):
    store = JobStore(tmp_path / "d")
    try:
        ctl = controller_mod.Controller(store, None, 1)
        waits = []
        for _ in range(ctl.max_failures + 2):
            before = time.monotonic()
            ctl._spawn_at = 0.0
            ctl._replace("worker 0 lost (exit code 9)")
            waits.append(round(max(0.0, ctl._spawn_at - before), 1))
        first, longest = controller_mod.RESPAWN_WAIT_S
        assert waits[0] == 0.0 and waits[1] == first and waits[2] == 2 * first  # the first at once, then doubling
        assert max(waits) <= longest
        assert ctl._owed == ctl.max_failures  # none owed past the bound
        assert ctl.refusal() is not None and "retrying" in ctl.refusal()  # no member up after failures
    finally:
        store.close()


def test_no_worker_outlives_a_killed_server_even_while_starting(tmp_path):
    """SIGKILL the server the moment its workers exist (they are still importing torch). Before, each one
    finished its imports (seconds; 46 of them took a minute) as an orphan; now the kernel's parent-death
    signal is armed before any heavy import, so none gets as far as loading torch once its server is gone."""
    p = subprocess.Popen(SERVE + ["--sp", "2", "--random-weights", "--data-dir", str(tmp_path / "d")],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert "listening on" in p.stdout.readline()
        end = time.monotonic() + 60
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < end:
            workers = {c for c in children(p.pid) if b"spawn_main" in _cmdline(c)}
            time.sleep(0.005)
        assert workers, "no worker started"
        kids = children(p.pid)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    end = time.monotonic() + 120  # bounded: a stuck orphan fails here
    while [k for k in kids if alive(k)] and time.monotonic() < end:
        late = [k for k in kids if alive(k) and has_torch(k)]
        assert not late, f"worker(s) {late} went on to load torch after their server died"
        time.sleep(0.02)
    assert not [k for k in kids if alive(k)], "processes of the killed server are still running"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.parametrize("args", [["--timeout", "0"], ["--timeout", "nan"], ["--timeout", "inf"],
                                  ["--timeout", "-1"], ["--job-timeout", "-5"], ["--job-timeout", "nan"],
                                  ["--job-timeout", "inf"], ["--job-timeout", "0"], ["--retention-hours", "nan"],
                                  ["--sp", "100000"]])
def test_nonsense_numbers_are_refused_before_anything_starts(tmp_path, capsys, args):
    """Before: the server started and then ran no rank (`--sp 100000` spawned workers without bound)."""
    result = []
    t = threading.Thread(target=lambda: result.append(main(["serve", "--port", "0", "--data-dir",
                                                            str(tmp_path / "d"), *args])), daemon=True)
    t.start()
    t.join(60)
    assert result == [1], "the server started"
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ditsp serve: error: {args[0]}") and "\n" not in err, err
    assert not (tmp_path / "d").exists()
