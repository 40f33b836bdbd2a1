"""The shipped small restorer restores: loose quality bounds on a short held-out clip (the strict comparison
against bicubic lives in `ditsp bench restorer` and the README)."""

import json

import pytest

from ditsp.cli import main
from ditsp.train.heldout import main as heldout


@pytest.mark.usefixtures("one_thread")
def test_the_default_model_restores_the_held_out_clip_near_or_above_bicubic(tmp_path, capsys):
    inp, clean, out = tmp_path / "in.mp4", tmp_path / "clean", tmp_path / "out.mp4"
    assert heldout([str(inp), str(clean), "--size", "128x96", "--frames", "9"]) == 0
    capsys.readouterr()
    rc = main(["upscale", str(inp), "-o", str(out), "--reference", str(clean), "--deterministic", "--json",
               "--no-progress", "--threads", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert not report.get("random_weights")
    q = report["quality"]
    r, b = q["restored"]["overall"], q["bicubic"]["overall"]
    assert q["baseline"].startswith("bicubic written as the output")  # both through the same encoder
    assert r["psnr"] > 25 and r["psnr"] > b["psnr"] - 0.5 and r["ssim"] > b["ssim"] - 0.02, (r, b)
