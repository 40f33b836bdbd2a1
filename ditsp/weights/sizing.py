"""Bytes a rank holds for a model's weights in a given format, before anything is loaded.

Two parts: the weights as kept (quantized weights at their stored size, the rest in the compute
dtype) and the per-layer dequantization buffer (the largest quantized weight in the compute
dtype, plus the GGUF path's bounded host temporaries), since a layer's dequantized weight lives while
the layer runs. From tensor shapes and a format name (``ditsp plan``), or from a checkpoint file's
header (the upscale pre-check: exact stored sizes, nothing read).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from . import fp8 as _fp8
from . import ggml as _ggml
from .gguf_write import q4_k_m, q8_0
from .formats import open_checkpoint

# The formats an estimate can be asked for: float dtypes, FP8, and the GGUF files' mixes.
FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GGUF_MIXES = {"Q8_0": q8_0, "Q4_K_M": q4_k_m}
ESTIMATE_FORMATS = (*FLOAT_BYTES, *_fp8.FORMATS, *GGUF_MIXES)


@dataclass(frozen=True)
class WeightBytes:
    """Kept weight bytes and the per-layer dequantization buffer of one rank."""

    fmt: str
    kept: int
    buffer: int

    @property
    def total(self) -> int:
        return self.kept + self.buffer

    def describe(self) -> str:
        extra = f" + dequant buffer {self.buffer / 2**30:.2f}" if self.buffer else ""
        return f"{self.fmt} {self.kept / 2**30:.2f}{extra}"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def by_format(shapes: Mapping[str, tuple], fmt: str, compute: str = "bf16") -> WeightBytes:
    """Weights of ``shapes`` (name -> shape; parameters and buffers) stored as ``fmt``, computed in ``compute``."""
    fmt = _fp8.ALIASES.get(fmt, fmt)
    if fmt not in ESTIMATE_FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}; choose from {', '.join(ESTIMATE_FORMATS)}")
    e = FLOAT_BYTES[compute]
    kept = buffer = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        if fmt in FLOAT_BYTES:
            kept += n * e  # float files are cast to the compute dtype at load
        elif fmt in _fp8.FORMATS:
            q = _fp8.eligible(name, shape)
            kept += n if q else n * e
            buffer = max(buffer, n * e if q else 0)
        else:
            t = "F32" if ".rope." in name else GGUF_MIXES[fmt](name, shape)
            if t in _ggml.QUANTIZED:
                kept += _ggml.stored_bytes(t, n)
                buffer = max(buffer, n * e + _ggml.chunk_bytes())
            else:
                kept += n * e  # float tensors are cast to the compute dtype at load
    return WeightBytes(fmt, kept, buffer)


def of_checkpoint(path: str | os.PathLike, compute: str = "bf16", weights_dtype: str | None = None) -> WeightBytes:
    """The same from a checkpoint's header: stored sizes of its quantized tensors, the rest cast."""

    ck = open_checkpoint(path)
    fmt8 = _fp8.canonical(weights_dtype)
    e = FLOAT_BYTES[compute]
    kept = buffer = 0
    kinds: dict[str, int] = {}
    for name, s in ck.entries.items():
        n = s.numel
        if s.quantized:
            kept += s.nbytes
            buffer = max(buffer, n * e + (0 if s.fmt in _fp8.FORMATS else _ggml.chunk_bytes()))
            kinds[s.fmt] = kinds.get(s.fmt, 0) + 1
        elif fmt8 and s.is_float and _fp8.eligible(name, s.shape):
            kept += n
            buffer = max(buffer, n * e)
            kinds[fmt8] = kinds.get(fmt8, 0) + 1
        else:
            kept += n * (e if s.is_float else torch.empty(0, dtype=torch.int64).element_size())
    label = "+".join(sorted(kinds)) if kinds else compute
    return WeightBytes(label, kept, buffer)
