"""Automatic SP path choice (ditsp/sp/choice.py): the cost model, and one choice on every rank."""

import json

import pytest
import torch

from ditsp.config import ParallelConfig
from ditsp.distributed.agree import DisagreementError
from ditsp.models.seedvr2.job.forward import RunSpec, build_for
from ditsp.models.seedvr2.nadit.config import TINY, get_config
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime
from ditsp.sp.choice import CANDIDATES, ENV_LINK, ChosenRuntime, Link, choose, path_costs

pytestmark = pytest.mark.timeout(120)
GRID = (5, 20, 36)


def test_costs_cover_every_candidate_and_sort():
    costs = path_costs(TINY, GRID, 3)
    assert [c.path for c in costs] == list(CANDIDATES)
    ch = choose(TINY, GRID, 3)
    assert [c.total_s for c in ch.costs] == sorted(c.total_s for c in ch.costs)
    assert "auto chose" in ch.describe() and "runner-up" in ch.describe()


def test_one_rank_is_plan_a_and_links_move_the_choice():
    assert choose(TINY, GRID, 1).best.path == "window/lpt"
    cfg = get_config("seedvr2-3b")
    slow = Link(bandwidth=1e8, latency=1e-6, flops=1e18)  # bytes dominate: the fewest bytes win
    costs = path_costs(cfg, (21, 45, 80), 4, slow)
    assert choose(cfg, (21, 45, 80), 4, slow).best.path == min(costs, key=lambda c: c.bytes).path
    fast = Link(bandwidth=1e15, latency=0.0, flops=1e12)  # compute dominates: the best balance wins
    assert choose(cfg, (21, 45, 80), 4, fast).best.imbalance == min(c.imbalance for c in costs)


def test_link_file(tmp_path, monkeypatch):
    f = tmp_path / "link.json"
    f.write_text(json.dumps({"bandwidth": 1e9, "latency": 1e-4, "flops": 1e10, "name": "x"}))
    monkeypatch.setenv(ENV_LINK, str(f))
    assert Link.load() == Link(1e9, 1e-4, 1e10, "x")


@torch.no_grad()
def auto_forward(ctx, link_per_rank=None):
    import os

    if link_per_rank:
        os.environ[ENV_LINK] = link_per_rank[ctx.rank]
    try:
        spec = RunSpec("tiny", GRID, ctx.world_size)
        model, vid, txt = build_for(spec)
        rt = parallelize(model.cfg, ParallelConfig.window(ctx.world_size, window_path="auto", deterministic=True), GRID,
                         ctx.group)
        return model(vid, txt, 1000.0, runtime=rt), rt.report(), rt.choice.best.path
    finally:
        os.environ.pop(ENV_LINK, None)


@pytest.mark.bitwise
def test_auto_is_one_choice_on_every_rank_and_one_device_bits(clusters):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, vid, txt = build_for(RunSpec("tiny", GRID, 1))
        ref = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, GRID, deterministic=True))
        results = clusters(2).run(auto_forward)
    finally:
        torch.set_num_threads(before)
    assert len({path for _, _, path in results}) == 1
    for out, report, path in results:
        assert torch.equal(out, ref) and "auto chose" in report and "runner-up" in report


def test_ranks_with_different_links_refuse_together(clusters, tmp_path):
    files = []
    for i, bw in enumerate((1e9, 2e9)):
        f = tmp_path / f"link{i}.json"
        f.write_text(json.dumps({"bandwidth": bw}))
        files.append(str(f))
    with pytest.raises(Exception, match="auto SP path"):
        clusters(2).run(auto_forward, files)


def test_single_device_auto_runtime():
    rt = parallelize(TINY, ParallelConfig(window_path="auto"), GRID, None)
    assert isinstance(rt, ChosenRuntime) and rt.choice.best.path == "window/lpt"
    _ = DisagreementError  # the error every rank raises on a mismatch (tested above through the cluster)
