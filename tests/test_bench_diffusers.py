"""`ditsp bench diffusers` bookkeeping (pure: the grid of a token count, merging per-rank rows, the table)."""

from __future__ import annotations

from ditsp.bench.diffusers import _grid, configs, format_table, merge


def test_grid_has_the_tokens():
    for tokens in (1000, 4096, 8192):
        f, h, w = _grid(tokens)
        assert f * (h // 2) * (w // 2) == tokens


def test_configs_and_merge():
    assert "ditsp-usp-2x2" in configs(4) and "ditsp-usp-2x2" not in configs(2)
    ok = {"config": "ditsp-ring", "tokens": 8, "ranks": 2, "status": "ok", "peak": 2**20}
    bad = {"config": "diffusers-ring", "tokens": 8, "ranks": 2, "status": "fails: no lse"}
    rows = merge([[dict(ok, times=[0.1, 0.3], rel_err=1e-7), bad], [dict(ok, times=[0.2, 0.1]), bad]])
    assert abs(rows[0]["ms"] - 250.0) < 1e-9 and rows[0]["peak_mib"] == 1.0  # median of per-forward maxima
    table = format_table(rows, "### t")
    assert "| ditsp-ring | 2 | 8 | 250.0 | 1.0 | 1.0e-07 | yes |" in table and "fails: no lse" in table
