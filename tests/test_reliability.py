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
from ditsp.distributed.launcher import RankError
from ditsp.io.testclip import make_test_clip
from ditsp.io.write import atomic_path, write_image

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
    from ditsp.distributed.comm import Comm

    comm = Comm.of(ctx.group)
    steps = int(seconds / 0.1)  # the same count on every rank (each all_reduce needs all of them)
    for _ in range(steps):
        time.sleep(0.1)
        comm.all_reduce(torch.ones(1))
    return steps


def silent_for(ctx, seconds: float) -> int:
    time.sleep(seconds)  # no collective, no heartbeat
    return 0


@pytest.mark.timeout(90)
def test_a_long_call_that_progresses_is_not_stuck(clusters):
    # 10 s of work, 3 s without progress allowed (a margin for this loaded machine's stalls)
    out = clusters(2).run(beats_for, 10.0, timeout_s=3.0)
    assert all(n > 5 for n in out)


@pytest.mark.timeout(90)
def test_a_silent_rank_is_stuck_after_the_timeout(clusters):
    with pytest.raises(RankError) as e:  # the ranks sleep 30 s: stuck after 1 s, long before they wake
        clusters(2).run(silent_for, 30.0, timeout_s=1.0)
    assert "made no progress for 1 s" in str(e.value).splitlines()[0]


# -- item 5: no hidden partial files ----------------------------------------------------------------------


def test_stale_temporary_files_of_our_pattern_are_swept(tmp_path):
    from ditsp.io.write import sweep_temps

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
    import ditsp.distributed.dispatch

    out = tmp_path / "o.mp4"
    left = tmp_path / f".o.tmp-{dead_pid()}-deadbeef.mp4"

    def dies(fn, *args, **kwargs):
        left.write_bytes(b"half a file")
        raise RankError("rank_upscale failed on 2 ranks: rank 0: died of SIGKILL (exit code -9)")

    monkeypatch.setattr(ditsp.distributed.dispatch, "dispatch", dies)
    err = _err(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(out), "--resolution", "32x32", "--sp", "2", "--no-progress"])
    assert "SIGKILL" in err
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_parent_alone_leaves_nothing_and_exits_promptly(tmp_path, sig):
    src = make_test_clip(str(tmp_path / "long.mp4"), width=32, height=32, frames=61, fps=12, audio=False)
    out = tmp_path / "o.mp4"
    args = ["upscale", "--model", "tiny-8x", "--random-weights", str(src), "-o", str(out), "--sp", "2",
            "--resolution", "48x48", "--window-frames", "5", "--overlap", "1", "--no-progress"]
    # Ctrl-C as an interactive user sends it: a test run started in the background by a non-interactive
    # shell inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    cmd = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from ditsp.cli import main; sys.exit(main(sys.argv[1:]))", *args]
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
    rc = main(["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(out), "--resolution", "32x32", "--check", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert rc == 1 and report["check"].startswith("failed: SP=1 frames differ") and "45" in report["check"]
    assert captured.err.strip().startswith("ditsp upscale: error: --check failed")
    assert out.exists()  # the output is kept, the verdict is the exit code


def test_check_that_passes(clip, tmp_path, capsys):
    rc = main(["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(tmp_path / "o.mp4"), "--resolution", "32x32", "--check", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["check"] == "passed"


# -- item 12: one line, prompt exit -----------------------------------------------------------------------


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    import ditsp.commands.plan as plan

    def interrupted(args, parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "main", interrupted)
    err = _err(capsys, ["plan", "--grid", "1,2,2", "--sp", "2"], rc=130)
    assert err == "ditsp plan: interrupted"


# -- item 11: checkpoint errors name the problem at every degree; never advise unsafe loading -------------


class Payload:
    """A pickle that would run code if loaded unsafely (torch's weights_only refuses it)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_errors_name_the_problem_under_sp(clip, tmp_path, capsys):
    from safetensors.torch import save_file

    from ditsp.models.seedvr2.nadit.model import build_model

    sd = {k: v.clone() for k, v in build_model("tiny").state_dict().items()}
    first = next(k for k, v in sd.items() if v.dtype.is_floating_point and v.numel() > 1)
    sd[first][0] = float("nan")
    bad = tmp_path / "nan.safetensors"
    save_file(sd, str(bad))
    err = _err(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(tmp_path / "o.mp4"), "--dit", str(bad), "--sp", "2",
                        "--resolution", "32x32", "--no-progress"])
    assert "does not match the model" in err and "non-finite" in err and first in err, err
    assert not [f for f in os.listdir(tmp_path) if f != "nan.safetensors"]


def test_a_pickled_vae_is_refused_without_unsafe_advice(clip, tmp_path, capsys):
    bad = tmp_path / "vae.pth"
    torch.save({"x": Payload()}, bad)
    err = _err(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(tmp_path / "o.mp4"), "--vae", str(bad),
                        "--resolution", "32x32", "--no-progress"])
    assert "vae.pth: unreadable checkpoint" in err and "weights_only" not in err and len(err.strip().splitlines()) == 1, err


# -- items 8 and 12: bounded rank counts, estimates before building, malformed vector sets -----------------

DATA = Path(__file__).parent / "data"


def _vector_copy(tmp_path, name="nadit-3b-tiny") -> Path:
    import shutil

    d = tmp_path / name
    shutil.copytree(DATA / name, d)
    return d


def test_rank_counts_are_bounded_even_with_force(clip, tmp_path, capsys):
    from ditsp.distributed.launcher import LocalCluster
    from ditsp.memory import local_rank_limit

    n = 2 * local_rank_limit() + 10  # far more than the available memory holds (it moves a little)
    with pytest.raises(ValueError, match=f"world_size {n}: {n} local ranks"):
        LocalCluster(n)
    err = _err(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(tmp_path / "o.mp4"), "--sp", str(n), "--force",
                        "--no-progress"])
    assert f"--sp {n}: {n} local ranks" in err and "--force does not override" in err
    with pytest.raises(SystemExit) as e:
        main(["run", "--grid", "1,4,4", "--sp", str(n), "--force"])
    assert e.value.code == 2 and f"{n} local ranks" in capsys.readouterr().err
    err = _err(capsys, ["verify", str(DATA / "nadit-3b-tiny"), "--sp", str(n)], rc=2)
    assert f"{n} local ranks" in err


def test_verify_estimates_before_building(tmp_path, capsys):
    d = _vector_copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(vid_dim=65536, txt_dim=65536, emb_dim=6 * 65536, heads=512, head_dim=128, swiglu_hidden=4 * 65536)
    (d / "config.json").write_text(json.dumps(cfg))
    err = _err(capsys, ["verify", str(d), "--sp", "1"], rc=2)  # building it would not fit: refused before
    assert "GiB per process for the model config.json describes" in err, err


def test_a_malformed_vector_set_is_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = _vector_copy(tmp_path)
    io = load_file(d / "io.safetensors")
    io["vid_in"] = io["vid_in"][..., :5].contiguous()  # the wrong number of channels
    save_file(io, str(d / "io.safetensors"))
    err = _err(capsys, ["verify", str(d), "--sp", "1"], rc=1)
    assert err.startswith(f"ditsp verify: error: {d}: malformed vector set: "), err


# -- item 7: the same frames give the same file ------------------------------------------------------------

_WRITE = """
import sys, torch
from ditsp.io.write import write_video
g = torch.Generator().manual_seed(0)
write_video(sys.argv[1], torch.randint(0, 255, (9, 32, 32, 3), dtype=torch.uint8, generator=g), 12, overwrite=True)
"""


def test_the_encoder_is_pinned_and_files_reproduce(tmp_path):
    from ditsp.io.write import VideoWriter

    w = VideoWriter(tmp_path / "a.mp4", 12)
    w.write(torch.zeros(1, 32, 32, 3, dtype=torch.uint8))
    assert w._stream.codec_context.thread_count == 1  # not the machine-dependent automatic count
    w.close()
    outs = [tmp_path / f"{i}.mp4" for i in range(2)]
    for i, out in enumerate(outs):  # separate processes, the second with more threads allowed
        env = dict(os.environ, OMP_NUM_THREADS=str(1 + 3 * i))
        subprocess.run([sys.executable, "-c", _WRITE, str(out)], check=True, env=env, timeout=60)
    assert outs[0].read_bytes() == outs[1].read_bytes()


# -- item 13: every input checked up front ------------------------------------------------------------------


def test_a_frame_folder_with_one_odd_frame_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import ditsp.distributed.dispatch

    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(9):
        size = (48, 32, 3) if i == 7 else (32, 32, 3)
        write_image(folder / f"f{i:02d}.png", torch.full(size, 20 * i, dtype=torch.uint8))

    def boom(*a, **k):
        raise AssertionError("ranks started before the input was checked")

    monkeypatch.setattr(ditsp.distributed.dispatch, "dispatch", boom)
    err = _err(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", str(folder), "-o", str(tmp_path / "o.mp4"), "--resolution", "32x32",
                        "--window-frames", "5", "--overlap", "1", "--no-progress"])
    assert "f07.png: is 32x48 but the first frame is 32x32" in err, err  # W x H


# -- item 6: media fidelity (rotation, variable frame rate, GIF timing, 16-bit images) ----------------------


def _write_clip(path, frames, times=None, rate=12, rotation=None, codec="libx264", pix_fmt="yuv420p"):
    """Frames (n, H, W, 3) uint8 written with PyAV: at ``times`` (seconds) if given, else at ``rate``."""
    import av
    from fractions import Fraction

    tb = Fraction(1, 1000) if times is not None else Fraction(1, rate)
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        s.codec_context.time_base = tb
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i, a in enumerate(frames):
            f = av.VideoFrame.from_ndarray(a.numpy(), format="rgb24")
            f.pts = round(times[i] * 1000) if times is not None else i
            f.time_base = tb
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return str(path)


def _corner_frames(n=5, h=32, w=48):
    x = torch.zeros(n, h, w, 3, dtype=torch.uint8)
    x[:, :12, :12] = 255  # a bright top-left corner: where it lands shows the orientation
    return x


def test_rotation_is_applied(tmp_path, capsys):
    from ditsp.io.probe import probe
    from ditsp.io.read import VideoReader

    src = _write_clip(tmp_path / "rot.mp4", _corner_frames(), rotation=90)
    with VideoReader(src) as r:
        assert r.info.size == (32, 48) and r.info.rotation == 90  # portrait, as it is meant to be shown
        first = next(iter(r))[0].float().mean(0)  # (H, W)
    want = torch.rot90(_corner_frames()[0].float().mean(-1), 1, dims=(0, 1))  # 90 degrees counter-clockwise
    assert (first - want).abs().mean() < 8
    out = tmp_path / "o.mp4"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", src, "-o", str(out), "--scale", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert probe(out).size == (32, 48) and any("rotation 90" in m for m in report["media_notes"])


def test_variable_frame_rate_keeps_each_frames_time(tmp_path, capsys):
    from ditsp.io.probe import frame_times

    times = [0.0, 0.05, 0.1, 0.15, 0.2, 0.6, 0.65, 0.7, 1.2, 1.25, 1.3, 1.35, 1.4]
    src = _write_clip(tmp_path / "vfr.mp4", _corner_frames(len(times), 32, 32), times=times, rate=20)
    assert frame_times(src) == pytest.approx(times, abs=1e-3)
    out = tmp_path / "o.mp4"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", src, "-o", str(out), "--resolution", "32x32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert frame_times(out) == pytest.approx(times, abs=2e-3)  # before: re-timed to a constant rate
    assert any("each frame's time kept" in m for m in report["media_notes"])


def test_a_gif_keeps_its_frame_delays(tmp_path):
    from ditsp.io.probe import frame_times, probe

    frames = torch.arange(24, dtype=torch.uint8).mul(10).view(24, 1, 1, 1).expand(24, 32, 32, 3).contiguous()
    src = _write_clip(tmp_path / "in.gif", frames, rate=24, codec="gif", pix_fmt="rgb8")
    gif_times = frame_times(src)
    assert gif_times is not None  # centisecond delays: 4 and 5, a mean of 24 fps (the container says 25)
    out = tmp_path / "o.mp4"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", src, "-o", str(out), "--resolution", "32x32", "--no-progress"]) == 0
    assert frame_times(out) == pytest.approx(gif_times, abs=2e-3)
    assert probe(out).frames == 24


def test_a_16_bit_grey_png_is_read_by_its_range(tmp_path):
    from PIL import Image

    from ditsp.io.read import read_image

    import numpy as np

    ramp = np.linspace(0, 65535, 240 * 32).round().reshape(32, 240).astype("uint16")
    Image.fromarray(ramp).save(tmp_path / "g16.png")  # uint16: a 16-bit greyscale PNG
    got = read_image(tmp_path / "g16.png")
    assert got.shape == (1, 3, 32, 240) and int(got.max()) == 255 and int(got.min()) == 0
    assert len(torch.unique(got)) > 200  # before: clipped at 255, 14 distinct values
    assert (got.float().mean() - 127.5).abs() < 3


# -- item 15: the launcher's start-up -----------------------------------------------------------------------


def test_a_main_module_ranks_cannot_import_is_said_at_once(monkeypatch):
    from ditsp.distributed.launcher import LocalCluster

    main_mod = sys.modules["__main__"]
    monkeypatch.setattr(main_mod, "__file__", "/nonexistent/<stdin>", raising=False)
    monkeypatch.setattr(main_mod, "__spec__", None, raising=False)
    with pytest.raises(RankError, match="not a file they can import"):  # said at once: the window is an hour
        LocalCluster(2, timeout_s=3600)  # before: every rank died at import, reported as "died (exit code 1)"


def test_stack_folders_of_gone_launchers_are_swept(clusters):
    import tempfile

    from ditsp.distributed.launcher import _sweep_rank_dirs

    stale = Path(tempfile.mkdtemp(prefix=f"ditsp-ranks-{dead_pid()}-"))
    mine = clusters(2)._stack_dir
    assert os.path.basename(mine).startswith(f"ditsp-ranks-{os.getpid()}-")  # named by its launcher
    _sweep_rank_dirs()
    assert not stale.exists() and os.path.isdir(mine)
