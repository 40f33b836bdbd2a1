"""Step 3: the NaDiT (3B, then 7B) at released widths, every block, seeded weights made on the device, one
device: warm forward time (device events), achieved TFLOP/s against the measured matmul rate, peak
memory against ditsp's estimate (``memory_estimate`` of the plan report, canonical input), and the
operations that made the host wait for the device during a warm forward (none may sit in the
per-layer code). Sizes larger than the step's time left are skipped, said so.
"""

from __future__ import annotations

import math
import time

import torch

from ditsp.models.seedvr2.job.plan_report import memory_estimate
from ditsp.models.seedvr2.nadit.config import get_config
from ditsp.models.seedvr2.parallelize import single_runtime
from ditsp.windows.schedule import plan_schedule

from . import build
from .measure import Peak, free_device_memory, gib, host_syncs, sync, timed

TITLE = "NaDiT at released widths, one device"
# The per-layer code: a host sync in one of these files stalls every layer (the rest run once a forward).
PER_LAYER = ("nadit/blocks", "nadit/blocks_7b", "nadit/rope", "nadit/tokenwise", "attention/window", "sp/",
             "windows/exchange", "distributed/transport", "fixed_shape")
OVER_ESTIMATE = 1.10  # a measured peak this far above the estimate admits jobs that run out of memory


def run(ctx) -> None:
    dev, prof = ctx.device, ctx.profile
    model, held = None, None
    rate = {}  # family -> achieved FLOP/s of its last item, to predict the next
    for preset, size, reps in prof.dit:
        cfg = get_config(preset)
        grid = build.grid_of(size)
        flops = build.forward_flops(cfg, grid)
        item = f"{preset} {size[0]}x{size[1]}x{size[2]}"
        guess = rate.get(preset) or 0.3 * (ctx.ceiling("bf16_matmul_tflops") or 1.0) * 1e12
        build_s = 0.0 if held == preset else (20.0 if ctx.cuda else 2.0)
        if not ctx.fits(item, build_s + (reps + 3) * flops / guess):
            continue
        if held != preset:
            model = None
            free_device_memory(dev)
            t0 = time.perf_counter()
            model = build.dit(preset, dev, prof.dtype)
            sync(dev)
            ctx.note(f"{preset}: {cfg.param_count() / 1e9:.2f} B parameters built on {dev} in "
                     f"{time.perf_counter() - t0:.1f} s")
            held = preset
        rate[preset] = _item(ctx, model, cfg, item, size, reps, flops)


@torch.no_grad()
def _item(ctx, model, cfg, item, size, reps, flops) -> float | None:
    dev = ctx.device
    grid, vid, txt = build.inputs(cfg, size, dev)
    rt = single_runtime(model.cfg, grid)
    schedule = plan_schedule(grid, cfg.window_methods, 1, "lpt", cfg.num_windows)
    est = memory_estimate(schedule, cfg, 2, feed="canonical")
    fwd = lambda: model(vid, txt, 1000.0, runtime=rt)  # noqa: E731
    with Peak(dev) as pk:
        t0 = time.perf_counter()
        y = fwd()
        sync(dev)
        first = time.perf_counter() - t0
    syncs: list = []
    with host_syncs(dev, syncs):
        fwd()
        sync(dev)
    t, times = timed(fwd, dev, reps=reps, warmup=0)
    finite = bool(torch.isfinite(y).all())
    tflops = flops / t / 1e12
    ceiling = ctx.ceiling("bf16_matmul_tflops")
    layer_syncs = sorted({loc for loc, _ in syncs if any(p in loc for p in PER_LAYER)})
    why = []
    if not finite:
        why.append("non-finite output")
    if layer_syncs:
        why.append("host syncs in the per-layer code: " + ", ".join(layer_syncs))
    if pk.peak is not None and pk.peak > OVER_ESTIMATE * est["total"]:
        why.append(f"peak {gib(pk.peak)} GiB over the estimate {gib(est['total'])} GiB")
    ctx.row(item, "FAIL" if why else "ok", "; ".join(why) or None, grid=list(grid), tokens=math.prod(grid),
            path=rt.report(), first_s=round(first, 3), fwd_s=round(t, 4), reps=len(times), tflop=round(flops / 1e12, 2),
            tflops=round(tflops, 3), of_matmul=round(tflops / ceiling, 3) if ceiling else None,
            peak_gib=gib(pk.peak), added_gib=gib(pk.added), reserved_gib=gib(pk.reserved),
            est_total_gib=gib(est["total"]), est_added_gib=gib(est["peak_added"]),
            peak_over_est=round(pk.peak / est["total"], 3) if pk.peak else None, host_syncs=len(syncs))
    others = sorted({loc for loc, _ in syncs} - set(layer_syncs))
    if others:
        ctx.note(f"{item}: host syncs once per forward (outside the layers): " + ", ".join(others))
    return flops / t
