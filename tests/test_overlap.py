"""Overlapped layout changes (``WindowRuntime(overlap=True)``): one device's bits, the same
collectives on every rank, the same rows moved as the synchronous exchange."""

import pytest
import torch

from ditsp.dist.comm import Comm
from ditsp.engine import RunSpec, build_for
from ditsp.sp.window_aligned import WindowRuntime

GRID = (5, 20, 36)


@torch.no_grad()
def overlap_forward(ctx, planner, overlap, dtype):
    spec = RunSpec("tiny", GRID, ctx.world_size, dtype=dtype)
    model, vid, txt = build_for(spec)
    cfg = model.cfg
    rt = WindowRuntime(GRID, cfg.window_methods, Comm.of(ctx.group), planner, cfg.num_windows, torch.float64,
                       overlap=overlap)
    out = model(vid, txt, 1000.0, runtime=rt)
    return out, rt.comm.stats.as_dict(), rt.report()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_overlap_is_one_device_bits_and_same_collectives(clusters, world, dtype):
    torch.set_num_threads(1)  # the ranks' thread count
    model, vid, txt = build_for(RunSpec("tiny", GRID, 1, dtype=dtype))
    with torch.no_grad():
        ref = model(vid, txt, 1000.0)
    for planner in ("lpt", "locality"):
        on = clusters(world).run(overlap_forward, planner, True, dtype)
        off = clusters(world).run(overlap_forward, planner, False, dtype)
        for (y, stats, report), (y_off, stats_off, _) in zip(on, off):
            assert torch.equal(y, ref) and torch.equal(y, y_off)
            assert "overlapped" in report
            # one all-to-all per layout change, the same rows crossing ranks as without overlap
            assert stats["window_exchange"] == stats_off["window_exchange"]
        calls = [{k: v["calls"] for k, v in s.items()} for _, s, _ in on]
        assert all(c == calls[0] for c in calls)  # every rank issued the same collectives


def test_overlap_single_device_is_the_plain_path():
    model, vid, txt = build_for(RunSpec("tiny", GRID, 1))
    cfg = model.cfg
    rt = WindowRuntime.single(GRID, cfg.window_methods, cfg.num_windows, torch.float64, overlap=True)
    with torch.no_grad():
        assert torch.equal(model(vid, txt, 1000.0, runtime=rt), model(vid, txt, 1000.0))
    assert rt.comm.stats.calls == 0 and rt.exposed_s >= 0.0
