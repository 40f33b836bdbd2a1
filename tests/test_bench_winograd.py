"""`ditsp bench winograd` end to end on a narrower VAE: the whole-VAE row, every Winograd shape, the files."""

import json
import os

import pytest

from ditsp.cli import main
from ditsp.models.seedvr2.vae import winograd

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(winograd._op is None, reason="no oneDNN linear in this build")]


def test_winograd_bench_writes_whole_vae_and_shapes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(winograd.ENV, raising=False)
    argv = ["bench", "winograd", "--clip", "5,32,32", "--widths", "128,256,256,256", "--repeats", "1",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "vae-winograd.json").read_text())
    whole, shapes = res["whole"], res["shapes"]
    assert whole["direct_cpu_s"] > 0 and whole["winograd_cpu_s"] > 0
    assert 0 < whole["decoded_rel_diff"] < 2e-4 and whole["latent_rel_diff"] < 2e-4
    assert whole["vae_mode"] == "chunked"  # auto on one device
    assert {(r["c_in"], r["input"][1]) for r in shapes} >= {(128, 32), (256, 16)}  # 32x32 at 128, 16x16 at 256
    # direct: oneDNN's channels-last fp32 conv (the fast policy's layout) errs 2-3e-6, its blocked-layout one ~5e-7
    assert all(r["winograd_rel_err"] < 5e-5 and r["direct_rel_err"] < 5e-6 for r in shapes)
    assert "| C_in | C_out |" in (tmp_path / "vae-winograd.md").read_text()
    assert winograd.ENV not in os.environ  # the bench leaves the switch as it found it
