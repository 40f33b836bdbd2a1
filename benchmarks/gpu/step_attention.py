"""Step 2: the attention kernels on this device against the pure-torch reference kernel.

Global attention (``ditsp/attention/kernels.py``): which backend :func:`choose` picks per dtype and
head dim and why (a fallback to the reference where a kernel of the table takes the call is a
failure: the slow path running where a fast one was expected), then each kernel's forward (output
and log-sum-exp) and backward (dq, dk, dv) against the reference on fresh random inputs, with and
without GQA, causal and not. Window attention (the NaDiT's path, ``ditsp/attention/window.py``):
which SDPA backend torch picks for a 720p window of [video, text], each SDPA backend forced in turn,
against the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditsp.attention import kernels as K
from ditsp.attention.window import segment_attention

from .measure import rel_err, timed

TITLE = "attention kernels against the reference"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ‖kernel − reference‖ / ‖reference‖ allowed, per input dtype (the reference computes in fp32 from the same
# rounded inputs; kernels round their output and intermediates to the input dtype).
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _sdpa_names() -> dict[int, str]:
    from torch.nn.attention import SDPBackend

    return {int(b.value): name.lower() for name, b in SDPBackend.__members__.items()}


def run(ctx) -> None:
    dev, prof = ctx.device, ctx.profile
    g = torch.Generator(dev).manual_seed(1)
    ctx.note(f"device {dev}; kernels of the table for this device: "
             + ", ".join(k.name for k in K.TABLE if k.device == dev.type))
    # Which backend each (dtype, head dim) gets, and why.
    for dt in DTYPES:
        for d in prof.attn_head_dims:
            c = K.choose(dev.type, dt, d)
            takers = [k.name for k in K.TABLE if k.rejects(dev.type, dt, d) is None]
            bad = c.fallback or (c.name == "reference" and takers)
            ctx.row("choose", "FAIL" if bad else "ok", c.reason if bad else None, dtype=_name(dt), head_dim=d,
                    chosen=c.name, reason=c.reason or "", fallback=c.fallback)
    # Each kernel against the reference: forward and backward.
    S = prof.attn_seq
    for k in K.TABLE:
        if k.device != dev.type:
            continue
        for dt in DTYPES:
            for d in prof.attn_head_dims:
                if k.rejects(dev.type, dt, d):
                    continue
                for heads, kv in ((8, 8), (8, 2)):
                    for causal in (False, True):
                        _check(ctx, k.name, dt, d, heads, kv, causal, S, g)
    _timing(ctx, g)
    _window(ctx, g)


def _check(ctx, name, dt, d, heads, kv, causal, S, g) -> None:
    dev = ctx.device
    q = torch.randn(2, heads, S, d, device=dev, generator=g).to(dt)
    k = torch.randn(2, kv, S, d, device=dev, generator=g).to(dt)
    v = torch.randn(2, kv, S, d, device=dev, generator=g).to(dt)
    dout = torch.randn(2, heads, S, d, device=dev, generator=g).to(dt)
    scale = d ** -0.5
    fields = dict(kernel=name, dtype=_name(dt), head_dim=d, heads=f"{heads}/{kv}", causal=causal)
    try:
        ro, rl = K.block_fwd("reference", q, k, v, scale, causal)
        rg = K.block_bwd("reference", q, k, v, ro, rl, dout, scale, causal=causal)
        o, lse = K.block_fwd(name, q, k, v, scale, causal)
        gr = K.block_bwd(name, q, k, v, o, lse, dout, scale, causal=causal)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is this row's failure
        ctx.fail("kernel vs reference", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", **fields)
        return
    errs = {"out": rel_err(o, ro), "lse": float((lse.double() - rl.double()).abs().max()),
            "dq": rel_err(gr[0], rg[0]), "dk": rel_err(gr[1], rg[1]), "dv": rel_err(gr[2], rg[2])}
    devices = {t.device.type for t in (o, lse, *gr)}
    tol = TOL[dt]
    bad = [f"{n} {e:.2e}" for n, e in errs.items() if not e <= (tol * 10 if n == "lse" else tol)]
    if devices != {dev.type}:
        bad.append(f"results on {sorted(devices)}")
    ctx.row("kernel vs reference", "FAIL" if bad else "ok", ("over tolerance: " + ", ".join(bad)) if bad else None,
            **fields, **{f"{n}_err": round(e, 7) for n, e in errs.items()}, tol=tol)


def _timing(ctx, g) -> None:
    """Forward and backward time of each kernel that takes bf16 at the timing size, and the reference's."""
    dev = ctx.device
    heads, S, d = ctx.profile.attn_timing
    q, k, v, dout = (torch.randn(1, heads, S, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    flops = 4 * heads * S * S * d  # forward; the backward is about 2.5x
    names = [kk.name for kk in K.TABLE if kk.device == dev.type and not kk.rejects(dev.type, torch.bfloat16, d)]
    for name in names + ["reference"]:
        if not ctx.fits(f"time {name}", 10.0 if name == "reference" else 2.0):
            continue
        try:
            o, lse = K.block_fwd(name, q, k, v, scale)
            tf, _ = timed(lambda: K.block_fwd(name, q, k, v, scale), dev, reps=5)
            tb, _ = timed(lambda: K.block_bwd(name, q, k, v, o, lse, dout, scale), dev, reps=5)
        except Exception as e:  # noqa: BLE001
            ctx.fail(f"time {name}", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        ctx.row(f"time {name}", shape=f"1x{heads}x{S}x{d} bf16", fwd_ms=round(tf * 1e3, 3), bwd_ms=round(tb * 1e3, 3),
                fwd_tflops=round(flops / tf / 1e12, 2))


def _window(ctx, g) -> None:
    """The NaDiT's window attention (one SDPA call over the windows of a shape): the backend torch picks, each
    backend forced, against the reference, at a 720p window of the 3B (3x15x27 video tokens + 58 text)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = ctx.device
    n, lv, L, heads, d = (8, 3 * 15 * 27, 58, 20, 128) if ctx.cuda else (2, 18, 5, 3, 32)
    q, k, v = (torch.randn(n, lv + L, heads, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(3))
    ref, _ = K.attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), d ** -0.5)
    ref = ref.transpose(1, 2)
    names = _sdpa_names()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    try:
        picked = names.get(int(torch._fused_sdp_choice(qt, kt, vt)), "?")
    except Exception as e:  # noqa: BLE001 - a private helper: say so rather than fail the row
        picked = f"unknown ({type(e).__name__})"
    out = segment_attention(q, k, v)
    err = rel_err(out, ref)
    slow = ctx.cuda and picked == "math"
    ok = err <= TOL[torch.bfloat16] and not slow
    ctx.row("window attention (default)", "ok" if ok else "FAIL",
            None if ok else ("torch picked the math backend (slow path)" if slow else f"error {err:.2e}"),
            shape=f"{n} windows x {lv}+{L} rows x {heads}x{d} bf16", sdpa_backend=picked, out_err=round(err, 6))
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        item = f"window attention ({b.name.lower()})"
        try:
            with sdpa_kernel([b]):
                t, _ = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt), dev, reps=3)
                o = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        except Exception as e:  # noqa: BLE001 - a backend that does not take the call is information here
            ctx.skip(item, f"not available: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        e = rel_err(o, ref)
        ctx.row(item, "ok" if e <= TOL[torch.bfloat16] else "FAIL", None if e <= TOL[torch.bfloat16] else f"error {e:.2e}",
                ms=round(t * 1e3, 3), out_err=round(e, 6))
