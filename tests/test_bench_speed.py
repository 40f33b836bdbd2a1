"""`ditsp bench speed` end to end at the smallest shapes: both cases, SP 1 and 2, the table and the JSON."""

import json

import pytest

from ditsp.cli import main

pytestmark = pytest.mark.timeout(300)


def test_speed_bench_runs_both_cases_at_sp_1_and_2(tmp_path, capsys):
    argv = ["bench", "speed", "--cases", "dit,vae", "--sp", "1,2", "--layers", "1", "--latent", "1,8,8",
            "--clip", "1,16,16", "--repeats", "1", "--top", "3", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())
    rows = rows["rows"]
    assert {(r["case"], r["sp"]) for r in rows} == {("dit", 1), ("dit", 2), ("vae", 1), ("vae", 2)}
    assert all(r["max_rel_err"] < 1e-5 for r in rows)  # compiled vs eager, fp32
    assert all(r["route_rel_err"] < 1e-5 for r in rows)  # oneDNN vs BLAS float32 linears
    assert all(r["blas_cpu_s"] > 0 for r in rows)
    assert "| case | SP |" in (tmp_path / "speed.md").read_text()
