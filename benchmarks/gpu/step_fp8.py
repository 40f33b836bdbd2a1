"""Step 5b: the native FP8 matmul (:func:`ditsp.weights.fp8_matmul.scaled_linear`, ``torch._scaled_mm``: rows
quantized to e4m3fn per row, the stored e4m3fn weight as it is) against bf16 on the 3B's linear shapes
(the rows of a 720p window): time and error, both against the float32 product of the same
(dequantized) weight, so the error is the activations' FP8 rounding alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ditsp.models.seedvr2.nadit.config import get_config
from ditsp.weights.fp8 import dequantize, quantize
from ditsp.weights.fp8_matmul import native_supported, scaled_linear

from . import build
from .measure import rel_err, timed

TITLE = "native FP8 matmul against bf16 on the 3B's linear shapes"
FP8_TOL = 0.1  # e4m3fn keeps 3 mantissa bits: the rows' rounding moves a product by a few percent


def run(ctx) -> None:
    dev, prof = ctx.device, ctx.profile
    cfg = get_config(prof.fp8_model)
    d, inner, hid = cfg.vid_dim, cfg.heads * cfg.head_dim, cfg.mlp_hidden
    rows = math.prod(build.grid_of(prof.fp8_size))
    native = native_supported(dev)
    if ctx.cuda and not native:
        ctx.fail("native FP8", f"not supported on this device (capability {torch.cuda.get_device_capability(dev)})")
        return
    ctx.note(f"{rows} rows per linear ({prof.fp8_size[0]}x{prof.fp8_size[1]}x{prof.fp8_size[2]}); native FP8 here: "
             f"{native}" + ("" if native else " (CPU: torch's reference kernel, a dry run of the code)"))
    g = torch.Generator(dev).manual_seed(0)
    for name, k, n in (("qkv", d, 3 * inner), ("attn out", inner, d), ("mlp in", d, hid), ("mlp out", hid, d)):
        x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        raw, scale = quantize(w, "fp8_e4m3fn")
        wq = dequantize(raw, "fp8_e4m3fn", (n, k), scale, torch.bfloat16)
        want = x.float() @ wq.float().t()
        try:
            t_bf, _ = timed(lambda: F.linear(x, wq), dev, reps=5)
            t_fp, _ = timed(lambda: scaled_linear(x, raw, (n, k), scale), dev, reps=5)
            got_bf, got_fp = F.linear(x, wq), scaled_linear(x, raw, (n, k), scale)
        except Exception as e:  # noqa: BLE001 - the kernel refusing a shape is this row's failure
            ctx.fail(name, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", k=k, n=n)
            continue
        e_bf, e_fp = rel_err(got_bf, want), rel_err(got_fp, want)
        flop = 2 * rows * k * n
        ok = e_fp <= FP8_TOL and got_fp.dtype == torch.bfloat16 and got_fp.device == x.device
        ctx.row(name, "ok" if ok else "FAIL", None if ok else f"fp8 error {e_fp:.2e} ({got_fp.dtype}, {got_fp.device})",
                m=rows, k=k, n=n, bf16_ms=round(t_bf * 1e3, 3), fp8_ms=round(t_fp * 1e3, 3),
                fp8_speedup=round(t_bf / t_fp, 3), bf16_tflops=round(flop / t_bf / 1e12, 2),
                fp8_tflops=round(flop / t_fp / 1e12, 2), bf16_err=round(e_bf, 6), fp8_err=round(e_fp, 6))
