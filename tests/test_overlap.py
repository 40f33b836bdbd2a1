"""Layout changes through the transport: the rows that stay are placed while the crossing rows fly.

Under every policy the output is one device's bits, every rank issues the same collectives, and
only rows that cross ranks are counted (and staged): a rank's own rows never enter the all-to-all.
"""

import pytest
import torch

from ditsp.distributed import transport as tp
from ditsp.distributed.comm import Comm
from ditsp.models.seedvr2.job.forward import RunSpec, build_for
from ditsp.fixed_shape import DETERMINISTIC
from ditsp.sp.window_aligned import WindowRuntime
from ditsp.models.seedvr2.parallelize import single_runtime

GRID = (5, 20, 36)


@torch.no_grad()
def policy_forward(ctx, planner, policy, capacity, dtype):
    spec = RunSpec("tiny", GRID, ctx.world_size, dtype=dtype)
    model, vid, txt = build_for(spec)
    cfg = model.cfg
    comm = Comm.of(ctx.group)
    rt = WindowRuntime(GRID, cfg.window_methods, comm, planner, cfg.num_windows, torch.float64,
                       tp.TransportSettings(policy=policy, capacity_bytes=capacity))
    rt.kernel_shapes = DETERMINISTIC
    out = model(vid, txt, 1000.0, runtime=rt)
    r = ctx.rank
    crossing = max(int(t.counts[r].sum() + t.counts[:, r].sum() - 2 * t.counts[r, r])
                   for t in rt.schedule.distinct_transitions().values())
    row_bytes = cfg.vid_dim * max(vid.element_size(), 2)
    return out, comm.stats.as_dict(), comm.staging_peak(), crossing * row_bytes, rt.transport.report()


@pytest.mark.bitwise
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_layout_changes_are_one_device_bits_under_every_policy(clusters, world, dtype):
    torch.set_num_threads(1)  # the ranks' thread count
    model, vid, txt = build_for(RunSpec("tiny", GRID, 1, dtype=dtype))
    with torch.no_grad():
        ref = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, GRID, deterministic=True))
    for planner in ("lpt", "locality"):
        off = clusters(world).run(policy_forward, planner, "off", 1 << 30, dtype)
        capacity = 8192
        ch = clusters(world).run(policy_forward, planner, "chunked", capacity, dtype)
        for (y, stats, peak, crossing, _), (y_ch, stats_ch, peak_ch, _, rep) in zip(off, ch):
            assert torch.equal(y, ref) and torch.equal(y_ch, ref)
            ex, ex_ch = stats["window_exchange"], stats_ch["window_exchange"]
            assert ex["bytes_sent"] == ex_ch["bytes_sent"] and ex_ch["calls"] > ex["calls"]
            assert rep["policy"] == "chunked" and peak_ch <= capacity
            assert peak <= crossing  # off stages crossing rows only: at most one send + one receive stage
        for runs in (off, ch):
            calls = [{k: v["calls"] for k, v in s.items()} for _, s, *_ in runs]
            assert all(c == calls[0] for c in calls)  # every rank issued the same collectives


def test_single_device_layout_changes_use_no_collective():
    model, vid, txt = build_for(RunSpec("tiny", GRID, 1))
    cfg = model.cfg
    rt = WindowRuntime.single(GRID, cfg.window_methods, cfg.num_windows, torch.float64)
    with torch.no_grad():
        assert torch.equal(model(vid, txt, 1000.0, runtime=rt), model(vid, txt, 1000.0, runtime=single_runtime(cfg, GRID)))
    assert rt.comm.stats.calls == 0 and rt.exposed_s >= 0.0
