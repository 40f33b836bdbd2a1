"""Slab <-> window hand-off: one transition between a VAE's height slabs and the DiT's windows equals gather + scatter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.models.seedvr2.nadit.model import patchify
from ditsp.sp.handoff import rows_to_tokens, tokens_to_rows
from ditsp.windows.ownership import RowOwnership, ownership_transition
from ditsp.windows.schedule import plan_schedule

PATCH = (1, 2, 2)


def slab_ranges(t: int, h: int, world: int):
    """Uneven height slabs with odd boundaries (not patch aligned); ranks past h hold nothing."""
    cuts = np.linspace(0, h, world + 1).round().astype(int)
    cuts[1:-1] += 1  # shift the inner cuts by one row: boundaries fall inside 2x2 patches
    cuts = np.clip(cuts, 0, h)
    return [(0, t, int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def handoff_rank(ctx, latent_grid, planner):
    comm = Comm.of(ctx.group)
    T, H, W = latent_grid
    full = torch.arange(T * H * W * 3, dtype=torch.float32).reshape(T, H, W, 3)
    slabs = RowOwnership.slabs(latent_grid, slab_ranges(T, H, ctx.world_size))
    mine = full.reshape(-1, 3)[torch.from_numpy(slabs.rank_ids(ctx.rank))]
    sched = plan_schedule((T, H // 2, W // 2), ["regular", "shifted"], ctx.world_size, planner)
    tokens = RowOwnership.of_plan(sched.plans[sched.layer_methods[0]])
    got = rows_to_tokens(mine, slabs, tokens, PATCH, comm)
    want = patchify(full, PATCH)[torch.from_numpy(tokens.rank_ids(ctx.rank))]
    back = tokens_to_rows(got, tokens, slabs, PATCH, comm)
    return torch.equal(got, want), torch.equal(back, mine), comm.stats.as_dict()


@pytest.mark.parametrize("world,planner", [(2, "lpt"), (3, "locality"), (4, "lpt")])
def test_slabs_to_windows_equals_gather_then_scatter(clusters, world, planner):
    results = clusters(world).run(handoff_rank, (3, 10, 12), planner)
    assert all(a and b for a, b, _ in results)
    kinds = results[0][2]
    assert kinds["window_exchange"]["calls"] == 2  # one transition each way, no gathers


def test_more_ranks_than_slab_rows(clusters):
    results = clusters(4).run(handoff_rank, (1, 2, 4), "lpt")  # 2 latent rows, 4 ranks: empty ranks
    assert all(a and b for a, b, _ in results)


def test_refine_keeps_patch_order_and_counts():
    sched = plan_schedule((2, 3, 4), ["regular"], 3)
    tok = RowOwnership.of_plan(sched.plans[sched.layer_methods[0]])
    fine = tok.refine(PATCH)
    assert fine.grid == (2, 6, 8) and list(fine.rank_rows) == [4 * n for n in tok.rank_rows]
    slabs = RowOwnership.slabs((2, 6, 8), slab_ranges(2, 6, 3))
    t = ownership_transition(slabs, fine)
    assert t.counts.sum() == 2 * 6 * 8 and (t.counts.sum(1) == slabs.rank_rows).all()
    with pytest.raises(ValueError, match="held by no rank"):
        RowOwnership.slabs((2, 6, 8), [(0, 2, 0, 3)])


def dit_rows_rank(ctx, path):
    """The NaDiT fed this rank's latent slab (rows=...) returns exactly its slab of the full output."""
    from ditsp.config import ParallelConfig
    from ditsp.models.seedvr2.job.forward import Engine, ModelSpec
    from ditsp.models.seedvr2.nadit.model import random_inputs
    from ditsp.models.seedvr2.parallelize import parallelize

    model = Engine.get(ModelSpec("tiny")).model
    grid = (2, 5, 6)  # tokens; the latent is (2, 10, 12)
    vid, txt = random_inputs(model.cfg, grid, seed=3)
    slabs = RowOwnership.slabs(vid.shape[:3], slab_ranges(2, 10, ctx.world_size))
    ids = torch.from_numpy(slabs.rank_ids(ctx.rank))
    pc = ParallelConfig.window(ctx.world_size, window_path=path)
    with torch.no_grad():
        full = model(vid, txt, 1000.0, runtime=parallelize(model.cfg, pc, grid, ctx.group))
        rt = parallelize(model.cfg, pc, grid, ctx.group)
        mine = model(vid.reshape(-1, 33)[ids], txt, 1000.0, runtime=rt, rows=slabs)
    kinds = rt.comm.stats.as_dict()
    return torch.equal(mine, full.reshape(-1, 16)[ids]), "output_gather" in kinds


@pytest.mark.parametrize("world,path", [(1, "window"), (2, "window"), (3, "ulysses"), (3, "halo")])
def test_dit_takes_and_returns_slabs(clusters, world, path):
    from ditsp.distributed.launcher import RankContext

    if world == 1:
        results = [dit_rows_rank(RankContext(0, 1, None, torch.device("cpu")), path)]
    else:
        results = clusters(world).run(dit_rows_rank, path)
    assert all(same for same, _ in results)
    assert not any(gathered for _, gathered in results)  # the output went to the slabs, not to every rank
