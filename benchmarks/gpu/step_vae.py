"""Step 4: the VAE at released widths in bf16, encode then decode of a 720p clip in every exact mode that runs
on one device (the splitting modes run their machinery on one piece): time (device events), peak
memory against the modelled peak (:func:`ditsp.models.seedvr2.vae.memory.estimate`, weights
excluded: they are resident before the measured region), and each mode's output against
``replicated``'s (the exact modes compute the same function; on a GPU within rounding).
"""

from __future__ import annotations

import time

import torch

from ditsp.dtypes import DTYPES
from ditsp.fixed_shape import current
from ditsp.models.seedvr2.vae import RELEASED
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.memory import backend_of, counts_winograd, estimate
from ditsp.models.seedvr2.vae.modes import EXACT_MODES
from ditsp.models.seedvr2.vae.sharded import ParallelVAE

from .measure import Peak, gib, rel_err, sync, timed

TITLE = "VAE at released widths, every exact mode on one device"
OVER_ESTIMATE = 1.10  # as the DiT's: a peak this far above the model admits jobs that run out of memory
AGREE = 2e-2  # bf16: exact modes against replicated (different kernel shapes, different rounding)


def run(ctx) -> None:
    dev, prof = ctx.device, ctx.profile
    cfg = RELEASED if prof.vae_widths is None else RELEASED.with_widths(prof.vae_widths, groups=prof.vae_groups)
    dtype = DTYPES[prof.dtype]
    t0 = time.perf_counter()
    vae = seeded_vae(cfg).to(device=dev, dtype=dtype)
    sync(dev)
    ctx.note(f"VAE widths {cfg.widths}, {sum(p.numel() for p in vae.parameters()) / 1e6:.0f} M parameters, "
             f"{prof.dtype}, built in {time.perf_counter() - t0:.1f} s")
    T, H, W = prof.vae_clip
    g = torch.Generator(dev).manual_seed(0)
    x = (torch.rand(1, 3, T, H, W, device=dev, generator=g) * 2 - 1).to(dtype)
    backend = backend_of(dev, current().deterministic)
    winograd = counts_winograd(dev, current().deterministic)
    pv = ParallelVAE(vae)
    s = cfg.spatial_factor
    with torch.no_grad():  # warm-up at a small clip: library handles, kernel selection
        small = x[:, :, :5, : max(s, H // 4 // s * s), : max(s, W // 4 // s * s)]
        pv.decode(pv.encode(small, mode="replicated").posterior.mean, mode="replicated")
    sync(dev)
    ref, took = {}, None
    for mode in EXACT_MODES:
        if took is not None and not ctx.fits(mode, took * 1.5 + 2.0):
            continue
        t_mode = time.perf_counter()
        for op in ("encode", "decode"):
            try:
                _op(ctx, pv, cfg, mode, op, x, ref, backend, winograd)
            except Exception as e:  # noqa: BLE001 - this mode's failure; the next mode still runs
                if "CUDA error" in str(e):  # the context may be broken: end the step (a fresh process goes on)
                    raise
                ctx.fail(f"{op} {mode}", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
                if ctx.cuda:
                    torch.cuda.empty_cache()
        took = time.perf_counter() - t_mode


@torch.no_grad()
def _op(ctx, pv, cfg, mode, op, x, ref, backend, winograd) -> None:
    dev = ctx.device
    T, H, W = x.shape[2:]
    if op == "decode" and "encode" not in ref:
        ctx.skip(f"decode {mode}", "no latent: replicated's encode did not run")
        return
    z = ref.get("encode")
    box: list = []
    fn = (lambda: pv.encode(x, mode=mode).posterior.mean) if op == "encode" else (lambda: pv.decode(z, mode=mode))
    with Peak(dev) as pk:
        t, _ = timed(lambda: box.append(fn()), dev, reps=1, warmup=0)
    out = box[0]
    if ctx.profile.vae_reps:  # the first run of a mode sets it up (agreement, buffers): time warm runs too
        t, _ = timed(fn, dev, reps=ctx.profile.vae_reps, warmup=0)
    model = estimate(cfg, op, (T, H, W), 1, mode, x.dtype, 1, gather=True, backend=backend, winograd_filters=winograd)
    modelled = model.total - model.weights
    err = rel_err(out, ref[op]) if op in ref else 0.0
    ref.setdefault(op, out)
    why = []
    if not bool(torch.isfinite(out).all()):
        why.append("non-finite output")
    if not err <= AGREE:
        why.append(f"differs from replicated by {err:.2e}")
    if pk.added is not None and pk.added > OVER_ESTIMATE * modelled:
        why.append(f"peak {gib(pk.added)} GiB over the model {gib(modelled)} GiB")
    ctx.row(f"{op} {mode}", "FAIL" if why else "ok", "; ".join(why) or None, clip=f"{T}x{H}x{W}", seconds=round(t, 3),
            peak_added_gib=gib(pk.added), reserved_gib=gib(pk.reserved), model_gib=gib(modelled),
            peak_over_model=round(pk.added / modelled, 3) if pk.added else None, peak_op=model.peak_op,
            vs_replicated=round(err, 6))
