"""`ditsp upscale`: end to end on generated clips, across SP degrees, every input kind, every bad input."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from ditsp.cpu import malloc as cpu_malloc
from ditsp.cli import main
from ditsp.io.testclip import make_test_clip
from ditsp.io.probe import probe
from ditsp.io.read import read_video
from ditsp.io.write import write_image
from ditsp.models.seedvr2.job.request import Options, check
from ditsp.models.seedvr2.job.restore import format_report, rank_upscale, summarize

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    return str(make_test_clip(str(d / "in.mp4"), width=48, height=32, frames=9, fps=12, audio=True))


def request(inp, out, handoff: bool = True, **kw):
    """A restoration's options (the tiny seeded models) and how its request is run: ``run_on`` plans it for
    each degree through the request's own check."""
    o = Options(input=str(inp), output=str(out), model="tiny-8x", random_weights=True, resolution="64x48",
                progress=False, overwrite=True)
    for k, v in kw.items():
        setattr(o, k, v)
    return o, handoff


def run_on(clusters, sp, job):
    o, handoff = job
    o = replace(o, sp=sp)
    req = replace(check(o).req, handoff=handoff)
    assert req.plan.sp == sp
    if sp == 1:
        from ditsp.distributed.launcher import RankContext

        torch.set_num_threads(1)  # as every rank: bitwise equality holds per thread count
        return summarize([rank_upscale(RankContext(0, 1, None, torch.device("cpu")), req)])
    return summarize(clusters(sp).run(rank_upscale, req))


@pytest.mark.bitwise
def test_same_bytes_at_every_sp_degree(clusters, clip, tmp_path):
    """The restored uint8 frames do not depend on the SP degree (4n+1 padding only, seeded CPU noise)."""
    reports = {sp: run_on(clusters, sp, request(clip, tmp_path / f"out{sp}.mp4", deterministic=True)) for sp in (1, 2, 3)}
    digests = {sp: r["sha256"] for sp, r in reports.items()}
    assert len(set(digests.values())) == 1, digests
    assert reports[2]["bytes_moved"] > 0 and reports[1]["bytes_moved"] == 0
    info = probe(tmp_path / "out2.mp4")
    assert info.has_audio and info.frames == 9 and info.size == (64, 32)  # 48x32 at the area of 64x48: 68x45, cropped
    assert abs(info.fps - 12) < 1e-6
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temporary files left behind


def test_windows_cover_the_clip_and_blend(clusters, tmp_path):
    """A clip longer than a window: every frame written once, windows cross-faded, same bytes at SP 1 and 2."""
    src = make_test_clip(str(tmp_path / "long.mp4"), width=32, height=32, frames=21, fps=10, audio=False)
    reqs = {sp: request(src, tmp_path / f"long{sp}.mp4", window_frames=9, overlap=4, resolution="32x32", deterministic=True)
            for sp in (1, 2)}
    r1, r2 = (run_on(clusters, sp, reqs[sp]) for sp in (1, 2))
    wins = [tuple(w) for w in r1["windows"]]
    assert r1["frames_written"] == 21 and wins[0][0] == 0 and wins[-1][1] == 21 and len(wins) > 2
    assert all(b[1] - b[0] == 9 and a[1] - b[0] >= 4 for a, b in zip(wins, wins[1:]))  # overlaps of >= 4 frames
    assert r1["sha256"] == r2["sha256"]
    frames = torch.cat(list(read_video(tmp_path / "long1.mp4")))
    assert frames.shape[0] == 21
    seams = r1["seams"]  # measured on the written uint8 frames as they stream
    # random weights: each window's output is its own noise, so only a loose bound (1.6 measured)
    assert seams["change"] > 0 and seams["inside_median"] > 0 and seams["ratio"] < 2
    assert len(seams["each"]) == len(wins) - 1 and all(s["ratio"] < 2 for s in seams["each"])


def test_image_in_png_out(tmp_path, capsys):
    img = tmp_path / "in.png"
    write_image(img, torch.randint(0, 255, (40, 56, 3), dtype=torch.uint8))
    out = tmp_path / "out.png"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", str(img), "-o", str(out), "--scale", "1", "--no-progress"]) == 0
    info = probe(out)
    assert info.kind == "image" and info.size == (48, 32)  # 56x40 cropped to multiples of 16
    assert "encoded in a thread of their own" not in capsys.readouterr().out  # an image is written at once


def test_folder_of_frames_and_json_report(tmp_path, capsys):
    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(5):
        write_image(folder / f"f{i + 1}.png", torch.full((32, 32, 3), 40 * i, dtype=torch.uint8))
    out = tmp_path / "out.mp4"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", str(folder), "-o", str(out), "--resolution", "32x32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frames_written"] == 5 and probe(out).frames == 5 and report["written_behind"]
    assert set(report["stage_s"]) == {"read", "vae_encode", "dit", "vae_decode", "color_fix", "write"}
    assert report["dit_path"].startswith("window-aligned") and report["vae_modes"]
    assert "memory estimate" in report["memory_estimate"]
    # which allocator policy the rank ran under, and whether it took effect there (this process: not started
    # through the `ditsp` program, so not in effect)
    assert report["cpu_allocator"] == cpu_malloc.describe()
    assert f"CPU allocator: {cpu_malloc.describe()}" in format_report(report)


def test_plot_written(clip, tmp_path):
    out, png = tmp_path / "o.mp4", tmp_path / "o.png"
    assert main(["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(out), "--resolution", "64x48", "--plot", str(png), "--no-progress"]) == 0
    assert png.stat().st_size > 10_000


def _err(capsys, argv) -> str:
    rc = main(["upscale", "--model", "tiny-8x", "--random-weights", *argv, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.startswith("ditsp upscale: error:") and "\n" not in err, err
    return err


def test_bad_inputs_get_one_line_and_leave_nothing(clip, tmp_path, capsys):
    out = str(tmp_path / "o.mp4")
    assert "no such file" in _err(capsys, [str(tmp_path / "missing.mp4"), "-o", out])
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(os.urandom(2048))
    assert "corrupt.mp4" in _err(capsys, [str(corrupt), "-o", out])
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    assert "empty.mp4" in _err(capsys, [str(empty), "-o", out])
    tiny = tmp_path / "tiny.png"
    write_image(tiny, torch.zeros(8, 8, 3, dtype=torch.uint8))
    assert "tiny.png" in _err(capsys, [str(tiny), "-o", str(tmp_path / "t.png"), "--scale", "1"])
    assert "does not exist" in _err(capsys, [clip, "-o", str(tmp_path / "nope" / "o.mp4")])
    assert "needs an output ending" in _err(capsys, [clip, "-o", str(tmp_path / "o.txt")])
    existing = tmp_path / "exists.mp4"
    existing.write_bytes(b"keep me")
    assert "--overwrite" in _err(capsys, [clip, "-o", str(existing)])
    assert existing.read_bytes() == b"keep me"
    assert "4n+1" in _err(capsys, [clip, "-o", out, "--window-frames", "8"])
    assert "no such file" in _err(capsys, [clip, "-o", out, "--dit", str(tmp_path / "none.pth")])
    assert "does not fit" in _err(capsys, [clip, "-o", out, "--max-memory", "0.001"])
    assert sorted(os.listdir(tmp_path)) == ["corrupt.mp4", "empty.mp4", "exists.mp4", "tiny.png"]


def test_mismatched_checkpoint_fails_cleanly(clip, tmp_path, capsys):
    from safetensors.torch import save_file

    bad = tmp_path / "dit.safetensors"
    save_file({"not.a.key": torch.zeros(2)}, str(bad))
    err = _err(capsys, [clip, "-o", str(tmp_path / "o.mp4"), "--dit", str(bad), "--resolution", "64x48"])
    assert "missing" in err or "unexpected" in err
    assert not (tmp_path / "o.mp4").exists() and not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.bitwise
@pytest.mark.parametrize("sp", [2, 3])
def test_height_sharded_vae_hands_slabs_to_the_dit(clusters, clip, tmp_path, sp):
    """Slabs straight to the windows and back give the same frames as gathering the latent, with fewer bytes."""
    direct = run_on(clusters, sp, request(clip, tmp_path / "h.mp4", vae_mode="height", deterministic=True))
    gathered = run_on(clusters, sp, request(clip, tmp_path / "h.mp4", vae_mode="height", deterministic=True,
                                            handoff=False))
    assert direct["sha256"] == gathered["sha256"]
    assert "output_gather" not in direct["collectives"] or (
        direct["collectives"]["output_gather"]["calls"] < gathered["collectives"]["output_gather"]["calls"])
    assert direct["collectives"]["decode_to_writer"]["calls"] == 1
    assert any("slabs handed" in m for m in direct["vae_modes"])


def test_one_reader_loads_the_same_weights_as_every_rank(clusters, clip, tmp_path):
    """`--weights-read one-reader` at SP 2: rank 0 reads the checkpoints and sends them; the same frames."""
    from ditsp.models.seedvr2.presets import MODELS

    dit, vae = MODELS["tiny"].shipped_files  # the small restorer's files, as a user would name them
    files = dict(model="tiny", dit=str(dit), vae=str(vae), random_weights=False)
    out = {read: run_on(clusters, 2, request(clip, tmp_path / f"{read}.mp4", weights_read=read, **files))
           for read in ("every-rank", "one-reader")}
    assert out["every-rank"]["sha256"] == out["one-reader"]["sha256"]
