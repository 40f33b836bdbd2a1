"""Out-of-memory recovery of a restoration (job/recovery.py): an allocation failure injected on one rank mid-job,
in the VAE or the DiT, at SP 2 and 3, is known to every rank, the window runs again under a leaner plan and
the step is reported; exact steps keep the bytes; with no leaner plan left every rank fails in one line; the
server's workers recover the same way and stay up.

Slow against stuck: the ranks' collectives wait at least 600 s and the pytest timeout is far below it, so a
rank left waiting for the failed one's collective would fail the test, not pass it slowly.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from ditsp.cli import main
from ditsp.io.testclip import make_test_clip
from ditsp.models.seedvr2.job import plan as restoration_plan
from ditsp.models.seedvr2.job.recovery import (FAULT_ENV, MAX_STEPS, Fault, Injector, Recovery, Restart,
                                               faults_from_env, fewer_frames)
from ditsp.models.seedvr2.job.report import STAGES, format_report

pytestmark = pytest.mark.timeout(280)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    return str(make_test_clip(str(d / "in.mp4"), width=48, height=32, frames=9, fps=12, audio=False))


@pytest.fixture(scope="module")
def clip17(tmp_path_factory):
    """Three windows of 9 frames with ``--window-frames 9 --overlap 2``."""
    d = tmp_path_factory.mktemp("clip17")
    return str(make_test_clip(str(d / "in17.mp4"), width=48, height=32, frames=17, fps=12, audio=False))


def upscale(capsys, clip, out, sp, *extra) -> tuple[int, dict | None, str]:
    """`ditsp upscale --json` of the test clip at ``sp`` (the tiny seeded models, deterministic): exit status,
    report, stderr."""
    rc = main(["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(out), "--resolution", "64x48",
               "--sp", str(sp), "--deterministic", "--overwrite", "--json", *extra])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


def own_children() -> set[int]:
    """This process's live children (the pooled ranks of other tests among them)."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == os.getpid():
                out.add(int(name))
    return out


# -- the injected failure and the ladder, without ranks -------------------------------------------------------


def test_fault_spec():
    assert faults_from_env({FAULT_ENV: "1:2:dit, 0:1:vae_decode:3"}) == (Fault(1, 2, "dit"), Fault(0, 1, "vae_decode", 3))
    assert faults_from_env({}) == ()
    for bad in ("1:2", "1:0:dit", "x:1:dit", "1:1:vae", "1:1:dit:0", "1:1:dit:1:2"):
        with pytest.raises(ValueError) as e:
            faults_from_env({FAULT_ENV: bad})
        assert FAULT_ENV in str(e.value) and "\n" not in str(e.value)


def test_an_injected_failure_fires_in_its_stage_as_often_as_asked():
    models = SimpleNamespace(dit=SimpleNamespace(blocks=[torch.nn.Identity() for _ in range(4)]), vae=None)
    inj = Injector((Fault(0, 2, "dit", 2),), rank=0)
    for _ in range(2):
        with inj.stage("dit", 1, models), pytest.raises(torch.OutOfMemoryError):
            models.dit.blocks[2](torch.zeros(1))
    with inj.stage("dit", 1, models):  # twice asked, twice done
        models.dit.blocks[2](torch.zeros(1))
    with inj.stage("dit", 0, models):  # another window
        models.dit.blocks[2](torch.zeros(1))
    with Injector((Fault(1, 2, "dit"),), rank=0).stage("dit", 1, models):  # another rank's
        models.dit.blocks[2](torch.zeros(1))


def _recovery(model, dtype, sp, **kw):
    plan = restoration_plan.build(model=model, dtype=dtype, in_width=960, in_height=540, frames=45, area=(1920, 1080),
                                  size=None, window_frames=45, overlap=4, seed=1, sp=sp, vae_mode="auto", vae_chunk=1,
                                  planner=None, deterministic=True, budget=80 << 30, **kw)
    req = SimpleNamespace(weights=SimpleNamespace(model=model, dtype=dtype, dit=None, weights_dtype=None), plan=plan)
    return plan, Recovery(req, torch.device("cpu"), Injector((), 0))


def _walk(plan, rec, stage, n=10):
    """The plans each failure of window 1 in ``stage`` leads to, to the end of the ladder."""
    seen = []
    for _ in range(n):
        try:
            plan = rec.next_plan(plan, 0, ({"rank": 1, "stage": stage, "error": "E"},), 0.0)
        except Restart as r:
            plan = r.plan
        except MemoryError as e:
            return seen, str(e)
        seen.append((rec.steps[-1]["kind"], rec.steps[-1]["to"], plan.steps[0].vae_mode))
    raise AssertionError(f"no end after {n} failures: {seen}")


def test_the_ladder_leaner_exact_modes_then_tiled_then_fewer_frames_then_one_line():
    """At 1080p, 45 frames, SP 3: a VAE failure steps to a leaner exact mode, then tiled (approximate), then
    windows of about half the frames keeping the mode, until the bound; the error names what would fit."""
    plan, rec = _recovery("tiny-8x", "fp32", 3)
    assert plan.steps[0].vae_mode == "height"
    seen, err = _walk(plan, rec, "vae_decode")
    assert seen == [("vae_mode", "height+chunks", "height+chunks"), ("vae_mode", "tiled", "tiled"),
                    ("window_frames", 21, "tiled"), ("window_frames", 9, "tiled"), ("window_frames", 5, "tiled")]
    assert len(seen) == MAX_STEPS
    assert [s["exact"] for s in rec.steps] == [True, False, True, True, True]
    assert "APPROXIMATE" in rec.steps[1]["output"] and "--window-frames 21" in rec.steps[2]["output"]
    assert err.startswith("out of memory on rank 1 in window 1/") and "would fit" in err and "--sp 6" in err
    assert "\n" not in err
    # the report says each step, the approximate one flagged
    text = format_report({"input": "a", "output": "b", "frames_written": 1, "geometry": "g", "windows": [[0, 1]],
                          "world_size": 3, "dit_path": "d", "vae_modes": [], "stage_s": dict.fromkeys(STAGES, 1.0),
                          "rank_stage_peak_bytes": [dict.fromkeys(STAGES, 0)],
                          "bytes_moved": 0, "sha256": "0" * 64, "recovery": rec.steps, "approximate": True})
    assert text.count("recovered: window 1/1, rank 1 ran out of memory in vae_decode (E)") == 3  # 1 window until 21 frames
    assert "VAE mode height -> height+chunks; the same bytes as without the failure" in text
    assert "height+chunks -> tiled; APPROXIMATE" in text and "\nAPPROXIMATE: " in text


def test_a_dit_failure_takes_fewer_frames_at_once():
    plan, rec = _recovery("seedvr2-3b", "bf16", 2)
    seen, err = _walk(plan, rec, "dit")
    assert [s[:2] for s in seen] == [("window_frames", 21), ("window_frames", 9), ("window_frames", 5)]
    assert all(s["kind"] == "window_frames" for s in rec.steps)  # the VAE's mode is not what ran out
    assert all(mode != "tiled" for *_, mode in seen)  # auto, chosen again for each window size
    assert "no leaner plan is left after 3 recovery step(s)" in err and "would fit" in err


def test_the_latent_stitch_keeps_its_mode():
    """The latent stitch continues one decode from window to window: only shorter windows, never tiled."""
    plan, rec = _recovery("tiny-8x", "fp32", 2, stitch="latent")
    seen, _ = _walk(plan, rec, "vae_encode")
    assert seen and all(kind == "window_frames" and mode == plan.steps[0].vae_mode for kind, _, mode in seen)


def test_fewer_frames_stays_kn_plus_one():
    assert [fewer_frames(f, 4) for f in (81, 45, 21, 9, 5)] == [37, 21, 9, 5, 5]
    assert [fewer_frames(f, 1) for f in (9, 4, 2)] == [4, 2, 2]


# -- whole restorations with an injected failure ---------------------------------------------------------------


def test_vae_failure_at_sp2_recovered_by_an_exact_mode_with_the_same_bytes(clip, tmp_path, capsys, monkeypatch):
    rc, plain, _ = upscale(capsys, clip, tmp_path / "plain.mp4", 2)
    assert rc == 0 and plain["recovery"] == [] and not plain["approximate"]
    monkeypatch.setenv(FAULT_ENV, "1:1:vae_encode")
    rc, rep, err = upscale(capsys, clip, tmp_path / "rec.mp4", 2)
    assert rc == 0, err
    [step] = rep["recovery"]
    assert step["kind"] == "vae_mode" and (step["from"], step["to"]) == ("height", "height+chunks")
    assert step["ranks"] == [1] and step["stage"] == "vae_encode" and "OutOfMemoryError" in step["error"]
    assert step["exact"] and rep["sha256"] == plain["sha256"] and not rep["approximate"]
    assert any("height+chunks" in m and "recovery" in m for m in rep["vae_modes"])


def test_dit_failure_at_sp3_restarts_with_fewer_frames(clip, tmp_path, capsys, monkeypatch):
    """Rank 2 runs out of memory in the DiT: windows of 5 frames, the clip restarted; the output is that of an
    unfailed run with --window-frames 5."""
    monkeypatch.setenv(FAULT_ENV, "2:1:dit")
    before = own_children()
    rc, rep, err = upscale(capsys, clip, tmp_path / "rec.mp4", 3, "--overlap", "2")
    assert rc == 0, err
    [step] = rep["recovery"]
    assert (step["kind"], step["from"], step["to"], step["stage"], step["ranks"]) == ("window_frames", 9, 5, "dit", [2])
    assert rep["windows"] == [[0, 5], [2, 7], [4, 9]] and rep["frames_written"] == 9
    monkeypatch.delenv(FAULT_ENV)
    rc, plain, _ = upscale(capsys, clip, tmp_path / "plain.mp4", 3, "--overlap", "2", "--window-frames", "5")
    assert rc == 0 and rep["sha256"] == plain["sha256"]
    assert own_children() <= before  # the ranks are gone


LATER = ("--window-frames", "9", "--overlap", "2")  # clip17 in three windows


def test_vae_decode_failure_in_a_later_window_at_sp3(clip17, tmp_path, capsys, monkeypatch):
    """The second of three windows fails in the decode: a leaner exact mode from it on, the window before it
    written already; the bytes of the run without the failure."""
    monkeypatch.setenv(FAULT_ENV, "1:2:vae_decode")
    rc, rep, err = upscale(capsys, clip17, tmp_path / "rec.mp4", 3, *LATER)
    assert rc == 0, err
    [step] = rep["recovery"]
    assert (step["kind"], step["to"], step["window"], step["windows"], step["ranks"]) == ("vae_mode", "height+chunks",
                                                                                           2, 3, [1])
    monkeypatch.delenv(FAULT_ENV)
    rc, plain, _ = upscale(capsys, clip17, tmp_path / "plain.mp4", 3, *LATER)
    assert rc == 0 and rep["sha256"] == plain["sha256"] and rep["frames_written"] == 17


def test_dit_failure_in_a_later_window_at_sp2(clip17, tmp_path, capsys, monkeypatch):
    """Rank 0 runs out of memory in the DiT of the second of three windows: the clip restarts in windows of 5
    frames and every frame is written once."""
    monkeypatch.setenv(FAULT_ENV, "0:2:dit")
    rc, rep, err = upscale(capsys, clip17, tmp_path / "rec.mp4", 2, *LATER)
    assert rc == 0, err
    [step] = rep["recovery"]
    assert (step["kind"], step["from"], step["to"], step["window"], step["windows"]) == ("window_frames", 9, 5, 2, 3)
    assert rep["frames_written"] == 17 and all(b - a == 5 for a, b in rep["windows"])


def test_no_leaner_plan_left_fails_in_one_line_on_every_rank(clip, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "0:1:vae_decode:99")
    before = own_children()
    rc, rep, err = upscale(capsys, clip, tmp_path / "never.mp4", 2)
    assert rc == 1 and rep is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert "ranks 0, 1: MemoryError: out of memory on rank 0 in window 1/" in line, line  # every rank, one line
    assert "no leaner plan is left" in line and "would fit" in line
    assert not (tmp_path / "never.mp4").exists() and not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    assert own_children() <= before  # no rank outlives the job


def test_the_server_recovers_and_keeps_its_workers(clip, tmp_path, monkeypatch):
    """A server job whose rank 1 runs out of memory in the VAE: done, the step in its report, the bytes of one
    device; the same workers in the same group run the next job."""
    from ditsp.serve import Settings

    from .test_serve import TOKEN, Server, client, reference_sha, submit, wait_healthy, wait_job

    opts = {"resolution": "64x48", "window_frames": 9, "overlap": 2}
    sha = reference_sha(clip, tmp_path, opts)
    monkeypatch.setenv(FAULT_ENV, "1:1:vae_encode")  # the workers the server spawns inherit it
    srv = Server(Settings(data_dir=str(tmp_path / "data"), sp=2, model="tiny-8x", random_weights=True, token=TOKEN,
                          allow_input=[os.path.dirname(clip)]))
    try:
        with client(srv.url) as c:
            before = wait_healthy(c, ranks=2)
            for _ in range(2):  # each job injects its own failure
                j = wait_job(c, submit(c, clip, opts), timeout=150)
                assert j["state"] == "done", j
                [step] = j["report"]["recovery"]
                assert (step["kind"], step["to"], step["ranks"], step["stage"]) == ("vae_mode", "height+chunks", [1],
                                                                                    "vae_encode")
                assert j["report"]["sha256"] == sha and not j["report"]["approximate"]
                after = c.get("/healthz").json()
                assert after["status"] == "ok" and after["workers"] == before["workers"], (before, after)
                assert after["generation"] == before["generation"]  # the server's group never broke
    finally:
        srv.close()
