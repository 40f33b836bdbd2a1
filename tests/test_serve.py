"""`ditsp serve`: a real server on 127.0.0.1, a real HTTP client; jobs, restarts, a rank killed mid-job, bad requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from ditsp.io.testclip import make_test_clip
from ditsp.io.probe import probe
from ditsp.serve import Settings, create_app

pytestmark = pytest.mark.timeout(180)

TOKEN = "t0ken-for-the-tests-0123456789"
MODEL = "tiny-8x"  # the reference vectors' structures, seeded: quick, and the same weights in every process
OPTS = {"resolution": "48x32", "window_frames": 5, "overlap": 2}
FINAL = ("done", "failed", "cancelled")


def reference_sha(clip: str, tmp: Path, opts: dict) -> str:
    """The frames' sha256 of the same restoration on one device, in this process."""
    from ditsp.distributed.launcher import RankContext
    from ditsp.models.seedvr2.job.request import Options, check
    from ditsp.models.seedvr2.job.restore import rank_upscale

    torch.set_num_threads(1)
    req = check(Options(input=clip, output=str(tmp / f"ref-{os.path.basename(clip)}"), model=MODEL,
                        random_weights=True, resolution=opts["resolution"], window_frames=opts["window_frames"],
                        overlap=opts["overlap"], progress=False, deterministic=True)).req  # the server's policy
    return rank_upscale(RankContext(0, 1, None, torch.device("cpu")), req)["sha256"]


class Server:
    """A server in a thread of this process, on a free loopback port."""

    def __init__(self, settings: Settings):
        self.app = create_app(settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


def client(url: str, token: str | None = TOKEN) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=120)


def wait_healthy(c: httpx.Client, ranks: int | None = None, timeout: float = 90.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            r = c.get("/healthz")
            if r.status_code == 200 and (ranks is None or r.json()["ranks"] == ranks):
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not healthy with {ranks} ranks in {timeout} s")


def submit(c: httpx.Client, clip: str, opts: dict = OPTS, name: str | None = None) -> str:
    with open(clip, "rb") as f:
        r = c.post("/v1/jobs", files={"file": (name or os.path.basename(clip), f)}, data={"options": json.dumps(opts)})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def wait_job(c: httpx.Client, job_id: str, timeout: float = 90.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        j = c.get(f"/v1/jobs/{job_id}").json()
        if j["state"] in FINAL:
            return j
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not finished in {timeout} s: {j}")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    short = str(make_test_clip(str(d / "short.mp4"), width=48, height=32, frames=5, fps=12, audio=False))
    long = str(make_test_clip(str(d / "long.mp4"), width=48, height=32, frames=41, fps=12, audio=False))
    ref = tmp_path_factory.mktemp("ref")
    return {"dir": str(d), "short": short, "long": long,
            "short_sha": reference_sha(short, ref, OPTS), "long_sha": reference_sha(long, ref, OPTS)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, clips):
    data = tmp_path_factory.mktemp("data")
    srv = Server(Settings(data_dir=str(data), sp=2, model=MODEL, random_weights=True, token=TOKEN,
                          allow_input=[clips["dir"]], max_upload_mb=0.25))
    with client(srv.url) as c:
        wait_healthy(c, ranks=2)
    srv.data = data
    yield srv
    srv.close()


def test_submit_poll_fetch(server, clips):
    with client(server.url) as c:
        job_id = submit(c, clips["short"])
        j = wait_job(c, job_id)
        assert j["state"] == "done" and j["progress"] == 1.0 and j["world_size"] == 2, j
        assert j["progress_total"] == 4  # rank 0's progress callback: 4 steps for the clip's one window
        assert j["report"]["sha256"] == clips["short_sha"]  # SP=2 on the server == one device
        assert not [n for n in os.listdir(server.data / "uploads") if n.startswith(job_id)]  # a done job's upload goes
        r = c.get(f"/v1/jobs/{job_id}/result")
        assert r.status_code == 200 and len(r.content) > 0
        out = server.data / "fetched.mp4"
        out.write_bytes(r.content)
        assert probe(out).frames == 5
        assert job_id in [x["id"] for x in c.get("/v1/jobs").json()["jobs"]]
        assert [x["id"] for x in c.get("/v1/jobs", params={"state": "done"}).json()["jobs"]].count(job_id) == 1
        text = c.get("/metrics").text
        for name in ("ditsp_queue_depth", "ditsp_job_latency_seconds", "ditsp_stage_seconds_total",
                     "ditsp_reconfigurations_total", "ditsp_ranks 2.0"):
            assert name in text, name


def test_concurrent_jobs_queue_and_complete(server, clips):
    with client(server.url) as c:
        def one(i):
            if i == 2:  # by path under an allowed input folder
                r = c.post("/v1/jobs", data={"path": "short.mp4", "options": json.dumps(OPTS)})
                assert r.status_code == 201, r.text
                return r.json()["id"]
            return submit(c, clips["short"])

        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(one, range(4)))
        # a fifth one is cancelled while it waits
        extra = submit(c, clips["short"])
        assert c.post(f"/v1/jobs/{extra}/cancel").json()["state"] in ("cancelled", "running", "done")
        jobs = [wait_job(c, i) for i in ids]
        assert all(j["state"] == "done" and j["report"]["sha256"] == clips["short_sha"] for j in jobs), jobs
        assert wait_job(c, extra)["state"] in ("cancelled", "done")


def test_rank_killed_mid_job_then_a_new_rank_joins(server, clips):
    with client(server.url) as c:
        pid = wait_healthy(c, ranks=2)["workers"][1]["pid"]
        job_id = submit(c, clips["long"])
        end = time.monotonic() + 60
        while (j := c.get(f"/v1/jobs/{job_id}").json())["progress_done"] < 1:
            assert time.monotonic() < end and j["state"] not in FINAL, j
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        j = wait_job(c, job_id)
        assert j["state"] == "done" and j["attempts"] == 2, j  # interrupted once, re-run
        assert j["world_size"] == 1 and j["report"]["sha256"] == clips["long_sha"]  # same frames as one device
        h = wait_healthy(c, ranks=2)  # a fresh worker joined and got the weights from its peer
        lost = [r for r in h["reconfigurations"] if r["reason"] == "rank lost"]
        joined = [r for r in h["reconfigurations"] if r["reason"] == "rank joined"]
        assert lost and lost[-1]["world"] == 1 and lost[-1]["weights_source"] == ""  # survivors kept theirs
        assert 0 <= lost[-1]["drain_s"] <= lost[-1]["total_s"]  # where the time went: survivors leaving the job
        assert joined and joined[-1]["world"] == 2 and joined[-1]["weights_source"] == "peer"
        assert joined[-1]["weights_bytes"] > 1_000_000
        assert pid not in [w["pid"] for w in h["workers"]]
        j2 = wait_job(c, submit(c, clips["long"]))
        assert j2["world_size"] == 2 and j2["report"]["sha256"] == clips["long_sha"]  # peer weights: same bits
        assert 'ditsp_reconfigurations_total{reason="rank lost"} 1.0' in c.get("/metrics").text


def test_auth(server):
    with client(server.url, token=None) as c:
        for path in ("/healthz", "/metrics", "/v1/jobs"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["detail"] == "missing bearer token", path
        assert c.post("/v1/jobs", data={"path": "short.mp4"}).status_code == 401
    with client(server.url, token="wrong-token-wrong-token") as c:
        assert c.get("/v1/jobs").status_code == 401 and c.get("/v1/jobs").json()["detail"] == "wrong token"
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Basic {TOKEN}"}) as c:
        assert c.get("/v1/jobs").status_code == 401


def test_bad_requests(server, clips, tmp_path):
    with client(server.url) as c:
        big = tmp_path / "big.mp4"
        big.write_bytes(os.urandom(400_000))
        r = c.post("/v1/jobs", files={"file": ("big.mp4", big.read_bytes())})
        assert r.status_code == 413, r.text
        corrupt = c.post("/v1/jobs", files={"file": ("x.mp4", os.urandom(5000))})
        assert corrupt.status_code == 400 and "cannot be read" in corrupt.json()["detail"]
        assert c.post("/v1/jobs", files={"file": ("x.exe", b"MZ" * 100)}).status_code == 415
        assert c.post("/v1/jobs", files={"file": ("noext", b"0" * 100)}).status_code == 415
        # the client's file name is never a path: the upload lands under the data dir as <id>.mp4
        with open(clips["short"], "rb") as f:
            r = c.post("/v1/jobs", files={"file": ("../../../../tmp/evil/../x.mp4", f)},
                       data={"options": json.dumps(OPTS)})
        assert r.status_code == 201 and r.json()["input_name"] == "x.mp4"
        assert sorted(os.listdir(server.data / "uploads"))  # only ids there
        assert all(len(Path(n).stem) == 32 for n in os.listdir(server.data / "uploads"))
        for bad in ("../short.mp4", "/etc/passwd", "../../etc/passwd", clips["dir"] + "/../x.mp4"):
            r = c.post("/v1/jobs", data={"path": bad})
            assert r.status_code in (403, 404) and "allowed" in r.json()["detail"], (bad, r.text)
        os.symlink("/etc/hostname", os.path.join(clips["dir"], "link.mp4"))
        assert c.post("/v1/jobs", data={"path": "link.mp4"}).status_code == 403  # symlinks resolved first
        assert c.post("/v1/jobs", data={"path": "missing.mp4"}).status_code == 404
        assert c.post("/v1/jobs", data={}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": "{bad json"}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": '{"sp": 8}'}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": '{"crf": 99}'}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": '{"color_fix": "x"}'}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": '{"format": "png"}'}).status_code == 400
        assert c.post("/v1/jobs", data={"path": "short.mp4", "options": '{"window_frames": -1}'}).status_code == 400
        for job_id in ("0" * 32, "nope", "..%2F..%2Fetc"):
            assert c.get(f"/v1/jobs/{job_id}").status_code == 404
            assert c.get(f"/v1/jobs/{job_id}/result").status_code == 404
            assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert c.get("/v1/jobs", params={"state": "weird"}).status_code == 400
        queued = c.post("/v1/jobs", data={"path": "short.mp4", "options": json.dumps(OPTS)}).json()["id"]
        r = c.get(f"/v1/jobs/{queued}/result")
        assert r.status_code in (409, 200)


@pytest.mark.timeout(600)  # two server starts and four jobs; each step has its own bound below
def test_restart_mid_queue_loses_no_job(clips, tmp_path):
    """A server killed (SIGKILL) with a job running and more queued: after a restart every job completes."""
    data = tmp_path / "data"
    cmd = [sys.executable, "-c", "import sys; from ditsp.cli import main; sys.exit(main())", "serve", "--sp", "1",
           "--model", MODEL, "--random-weights", "--port", "0", "--data-dir", str(data)]

    def start():
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        line = p.stdout.readline()
        assert "listening on" in line, line
        return p, line.split("listening on ")[1].split()[0]

    p, url = start()
    try:
        with client(url, token=None) as c:
            wait_healthy(c)
            ids = [submit(c, clips["short"]) for _ in range(3)]
            while c.get(f"/v1/jobs/{ids[0]}").json()["state"] != "running":
                time.sleep(0.02)
        p.kill()
        p.wait(10)
        p, url = start()
        with client(url, token=None) as c:
            wait_healthy(c)
            jobs = [wait_job(c, i) for i in ids]
        assert all(j["state"] == "done" and j["report"]["sha256"] == clips["short_sha"] for j in jobs), jobs
        assert jobs[0]["attempts"] >= 1
    finally:
        p.kill()
        p.wait(10)
