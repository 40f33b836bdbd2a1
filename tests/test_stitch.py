"""`ditsp upscale --stitch`: every stitch writes the same bytes at SP 1, 2 and 3 under --deterministic; the seam and
colour drift figures are in the report."""

from __future__ import annotations

import json

import pytest

from ditsp.cli import main
from ditsp.io.testclip import make_test_clip
from ditsp.io.write import write_image

from .cli_errors import fails
from .test_upscale import request, run_on

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("stitch")
    return str(make_test_clip(str(d / "long.mp4"), width=32, height=32, frames=21, fps=10, audio=False))


@pytest.mark.bitwise
@pytest.mark.parametrize("stitch", ["cosine", "hann", "latent"])
def test_every_stitch_writes_the_same_bytes_at_sp_1_2_3(clusters, long_clip, tmp_path, stitch):
    job = {sp: request(long_clip, tmp_path / f"o{sp}.mp4", window_frames=9, overlap=4, resolution="32x32",
                       deterministic=True, stitch=stitch) for sp in (1, 2, 3)}
    reports = {sp: run_on(clusters, sp, job[sp]) for sp in (1, 2, 3)}
    assert len({r["sha256"] for r in reports.values()}) == 1, {sp: r["sha256"] for sp, r in reports.items()}
    r = reports[1]
    assert r["frames_written"] == 21 and r["request"]["stitch"] == stitch and len(r["windows"]) > 2
    if stitch == "latent":  # windows start on the VAE's time factor (4 for this model)
        assert all(a % 4 == 0 for a, _ in r["windows"])
    assert len(r["seams"]["each"]) == len(r["windows"]) - 1
    drift = r["color_drift"]
    assert [w["window"] for w in drift["windows"]] == list(range(len(r["windows"])))
    assert sum(w["frames"] for w in drift["windows"]) == 21


def test_the_stitches_differ_and_the_latent_one_also_without_hand_off(clusters, long_clip, tmp_path):
    """Three different results on one clip; the latent stitch with whole latents on every rank (no slab hand-off)
    writes what it writes with the hand-off."""
    digests = {s: run_on(clusters, 1, request(long_clip, tmp_path / f"{s}.mp4", window_frames=9, overlap=4,
                                              resolution="32x32", deterministic=True, stitch=s))["sha256"]
               for s in ("cosine", "hann", "latent")}
    assert len(set(digests.values())) == 3
    whole = run_on(clusters, 2, request(long_clip, tmp_path / "w.mp4", handoff=False, window_frames=9, overlap=4,
                                        resolution="32x32", deterministic=True, stitch="latent", vae_mode="height"))
    assert whole["sha256"] == digests["latent"]


def test_one_window_is_the_same_whatever_the_stitch(tmp_path, capsys):
    """A clip inside one window, and an image: nothing to stitch, so every stitch writes the same frames."""
    clip = make_test_clip(str(tmp_path / "short.mp4"), width=32, height=32, frames=5, fps=10, audio=False)
    img = tmp_path / "in.png"
    import torch

    write_image(img, torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    for src, ext in ((str(clip), "mp4"), (str(img), "png")):
        got = set()
        for stitch in ("cosine", "hann", "latent"):
            out = tmp_path / f"o-{stitch}.{ext}"
            assert main(["upscale", "--model", "tiny-8x", "--random-weights", src, "-o", str(out), "--resolution",
                         "32x32", "--stitch", stitch, "--overwrite", "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["seams"] is None and report["color_drift"]["windows"][0]["frames"] == report["frames_written"]
            got.add(report["sha256"])
        assert len(got) == 1, (src, got)


def test_the_latent_stitch_needs_an_exact_vae_mode(long_clip, tmp_path, capsys):
    err = fails(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", long_clip, "-o", str(tmp_path / "o.mp4"),
                         "--window-frames", "9", "--stitch", "latent", "--vae-mode", "tiled"], code=1)
    assert "latent stitch" in err and "exact VAE mode" in err
    err = fails(capsys, ["upscale", "--model", "tiny-8x", "--random-weights", long_clip, "-o", str(tmp_path / "o.mp4"),
                         "--window-frames", "9", "--overlap", "8", "--stitch", "latent"], code=1)
    assert "multiples of 4" in err
    assert "invalid choice" in fails(capsys, ["upscale", long_clip, "-o", str(tmp_path / "o.mp4"), "--stitch", "seam"])


def test_a_server_job_may_ask_for_a_stitch():
    from ditsp.models.seedvr2.job.request import parse_http_options

    assert parse_http_options({"stitch": "latent"}) == {"stitch": "latent"}
    with pytest.raises(ValueError, match="stitch must be one of"):
        parse_http_options({"stitch": "zip"})
