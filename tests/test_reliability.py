"""Reliability round 3 (issue 29) outside the server: stuck-rank checks, hidden temporary files, --check
verdicts, one-line errors, bounded rank counts, named pipes, reproducible files, inputs checked up front."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ditsp.cli import main
from ditsp.dist.launcher import RankError
from ditsp.io.testclip import make_test_clip
from ditsp.io.video import atomic_path, write_image

pytestmark = pytest.mark.timeout(180)


def dead_pid() -> int:
    """The pid of a process that has ended (for stale temporary files)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _err(capsys, argv, rc=None) -> str:
    got = main(argv)
    err = capsys.readouterr().err.strip()
    assert got != 0 and (rc is None or got == rc), (got, err)
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    return str(make_test_clip(str(d / "in.mp4"), width=32, height=32, frames=5, fps=12, audio=False))


# -- item 2: --timeout is a stuck-rank check, not a deadline on the whole call -------------------------


def beats_for(ctx, seconds: float) -> int:
    """Work that takes ``seconds`` but shows progress (a collective) every 0.1 s."""
    from ditsp.dist.comm import Comm

    comm = Comm.of(ctx.group)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        time.sleep(0.1)
        comm.all_reduce(torch.ones(1))
        n += 1
    return n


def silent_for(ctx, seconds: float) -> int:
    time.sleep(seconds)  # no collective, no heartbeat
    return 0


@pytest.mark.timeout(90)
def test_a_long_call_that_progresses_is_not_stuck(clusters):
    out = clusters(2).run(beats_for, 3.0, timeout_s=1.0)  # 3 s of work, 1 s without progress allowed
    assert all(n > 5 for n in out)


@pytest.mark.timeout(90)
def test_a_silent_rank_is_stuck_after_the_timeout(clusters):
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        clusters(2).run(silent_for, 30.0, timeout_s=1.0)
    assert "made no progress for 1 s" in str(e.value).splitlines()[0]
    assert time.monotonic() - t0 < 15


# -- item 5: no hidden partial files ----------------------------------------------------------------------


def test_stale_temporary_files_of_our_pattern_are_swept(tmp_path):
    from ditsp.io.video import sweep_temps

    pid = dead_pid()
    stale = tmp_path / f".out.tmp-{pid}-0a1b2c3d.mp4"
    live = tmp_path / f".out.tmp-{os.getppid()}-0a1b2c3d.mp4"  # its writer (our parent) still lives
    other = tmp_path / f".other.tmp-{pid}-0a1b2c3d.mp4"  # another output's
    foreign = tmp_path / f".out.tmp-{pid}-notours.mp4"  # not our pattern
    for f in (stale, live, other, foreign):
        f.write_bytes(b"x")
    with atomic_path(tmp_path / "out.mp4", (".mp4",)) as tmp:
        tmp.write_bytes(b"data")
    assert not stale.exists() and live.exists() and other.exists() and foreign.exists()
    assert (tmp_path / "out.mp4").read_bytes() == b"data"
    assert sweep_temps(tmp_path) == [other]  # a folder sweep takes every stale one of ours
    assert live.exists() and foreign.exists()


def test_upscale_sweeps_what_a_killed_rank_left(clip, tmp_path, capsys, monkeypatch):
    """A rank that dies (SIGKILL, a hang, a timeout) cannot remove its temporary file; the launcher does."""
    import ditsp.engine

    out = tmp_path / "o.mp4"
    left = tmp_path / f".o.tmp-{dead_pid()}-deadbeef.mp4"

    def dies(fn, *args, **kwargs):
        left.write_bytes(b"half a file")
        raise RankError("rank_upscale failed on 2 ranks: rank 0: died of SIGKILL (exit code -9)")

    monkeypatch.setattr(ditsp.engine, "dispatch", dies)
    err = _err(capsys, ["upscale", clip, "-o", str(out), "--resolution", "32x32", "--sp", "2", "--no-progress"])
    assert "SIGKILL" in err
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_parent_alone_leaves_nothing_and_exits_promptly(tmp_path, sig):
    src = make_test_clip(str(tmp_path / "long.mp4"), width=32, height=32, frames=61, fps=12, audio=False)
    out = tmp_path / "o.mp4"
    cmd = [sys.executable, "-m", "ditsp.cli", "upscale", str(src), "-o", str(out), "--sp", "2",
           "--resolution", "48x48", "--window-frames", "5", "--overlap", "1", "--no-progress"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not [f for f in os.listdir(tmp_path) if ".tmp-" in f]:  # rank 0 is writing
            assert p.poll() is None and time.monotonic() < end, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    err = p.stderr.read().strip()
    assert rc != 0 and "Traceback" not in err, err
    assert took < 5, took  # the busy ranks are killed, not waited for
    assert sorted(os.listdir(tmp_path)) == ["long.mp4"], err


# -- item 4: a failed --check is a failure --------------------------------------------------------------


def test_check_that_fails_is_a_non_zero_exit_and_in_the_json(clip, tmp_path, capsys, monkeypatch):
    import ditsp.commands.upscale as up

    monkeypatch.setattr(up, "parity_vs_one_device", lambda req, summary, threads: {
        "same_frames": False, "one_device_sha256": "0" * 64, "max_abs_diff_decoded": 45})
    out = tmp_path / "o.mp4"
    rc = main(["upscale", clip, "-o", str(out), "--resolution", "32x32", "--check", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert rc == 1 and report["check"].startswith("failed: SP=1 frames differ") and "45" in report["check"]
    assert captured.err.strip().startswith("ditsp upscale: error: --check failed")
    assert out.exists()  # the output is kept, the verdict is the exit code


def test_check_that_passes(clip, tmp_path, capsys):
    rc = main(["upscale", clip, "-o", str(tmp_path / "o.mp4"), "--resolution", "32x32", "--check", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["check"] == "passed"


# -- item 12: one line, prompt exit -----------------------------------------------------------------------


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    import ditsp.commands.plan as plan

    def interrupted(args, parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "main", interrupted)
    err = _err(capsys, ["plan", "--grid", "1,2,2", "--sp", "2"], rc=130)
    assert err == "ditsp plan: interrupted"
