"""`ditsp bench job` end to end at the smallest clip: both degrees, deterministic (the same frames), the table,
the JSON, and the per-rank CPU figures the restoration reports."""

import json

import pytest

from ditsp.cpu import malloc as cpu_malloc
from ditsp.cli import main

pytestmark = pytest.mark.timeout(600)


def test_job_bench_runs_one_device_and_sp2_and_they_write_the_same_frames(tmp_path, capsys):
    argv = ["bench", "job", "--sp", "1,2", "--frames", "5", "--size", "64x48", "--window-frames", "5",
            "--overlap", "0", "--deterministic", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "job.json").read_text())
    best = data["best"]
    assert set(best) == {"1", "2"}
    assert best["1"]["sha256"] == best["2"]["sha256"] and len(best["1"]["sha256"]) == 1
    for sp, b in best.items():
        assert b["wall_s"] > sum(b["stage_s"].values()) > 0
        assert b["cpu_all_s"] >= b["rank_cpu_max_s"] > 0
        assert all(v >= 0 for v in b["phases_s"].values()) and sum(b["phases_s"].values()) <= b["wall_s"] + 0.5
    assert len(data["runs"]["2"][0]["rank_cpu_s"]) == 2
    md = (tmp_path / "job.md").read_text()
    assert "| vae_decode s (rank 0 wall) |" in md and "SP=2 / SP=1" in md
    assert f"; CPU allocator {cpu_malloc.policy()}" in md  # the policy the runs started under
    (ceiling,) = data["at_once"]  # one round: two one-device jobs at once, the slowest's figures
    assert ceiling["wall_s"] >= sum(ceiling["stage_s"].values()) > 0
    assert "| 2 x SP=1 at once (slowest) |" in md and "| ceiling / measured |" in md


def test_ceiling_table_divides_the_at_once_figures_by_the_degree():
    from ditsp.bench.job import STAGES, format_ceiling

    def figures(wall, encode):
        stages = dict.fromkeys(STAGES, 0.0) | {"vae_encode": encode}
        return {"wall_s": wall, "stage_s": stages, "stage_cpu_max_rank_s": stages}

    lines = format_ceiling(2, figures(10.0, 4.0), figures(12.0, 4.8), figures(7.0, 3.0))
    encode = next(line for line in lines if line.startswith("| vae_encode"))
    assert encode == "| vae_encode s (rank 0 wall) | 4.00 | 4.80 | 0.60 | 0.75 | 0.80 |"
    wall = next(line for line in lines if line.startswith("| wall s"))
    assert wall == "| wall s | 10.00 | 12.00 | 0.60 | 0.70 | 0.86 |"
    assert not any(line.startswith("| vae_decode") for line in lines)  # a zero baseline has no ratio


def test_runs_at_once_raise_the_failing_runs_last_line(tmp_path):
    from ditsp.bench.job import _upscale_at_once

    with pytest.raises(RuntimeError, match="failed: .*"):
        _upscale_at_once([[str(tmp_path / "missing.mp4"), "-o", str(tmp_path / "out.mp4")]], timeout_s=120)


def test_job_bench_refuses_a_folder_without_weights(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "job", "--weights", str(tmp_path), "--out", str(tmp_path)])
    assert "no dit.safetensors there" in capsys.readouterr().err
