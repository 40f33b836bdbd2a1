"""`ditsp bench transport`: columns per policy and capacity, same bytes, staging within each capacity."""

import pytest

from ditsp.bench.transport import format_table, run_bench

pytestmark = pytest.mark.timeout(120)


def test_bench_columns_per_capacity(clusters):
    cfg = {"sp": 2, "policies": ["off", "chunked"], "capacities": [1 << 16, 1 << 13], "tokens": [4096], "heads": 4,
           "head_dim": 8, "dtype": "bf16", "window_grid": [3, 45, 80], "window_width": 16, "repeats": 1,
           "threads": 1}
    rows = run_bench(cfg, cluster=clusters(2))
    by = {(r["case"], r["policy"]): r for r in rows}
    assert {p for _, p in by} == {"off", "chunked 0.0625 MiB", "chunked 0.0078125 MiB"}
    for case in {c for c, _ in by}:
        off, small = by[(case, "off")], by[(case, "chunked 0.0078125 MiB")]
        assert small["sent"] == off["sent"] > 0 and small["calls"] > off["calls"]
        assert small["staging"] <= 1 << 13 and small["chunks"] > 1
    table = format_table(rows, cfg)
    assert "--capacity-mib 0.0625,0.0078125" in table and table.count("\n| ulysses 4k tokens |") == 3
