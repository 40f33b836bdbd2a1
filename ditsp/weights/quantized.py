"""Weights kept quantized on the rank and dequantized per layer, for the duration of one use.

A quantized weight lives as its stored bytes (a ``uint8`` parameter: FP8 values or GGUF blocks)
behind a parametrization (:func:`torch.nn.utils.parametrize.register_parametrization`) named like
the weight it replaces. Every read of ``module.weight`` -- ``F.linear(x, self.weight, ...)`` in a
layer's forward, ``layer.weight.to(dtype)`` in a parent's forward, ``weight.sum(2)`` in a VAE
executor -- returns a freshly dequantized tensor in the compute dtype, which is freed as soon as
the caller drops it. So a rank holds the weights in their stored size plus, at any time, about
one layer's dequantized weight, and no model code needs to know (the layers keep reading
``self.weight``).

Why the raw bytes are ``uint8``: ``Module.to(dtype)`` casts only floating-point tensors, so the
model can still be moved and cast as a whole without touching the stored values. The compute
dtype follows ``Module.to`` through an empty float buffer (``probe``) of the parametrization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import fp8 as _fp8
from . import ggml


@dataclass(frozen=True)
class QuantSpec:
    """How stored bytes become a weight: the format, the weight's shape, a per-tensor scale."""

    fmt: str  # an FP8 format name (fp8.FORMATS) or a GGUF type name ("Q8_0", "Q4_K", ...)
    shape: tuple[int, ...]
    scale: float = 1.0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


def dequantize(raw: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``spec`` describes, from its stored bytes ``raw``, in ``dtype`` on ``raw``'s device."""
    if spec.fmt in _fp8.FORMATS:
        return _fp8.dequantize(raw, spec.fmt, spec.shape, spec.scale, dtype)

    return ggml.dequantize(raw, spec.fmt, spec.shape, dtype)


def buffer_bytes(spec: QuantSpec, dtype: torch.dtype) -> int:
    """Transient bytes one dequantization of ``spec`` allocates (the weight in ``dtype``, plus the
    GGUF path's bounded host temporaries)."""
    out = spec.numel * torch.empty(0, dtype=dtype).element_size()
    if spec.fmt in _fp8.FORMATS:
        return out

    return out + ggml.chunk_bytes()


class Dequantize(nn.Module):
    """The parametrization: stored bytes -> the weight in the compute dtype (see module doc)."""

    def __init__(self, spec: QuantSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.register_buffer("probe", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return dequantize(raw, self.spec, self.probe.dtype)

    def extra_repr(self) -> str:
        return f"{self.spec.fmt}, shape={tuple(self.spec.shape)}, scale={self.spec.scale:g}"


def attach(module: nn.Module, name: str, raw: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> None:
    """Make ``module.<name>`` the dequantized view of ``raw`` (uint8), replacing what was there."""
    if raw.dtype != torch.uint8:
        raise TypeError(f"quantized storage must be uint8 bytes, got {raw.dtype}")
    if parametrize.is_parametrized(module, name):
        parametrize.remove_parametrizations(module, name, leave_parametrized=False)
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    if hasattr(module, name):
        delattr(module, name)
    module.register_parameter(name, nn.Parameter(raw, requires_grad=False))
    parametrize.register_parametrization(module, name, Dequantize(spec, dtype), unsafe=True)


def quantized_weights(model: nn.Module):
    """(qualified name, module, parametrization, stored bytes) of every quantized weight of ``model``."""
    for mod_name, mod in model.named_modules():
        plist = getattr(mod, "parametrizations", None)
        if plist is None:
            continue
        for name, entry in plist.items():
            for p in entry:
                if isinstance(p, Dequantize):
                    yield (f"{mod_name}.{name}" if mod_name else name), mod, p, entry.original


def is_quantized(model: nn.Module) -> bool:
    return any(True for _ in quantized_weights(model))


def held_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds, quantized weights at their stored size."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def max_buffer_bytes(model: nn.Module) -> int:
    """The largest transient one dequantized weight of ``model`` allocates (0 when none is quantized)."""
    return max((buffer_bytes(p.spec, p.probe.dtype) for _, _, p, _ in quantized_weights(model)), default=0)


def formats_held(model: nn.Module) -> dict[str, int]:
    """Stored format -> number of quantized weights (for reports)."""
    out: dict[str, int] = {}
    for _, _, p, _ in quantized_weights(model):
        out[p.spec.fmt] = out.get(p.spec.fmt, 0) + 1
    return out
