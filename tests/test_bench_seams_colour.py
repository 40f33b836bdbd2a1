"""`ditsp bench seams-colour`: its runs, its tables, and one real run of a small clip."""

from __future__ import annotations

import json

import pytest

from ditsp.bench import seams_colour as bench
from ditsp.cli import main

pytestmark = pytest.mark.timeout(900)


def test_every_stitch_and_colour_fix_runs_once_and_cosine_wavelet_serves_both_tables():
    runs = bench.settings()
    assert [r[0] for r in runs] == ["overlap 0", "cosine", "hann", "latent", "one window", "adain", "lab", "none"]
    assert ("overlap 0", "cosine", "wavelet", "overlap 0") in runs and ("lab", "cosine", "lab", "") in runs
    assert ("one window", "cosine", "wavelet", "one window") in runs and ("latent", "latent", "wavelet", "") in runs


def test_a_small_clip_end_to_end(tmp_path, capsys):
    assert main(["bench", "seams-colour", "--frames", "7", "--window-frames", "5", "--overlap", "2",
                 "--size", "64x48", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "seams-colour.md").read_text()
    assert "held-out" in text and "cores" in text and "| latent |" in text and "| (the clean original) |" in text
    got = json.loads((tmp_path / "seams-colour.json").read_text())
    rows = got["clips"][0]["rows"]
    assert set(rows) == {"overlap 0", "cosine", "hann", "latent", "one window", "adain", "lab", "none"}
    assert len(rows["one window"]["per_frame_psnr"]) == 7
    assert len(rows["one window"]["seams"]["each"]) == len(got["clips"][0]["clean_seams"]["each"]) == 1
    assert "(the clean original, at the cosine joins)" in text
    assert "PSNR per frame" in text
    assert rows["overlap 0"]["seams"]["each"] and rows["latent"]["frames_decoded"] < rows["cosine"]["frames_decoded"]
    assert rows["cosine"]["frames_decoded"] == 10  # two windows of 5 frames, each decoded whole
    assert rows["latent"]["frames_decoded"] == 7  # the clip's timeline, once
    assert rows["lab"]["color_drift"]["windows"] and 0 < rows["none"]["ssim"] <= 1
