"""`ditsp serve` reliability round 3 (issue 29): the data dir's mode and lock, owners of running jobs,
named pipes, masked paths, stale temporary results. Real servers on 127.0.0.1, no workers where none
are needed (requests are checked before any worker sees them)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn

from ditsp.cli import main
from ditsp.io.testclip import make_test_clip
from ditsp.serve import Settings, create_app
from ditsp.serve.store import JobStore

pytestmark = pytest.mark.timeout(120)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class Server:
    """A server without workers in a thread of this process, on a free loopback port."""

    def __init__(self, settings: Settings):
        self.app = create_app(settings, start_workers=False)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# -- item 1: the data dir's mode ----------------------------------------------------------------------


def test_an_existing_data_dir_keeps_its_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    JobStore(shared).close()
    assert mode(shared) == 0o755  # never chmodded
    assert mode(shared / "uploads") == 0o700 and mode(shared / "results") == 0o700


def test_a_new_data_dir_is_created_0700(tmp_path):
    old = os.umask(0o000)
    try:
        JobStore(tmp_path / "a" / "new").close()
    finally:
        os.umask(old)
    assert mode(tmp_path / "a" / "new") == 0o700


@pytest.mark.parametrize("bits", [0o777, 0o775, 0o1777])
def test_a_group_or_world_writable_data_dir_is_refused(tmp_path, bits):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(ValueError, match="writable by its group or others"):
        JobStore(d)
    assert mode(d) == bits and not (d / "jobs.sqlite").exists()


def test_serve_refuses_an_unsafe_data_dir_in_one_line(tmp_path, capsys):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert main(["serve", "--port", "0", "--data-dir", str(d)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ditsp serve: error: --data-dir") and "writable" in err and "\n" not in err


# -- item 3: one server per data dir; re-queue only jobs whose owner is gone --------------------------


def test_one_server_per_data_dir(tmp_path, capsys):
    d = tmp_path / "data"
    first = JobStore(d)
    try:
        with pytest.raises(ValueError, match=f"in use by another ditsp serve \\(pid {os.getpid()} "):
            JobStore(d)
        assert main(["serve", "--port", "0", "--data-dir", str(d)]) == 1
        err = capsys.readouterr().err.strip()
        assert "in use by another ditsp serve" in err and "\n" not in err
    finally:
        first.close()
    JobStore(d).close()  # released with the first one


def test_recover_requeues_only_jobs_whose_owner_is_gone(tmp_path):
    d = tmp_path / "data"
    s = JobStore(d)
    for i in range(2):
        s.add(f"{i:032x}", "in.mp4", False, "in.mp4", "out.mp4", {}, {})
    assert s.claim_next()["id"] == f"{0:032x}"
    assert s.recover() == 0 and s.get(f"{0:032x}")["state"] == "running"  # its own live job stays
    s.close()
    s = JobStore(d)  # the next server: the first one's running job is orphaned
    try:
        assert s.recover() == 1
        assert [j["state"] for j in s.list()] == ["queued", "queued"]
    finally:
        s.close()


def test_stale_temporary_results_are_swept_at_start(tmp_path):
    d = tmp_path / "data"
    JobStore(d).close()
    stale = d / "results" / f".{'a' * 32}.tmp-{dead_pid()}-0123abcd.mp4"
    stale.write_bytes(b"half")
    JobStore(d).close()
    assert not stale.exists()


# -- items 9 and 10: named pipes; masked paths -----------------------------------------------------------


@pytest.fixture
def allowed(tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    make_test_clip(str(d / "ok.mp4"), width=32, height=32, frames=5, fps=12, audio=False)
    os.mkfifo(d / "pipe.mp4")
    frames = d / "frames"
    frames.mkdir()
    os.mkfifo(frames / "0001.png")
    return d


def test_named_pipes_are_refused_at_once(tmp_path, allowed):
    data = tmp_path / "data"
    with Server(Settings(data_dir=str(data), allow_input=[str(allowed)], random_weights=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        for path in ("pipe.mp4", "frames"):
            r = c.post("/v1/jobs", data={"path": path, "options": "{}"})
            assert r.status_code == 400 and "not a regular file" in r.json()["detail"], (path, r.text)
        r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": json.dumps({"resolution": "32x32"})})
        assert r.status_code == 201, r.text


def test_error_bodies_do_not_show_server_paths(tmp_path, allowed):
    data = tmp_path / "data"
    with Server(Settings(data_dir=str(data), allow_input=[str(allowed)], random_weights=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        bodies = [c.post("/v1/jobs", files={"file": ("x.mp4", os.urandom(5000))}).text,
                  c.post("/v1/jobs", data={"path": "ok.mp4", "options": '{"window_frames": -1}'}).text,
                  c.post("/v1/jobs", data={"path": "ok.mp4", "options": '{"size": "8x8"}'}).text]
        for body in bodies:
            assert str(tmp_path) not in body and os.path.realpath(tmp_path) not in body, body
        assert "<data>" in bodies[0]


# -- item 16: retention and the cost of a refusal ----------------------------------------------------------


def test_a_cancelled_queued_job_loses_its_upload(tmp_path, allowed):
    data = tmp_path / "data"
    with Server(Settings(data_dir=str(data), random_weights=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        with open(allowed / "ok.mp4", "rb") as f:
            r = c.post("/v1/jobs", files={"file": ("ok.mp4", f)}, data={"options": '{"resolution": "32x32"}'})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert os.listdir(data / "uploads") == [f"{job_id}.mp4"]
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        assert os.listdir(data / "uploads") == []  # before: kept for ever


def test_results_past_the_retention_are_deleted(tmp_path):
    import time

    from ditsp.serve.controller import Controller

    store = JobStore(tmp_path / "data")
    try:
        paths = {}
        for name in ("old", "new"):
            job_id = f"{len(paths):032x}"
            src, out = store.uploads / f"{job_id}.mp4", store.results / f"{job_id}.mp4"
            src.write_bytes(b"in")
            out.write_bytes(b"out")
            store.add(job_id, str(src), True, "x.mp4", str(out), {}, {})
            store.finish(job_id, "done")
            paths[name] = (src, out)
        store._exec("UPDATE jobs SET finished=? WHERE id=?", (time.time() - 7200, f"{0:032x}"))
        Controller(store, None, 1, retention_s=3600)._expire()
        assert not paths["old"][0].exists() and not paths["old"][1].exists()
        assert paths["new"][1].exists()  # finished within the hour: kept
    finally:
        store.close()


def test_refusing_a_huge_request_builds_the_vae_once(tmp_path, allowed, monkeypatch):
    """The estimate counts the VAE's parameters on the meta device; before, it rebuilt it ~100 times per
    refusal (10 s of CPU for a 99999x99999 request)."""
    from ditsp.models.seedvr2.job import request
    from ditsp.models.seedvr2.vae import memory, model

    memory.num_params.cache_clear()
    built = []
    init = model.VideoVAE.__init__
    monkeypatch.setattr(model.VideoVAE, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    opts = request.Options(input=str(allowed / "ok.mp4"), output=str(tmp_path / "o.mp4"), sp=2, model="seedvr2-3b",
                           random_weights=True,
                           resolution="99999x99999", seed=1, color_fix="none", timeout=60.0, progress=False)
    for _ in range(2):
        checked = request.check(opts)
        with pytest.raises(MemoryError, match="does not fit"):
            request.check_memory(checked, opts)
    assert len(built) <= 1, len(built)


# -- item 14: survivors of a mid-job loss stop at once ------------------------------------------------------


def test_a_survivor_is_interrupted_inside_a_job_only():
    """A worker told that a peer died raises at once inside a job (before: it computed on until its next
    collective failed, seconds on a large window); between commands the signal is ignored."""
    import signal
    import time

    from ditsp.serve import workers

    before = signal.signal(workers.PEER_LOST_SIGNAL, workers._on_peer_lost)
    try:
        os.kill(os.getpid(), workers.PEER_LOST_SIGNAL)  # not in a job: nothing happens
        time.sleep(0.05)
        workers._in_job[0] = True
        with pytest.raises(workers.PeerLost):
            os.kill(os.getpid(), workers.PEER_LOST_SIGNAL)
            for _ in range(100):  # "computing": the handler runs between bytecodes
                time.sleep(0.01)
        assert workers._in_job[0] is False
    finally:
        workers._in_job[0] = False
        signal.signal(workers.PEER_LOST_SIGNAL, before)
