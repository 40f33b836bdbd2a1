"""Packed window SP: several SeedVR2 requests (clips, images, different sizes) in one SP forward,
each output bitwise equal to running it alone on one device."""

from __future__ import annotations

import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.models.seedvr2.nadit.model import build_model, random_inputs
from ditsp.models.seedvr2.packed import packed_forward, packed_runtime
from ditsp.windows.packed import packed_layout
from ditsp.windows.planners import plan_layouts
from ditsp.models.seedvr2.parallelize import single_runtime

# a short clip, an image, a bigger clip at another resolution, a tiny image
GRIDS = [(2, 6, 8), (1, 4, 6), (3, 10, 6), (1, 2, 2)]


def requests(cfg):
    out = []
    for i, g in enumerate(GRIDS):
        vid, txt = random_inputs(cfg, g, seed=i, txt_len=5 + 2 * i)
        out.append((vid, txt, float(100 + 300 * i)))
    return out


def _rank(ctx, planner):
    torch.set_num_threads(1)
    model = build_model("tiny")
    reqs = requests(model.cfg)
    comm = Comm.of(ctx.group)
    rt = packed_runtime(model, GRIDS, [t.shape[0] for _, t, _ in reqs], comm, planner, deterministic=True)
    outs = packed_forward(model, reqs, rt)
    return outs, comm.stats.as_dict()


@pytest.fixture(scope="module")
def alone():
    torch.set_num_threads(1)
    model = build_model("tiny")
    return [model(v, t, ts, runtime=single_runtime(model.cfg, model.grid_of(v.shape), deterministic=True))
            for v, t, ts in requests(model.cfg)]


@pytest.mark.bitwise
def test_packed_single_device_bitwise(alone):
    model = build_model("tiny")
    outs = packed_forward(model, requests(model.cfg), deterministic=True)
    for a, b in zip(alone, outs):
        assert torch.equal(a, b)


@pytest.mark.bitwise
@pytest.mark.parametrize("n,planner", [(2, "lpt"), (3, "locality"), (4, "lpt"), (4, "locality")])
def test_packed_sp_bitwise(clusters, alone, n, planner):
    results = clusters(n).run(_rank, planner)
    layers = build_model("tiny").cfg.num_layers
    for outs, stats in results:
        for a, b in zip(alone, outs):
            assert torch.equal(a, b)
        # one gather, one text all-reduce per layer with text out, one exchange per layout change
        assert stats["output_gather"]["calls"] == 1
        assert stats["text_all_reduce"]["calls"] == layers - 1
        assert stats.get("window_exchange", {"calls": 0})["calls"] <= layers - 1


def test_packed_layout_planned_by_both_planners():
    reg, sh = packed_layout(GRIDS, "regular"), packed_layout(GRIDS, "shifted")
    total = sum(t * h * w for t, h, w in GRIDS)
    assert reg.layout.num_tokens == total and sorted(reg.layout.token_ids.tolist()) == list(range(total))
    for planner in ("lpt", "locality"):
        plans = plan_layouts((reg.layout, sh.layout), 3, planner)
        for p in plans:
            assert sorted(i for ws in p.rank_windows for i in ws) == list(range(len(p.layout)))
    assert packed_layout(GRIDS, "regular") is reg
    assert packed_layout(GRIDS[:2], "regular").layout.fingerprint != reg.layout.fingerprint


def _mismatch(ctx):
    from ditsp.distributed.agree import DisagreementError
    model = build_model("tiny")
    grids = GRIDS if ctx.rank == 0 else GRIDS[:-1]
    try:
        packed_runtime(model, grids, [5] * len(grids), Comm.of(ctx.group))
    except DisagreementError as e:
        return str(e)
    return None


def test_packed_requests_disagree_raises_everywhere(clusters):
    assert all(m and "grids" in m for m in clusters(2).run(_mismatch))
