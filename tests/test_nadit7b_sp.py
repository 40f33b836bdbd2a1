"""The 7B family on every SP path: window-aligned SP (lpt, locality) at uneven degrees and the Ulysses baseline."""

import pytest
import torch

from ditsp.config import ParallelConfig
from ditsp.models.seedvr2.job.forward import RunSpec, build_for, rank_forward
from ditsp.models.seedvr2.nadit.config import NaDiTConfig
from ditsp.models.seedvr2.nadit.model import NaDiT, init_random_, random_inputs
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime

pytestmark = pytest.mark.timeout(180)
GRID = (5, 20, 36)


@pytest.fixture(scope="module")
def reference():
    model, vid, txt = build_for(RunSpec(model="tiny-7b", grid=GRID, sp=1))
    with torch.no_grad():
        return model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, GRID))


@pytest.mark.parametrize("world,planner,path", [(2, "lpt", "window"), (5, "locality", "window"),
                                                (2, "lpt", "ulysses")])
def test_tiny_7b_sp_matches_single_device(clusters, reference, world, planner, path):
    """3 heads: SP=2 and SP=5 keep all heads on every rank; Ulysses splits them 2/1."""
    spec = RunSpec(model="tiny-7b", grid=GRID, sp=world, planner=planner, path=path)
    results = clusters(world).run(rank_forward, spec)
    out = results[0]["output"]
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
    report = results[0]["report"]
    if path == "window":
        assert report == f"window-aligned Plan A, planner {planner}, SP={world}, 3 heads on every rank"
        # the discarded last-block text output costs no reduction
        assert results[0]["collectives"]["text_all_reduce"]["calls"] == 3
    else:
        assert "heads per rank 2/1" in report


# 24 heads (the 7B's count) on a narrow model: 24 % 5 != 0, which the reference's Ulysses cannot run.
WIDE_HEADS = NaDiTConfig(name="heads24-7b", variant="7b", vid_dim=384, heads=24, head_dim=16, num_layers=2,
                         mm_layers=2, mlp_hidden=1536, rope_dim=8, txt_len=7)


@torch.no_grad()
def heads24_forward(ctx):
    model = init_random_(NaDiT(WIDE_HEADS), seed=3).eval()
    vid, txt = random_inputs(WIDE_HEADS, (3, 8, 10), seed=4)
    group = ctx.group if ctx.world_size > 1 else None
    rt = parallelize(WIDE_HEADS, ParallelConfig.window(ctx.world_size, window_path="window"), (3, 8, 10), group)
    return model(vid, txt, 1000.0, runtime=rt), rt.report(heads=WIDE_HEADS.heads)


def test_24_heads_at_sp5_keep_all_heads_on_every_rank(clusters):
    assert WIDE_HEADS.rope_channels == 6
    ref, _ = heads24_forward(type("Ctx", (), {"world_size": 1, "group": None})())
    results = clusters(5).run(heads24_forward)
    for out, report in results:
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert report.endswith("SP=5, 24 heads on every rank")
