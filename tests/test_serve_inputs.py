"""`ditsp serve` inputs and hostile requests (issue 44 items 4 and 12): a named input is opened once at
submission and pinned under the data dir, so swapping it for a link afterwards reads nothing outside
``--allow-input``; absurd options, query values and a full data disk get a JSON 4xx/507 with one line, never
a plain-text 500. Real servers on 127.0.0.1 without workers (requests are checked before a worker sees them)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3

import httpx
import pytest
from PIL import Image

from ditsp.io.testclip import make_test_clip
from ditsp.serve import Settings
from ditsp.serve import inputs as inputs_mod
from ditsp.serve.inputs import Inputs
from ditsp.serve.store import JobStore

from .test_serve_reliability import Server

pytestmark = pytest.mark.timeout(120)
OPTS = json.dumps({"resolution": "32x32"})


def picture(path, shade: int) -> None:
    Image.new("RGB", (32, 32), (shade * 25, 100, 200)).save(path)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def folders(tmp_path):
    allowed, outside = tmp_path / "inputs", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_test_clip(str(allowed / "ok.mp4"), width=32, height=32, frames=5, fps=12, audio=False)
    make_test_clip(str(outside / "secret.mp4"), width=32, height=32, frames=7, fps=12, audio=False)
    frames = allowed / "frames"
    frames.mkdir()
    for i in range(3):
        picture(frames / f"{i}.png", i)
    (frames / ".hidden.png").write_bytes(b"not read")
    return allowed, outside


def settings(tmp_path, allowed) -> Settings:
    return Settings(data_dir=str(tmp_path / "data"), allow_input=[str(allowed)], random_weights=True)


def stored_input(srv, job_id: str) -> str:
    return srv.app.state.store.get(job_id, full=True)["input_path"]


@pytest.mark.parametrize("link", ["hard link", "copy"])
def test_a_named_file_swapped_for_a_link_after_submission_is_not_read(tmp_path, folders, monkeypatch, link):
    """The TOCTOU of issue 44: accepted, then replaced by a link to a file outside --allow-input before the
    job runs. Before, the job re-opened the name at run time and restored (and served) the outside file."""
    allowed, outside = folders
    original = sha(allowed / "ok.mp4")
    if link == "copy":  # another filesystem: the pinned input is a copy made from the descriptor
        def no_link(*a, **k):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", no_link)
    with Server(settings(tmp_path, allowed)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": OPTS})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert r.json()["input_name"] == "ok.mp4"
        os.remove(allowed / "ok.mp4")
        os.symlink(outside / "secret.mp4", allowed / "ok.mp4")
        pinned = stored_input(srv, job_id)
        assert os.path.dirname(pinned) == str(tmp_path / "data" / "uploads")  # the server's own copy
        assert sha(pinned) == original  # what the job reads is what was accepted
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        assert not os.path.exists(pinned)  # released like an upload
    assert os.path.islink(allowed / "ok.mp4") and sha(outside / "secret.mp4")  # the named files are untouched


def test_a_named_folder_is_pinned_frame_by_frame(tmp_path, folders):
    allowed, outside = folders
    picture(outside / "x.png", 9)
    want = {n: sha(allowed / "frames" / n) for n in ("0.png", "1.png", "2.png")}
    with Server(settings(tmp_path, allowed)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/jobs", data={"path": "frames", "options": OPTS})
        assert r.status_code == 201, r.text
        pinned = stored_input(srv, r.json()["id"])
        os.remove(allowed / "frames" / "1.png")
        os.symlink(outside / "x.png", allowed / "frames" / "1.png")
        assert sorted(os.listdir(pinned)) == sorted(want)  # the hidden file is left out, as the reader does
        assert {n: sha(os.path.join(pinned, n)) for n in want} == want
        os.symlink(outside / "x.png", allowed / "frames" / "3.png")  # a frame leading out: refused at submission
        r = c.post("/v1/jobs", data={"path": "frames", "options": OPTS})
        assert r.status_code == 403 and "leads outside" in r.json()["detail"], r.text
        assert len(os.listdir(tmp_path / "data" / "uploads")) == 1  # the refused one left nothing behind


def test_the_open_follows_no_link_that_appears(tmp_path, folders):
    """The race inside one submission: a component that became a link between the check and the open."""
    allowed, outside = folders
    os.symlink(outside, allowed / "sub")
    os.symlink(outside / "secret.mp4", allowed / "last.mp4")
    store = JobStore(tmp_path / "data")
    try:
        inputs = Inputs(store.uploads, [os.path.realpath(allowed)], 2**20)
        for name in ("sub/secret.mp4", "last.mp4"):
            with pytest.raises(Exception) as e:  # as if realpath had run before the swap
                inputs._open(os.path.join(os.path.realpath(allowed), name))
            assert e.value.status_code == 403 and "changed while it was being opened" in e.value.detail
        fd = inputs._open(os.path.join(os.path.realpath(allowed), "ok.mp4"))
        os.close(fd)
    finally:
        store.close()


def test_hostile_options_and_queries_get_one_json_line(tmp_path, folders):
    """Before: plain-text 500s (options nested 100,000 deep, a 5,000-digit integer), 422 with a list."""
    allowed, _ = folders
    with Server(settings(tmp_path, allowed)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        cases = [("[" * 100_000 + "]" * 100_000, 413, "larger than"), ("[" * 5000 + "]" * 5000, 400, "nested too"),
                 ('{"seed": 1' + "0" * 5000 + "}", 400, "too many digits"), ('{"scale": NaN}', 400, "--scale"),
                 (json.dumps({"crf": 10**30}), 400, "--crf")]
        for opts, status, words in cases:
            r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": opts})
            assert r.status_code == status and words in r.json()["detail"], (opts[:30], r.text[:300])
            assert "\n" not in r.json()["detail"]
        for params in ({"limit": "9" * 5000}, {"limit": "abc"}):
            r = c.get("/v1/jobs", params=params)
            assert r.status_code == 400 and r.json()["detail"].startswith("limit:"), r.text
        r = c.post("/v1/jobs", data={"file": "not a file"})
        assert r.status_code == 400 and isinstance(r.json()["detail"], str), r.text
        assert os.listdir(tmp_path / "data" / "uploads") == []


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, *a, **k):
        self.f = open(*a, **k)

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def full_disk_open(file, mode="r", *a, **k):
    return open(file, mode, *a, **k) if "r" in mode else _FullDisk(file, mode, *a, **k)


def test_a_full_data_disk_is_507(tmp_path, folders, monkeypatch):
    """Before: a plain-text 500 when the job's row could not be written."""
    allowed, _ = folders
    with Server(settings(tmp_path, allowed)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        def full(*a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(srv.app.state.store, "add", full)
        r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": OPTS})
        assert r.status_code == 507 and r.json()["detail"] == "the server's data disk is full; try again later"
        monkeypatch.undo()
        monkeypatch.setattr(inputs_mod, "open", full_disk_open, raising=False)  # the upload's bytes
        with open(allowed / "ok.mp4", "rb") as f:
            r = c.post("/v1/jobs", files={"file": ("ok.mp4", f)}, data={"options": OPTS})
        assert r.status_code == 507, r.text
        monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")))
        r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": OPTS})  # the pinned copy's bytes
        assert r.status_code == 507, r.text
        assert os.listdir(tmp_path / "data" / "uploads") == []  # nothing half-written left


def test_jobs_are_refused_while_no_group_can_form(tmp_path, folders):
    allowed, _ = folders
    with Server(settings(tmp_path, allowed)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        srv.app.state.controller.error = "cannot load the weights: dit.safetensors: 1 NaN"
        r = c.post("/v1/jobs", data={"path": "ok.mp4", "options": OPTS})
        assert r.status_code == 503 and r.json()["detail"] == ("the server cannot run jobs: cannot load the "
                                                               "weights: dit.safetensors: 1 NaN")
        h = c.get("/healthz")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert os.listdir(tmp_path / "data" / "uploads") == []
