"""`ditsp bench gather` at the smallest sizes: both routes measured, the same bits, the table and the JSON."""

import json

import pytest

from ditsp.cli import main

pytestmark = pytest.mark.timeout(600)


def test_gather_bench_times_both_routes_and_they_agree(tmp_path):
    argv = ["bench", "gather", "--sp", "2", "--repeats", "2", "--rounds", "1", "--clip", "5,32,32", "--out", str(tmp_path)]
    assert main(argv) == 0
    ranks = json.loads((tmp_path / "gather.json").read_text())["ranks"]
    assert len(ranks) == 2 and all(r["same_bits"] and r["shm"] for r in ranks)
    assert all(set(r["latency"]) == {"gloo", "shm"} and all(v > 0 for n in r["latency"].values() for v in n.values())
               for r in ranks)
    md = (tmp_path / "gather.md").read_text()
    assert "| 512 KiB per rank |" in md and "| decode s |" in md and "shm / gloo" in md


def test_gather_bench_refuses_one_rank(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "gather", "--sp", "1", "--out", str(tmp_path)])
    assert "--sp must be at least 2" in capsys.readouterr().err
