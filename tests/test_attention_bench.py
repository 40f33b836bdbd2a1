"""`ditsp bench attention`: the table runs, and its byte counts are the analytic ones."""

from __future__ import annotations

import pytest

from ditsp.bench.attention import format_table, run_bench, strategies_for
from ditsp.cli import build_parser


def test_strategies_for_mesh():
    assert [s[0] for s in strategies_for(2)] == ["ulysses", "ring", "allgather"]
    assert ("usp-ring", 2, 2) in strategies_for(4) and ("usp-ring", 2, 4) in strategies_for(8)


def test_cli_wires_bench_attention():
    args = build_parser().parse_args(["bench", "attention", "--sp", "2", "--seq", "64", "--heads", "4"])
    assert args.func.__name__ == "main" and args.head_dim == 64


@pytest.mark.timeout(120)
def test_bench_table_and_bytes(clusters):
    cfg = {"sp": 2, "seq": 64, "heads": 4, "kv_heads": 4, "head_dim": 8, "batch": 1, "text": 0, "dtype": "fp32",
           "backward": False, "warmup": 1, "iters": 2, "threads": 1,
           "strategies": strategies_for(2) + [("a2a-sdpa", 2, 1), ("sdpa-1dev", 1, 1)]}
    rows = {r["strategy"]: r for r in run_bench(cfg, cluster=clusters(2))}
    shard = 32 * 4 * 8 * 4  # one rank's q (or k, or v): 32 rows x 4 heads x 8 x fp32
    assert rows["ulysses"]["sent_mib"] * 2**20 == (3 + 1) * shard / 2 and rows["ulysses"]["calls"] == 4
    assert rows["ring"]["sent_mib"] * 2**20 == 2 * shard and rows["ring"]["calls"] == 1
    assert rows["allgather"]["sent_mib"] * 2**20 == 2 * shard and rows["allgather"]["calls"] == 1
    # The minimal all-to-all + SDPA baseline: Q, K, V and the output each in their own exchange.
    assert rows["a2a-sdpa"]["sent_mib"] * 2**20 == (3 + 1) * shard / 2 and rows["a2a-sdpa"]["calls"] == 4
    assert rows["sdpa-1dev"]["calls"] == 0
    assert rows["ulysses"]["backend"] == "cpu_flash" and rows["a2a-sdpa"]["backend"] == "sdpa"
    assert all(r["peak_mib"] >= 0 for r in rows.values())
    table = format_table(list(rows.values()), cfg)
    assert "vs ulysses" in table and "peak MiB/rank" in table


def test_baseline_fits():
    from ditsp.bench.attention_baselines import baseline_fits

    cfg = {"sp": 2, "seq": 64, "heads": 4, "kv_heads": 4, "text": 0}
    assert baseline_fits("a2a-sdpa", cfg) is None and baseline_fits("sdpa-1dev", cfg) is None
    assert "divisible" in baseline_fits("a2a-sdpa", {**cfg, "heads": 3, "kv_heads": 3})
    assert baseline_fits("a2a-sdpa", {**cfg, "text": 4})
