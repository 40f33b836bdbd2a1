"""The native FP8 matmul for linear layers whose weight is stored in ``float8_e4m3fn``, behind a check.

The default path dequantizes an FP8 weight to the compute dtype per layer (``quantized.py``) and
runs a bf16/fp32 GEMM: exact with respect to the stored weight. Where the device multiplies FP8
natively (CUDA compute capability 8.9 or newer: Ada, Hopper, Blackwell), :func:`use_native_fp8`
can route those layers through ``torch._scaled_mm`` instead: the activation rows are quantized to
e4m3fn with one scale per row (amax / 448, so a row's result does not depend on the other rows),
the stored weight bytes are used as they are (no dequantized copy) with their per-tensor scale,
and the product comes out in the activation's dtype. That adds the activations' FP8 rounding to
the weights': the outputs are close to the dequantizing path, not equal, and the GEMM's shape
follows the rows a rank holds, so the path is never taken under the fixed-shape (deterministic)
kernel policy. Nothing is claimed for it until it has run on such a device: :func:`native_supported`
is False elsewhere, and ``force=True`` (tests) runs the same code on torch's CPU kernel.
"""

from __future__ import annotations

import torch
from torch import nn
from .quantized import quantized_weights
from ..fixed_shape import current

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
ALIGN = 16  # _scaled_mm's inner and output dimensions must be multiples of this on CUDA


def native_supported(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies FP8 natively (CUDA capability >= 8.9 and ``torch._scaled_mm``)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_linear(x: torch.Tensor, raw: torch.Tensor, shape, scale: float, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` stored as e4m3fn bytes ``raw`` of ``shape`` (N, K) times ``scale``;
    ``x`` quantized per row to e4m3fn for the product, which comes out in ``x``'s dtype."""
    n, k = int(shape[0]), int(shape[1])
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = -m % ALIGN if x.is_cuda else 0
    if pad:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
    amax = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    row_scale = amax / E4M3_MAX
    xq = (rows.float() / row_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    w = raw.view(torch.float8_e4m3fn).view(n, k)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    w_scale = torch.full((1, n), float(scale), dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(xq, w.t(), scale_a=row_scale, scale_b=w_scale, out_dtype=out_dtype)[:m]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)


def _layers(model: nn.Module):
    """(name, module, parametrization, stored bytes) of every linear layer with an e4m3fn 2-D weight."""
    for name, mod, p, raw in quantized_weights(model):
        if (isinstance(mod, nn.Linear) and name.endswith(".weight") and p.spec.fmt == "fp8_e4m3fn"
                and len(p.spec.shape) == 2):
            yield name, mod, p, raw


def use_native_fp8(model: nn.Module, force: bool = False) -> list[str]:
    """Route ``model``'s e4m3fn linear layers through :func:`scaled_linear` where the input's device
    supports it (``force``: on any device, for tests); returns the layers' names. Inputs under the
    fixed-shape kernel policy, or of a shape the kernel does not take, use the layer's own forward."""
    names = []
    for name, mod, p, raw in _layers(model):
        n, k = p.spec.shape
        if n % ALIGN or k % ALIGN:
            continue
        own = type(mod).forward.__get__(mod)

        def forward(x, mod=mod, p=p, own=own):
            ok = force or native_supported(x.device)
            if not ok or current().deterministic or torch.is_grad_enabled():
                return own(x)
            raw = mod.parametrizations.weight.original
            return scaled_linear(x, raw, p.spec.shape, p.spec.scale, mod.bias)

        mod.forward = forward
        names.append(name)
    return names


def native_error(model: nn.Module, x_shape=(64,), seed: int = 0) -> float:
    """Max |native - dequantized| / max |dequantized| over ``model``'s e4m3fn linears for seeded inputs
    (a check to run where the native path exists)."""
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _, mod, p, raw in _layers(model):
        x = torch.randn(*x_shape, p.spec.shape[1], generator=g).to(device=raw.device, dtype=p.probe.dtype)
        ref = torch.nn.functional.linear(x, mod.weight, mod.bias).float()
        out = scaled_linear(x, raw, p.spec.shape, p.spec.scale, mod.bias).float()
        worst = max(worst, float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
    return worst

