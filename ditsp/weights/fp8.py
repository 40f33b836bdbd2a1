"""FP8 weights: the two formats, per-tensor scales, quantizing a float weight at load.

A stored FP8 weight is its bytes (``uint8``) and a per-tensor scale: value = fp8 * scale. Files
without scales (ComfyUI's plain ``*_fp8_e4m3fn`` conversions) have scale 1; a file marked scaled
must carry every scale, each a finite number > 0 (:func:`valid_scale`). Quantizing at load
(``--weights-dtype fp8``) picks the scale that maps the tensor's largest magnitude to the format's
largest finite value, so nothing saturates.
"""

from __future__ import annotations

import torch

# name -> torch dtype; "fp8" (the CLI's short name) means e4m3fn.
FORMATS = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ALIASES = {"fp8": "fp8_e4m3fn"}
# What --weights-dtype accepts: "stored" keeps the file's formats (quantized stays quantized, float
# is cast to --dtype); an FP8 name quantizes every float matrix/conv weight at load.
WEIGHTS_DTYPES = ("stored", "fp8", "fp8_e4m3fn", "fp8_e5m2")


def canonical(name: str | None) -> str | None:
    """The FP8 format a ``--weights-dtype`` value asks for (None for "stored")."""
    if name in (None, "", "stored"):
        return None
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"unknown weights dtype {name!r}; choose from {', '.join(WEIGHTS_DTYPES)}")
    return name


def fmt_of(dtype: torch.dtype) -> str | None:
    """The FP8 format name of a torch dtype, or None."""
    for k, v in FORMATS.items():
        if v == dtype:
            return k
    return None


def eligible(name: str, shape) -> bool:
    """Weights quantized at load: matrices and conv kernels (``*.weight`` of 2+ dims); norms,
    biases, modulation vectors and buffers stay in the compute dtype."""
    return name.rsplit(".", 1)[-1] == "weight" and len(tuple(shape)) >= 2


def quantize(t: torch.Tensor, fmt: str) -> tuple[torch.Tensor, float]:
    """(uint8 bytes of ``t`` in ``fmt``, per-tensor scale) with ``max|t|`` at the format's max."""
    dt = FORMATS[fmt]
    amax = float(t.detach().abs().max()) if t.numel() else 0.0
    scale = amax / torch.finfo(dt).max if amax > 0 else 1.0
    q = (t.detach().float() / scale).to(dt) if scale != 1.0 else t.detach().to(dt)
    return q.contiguous().view(torch.uint8), scale


def valid_scale(scale: float) -> bool:
    """A usable per-tensor scale: a finite number > 0 (0 would zero the weight, a negative one flip it,
    a non-finite one make every value NaN or Inf)."""
    return 0.0 < scale < float("inf")


def dequantize(raw: torch.Tensor, fmt: str, shape, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype`` (FP8 -> bf16/fp16/fp32 is exact; the scale is one multiply in ``dtype``)."""
    w = raw.view(FORMATS[fmt]).view(tuple(shape)).to(dtype)
    if scale != 1.0:
        w.mul_(scale)
    return w


def nonfinite(raw: torch.Tensor, fmt: str, scale: float, chunk: int = 1 << 24) -> tuple[int, int]:
    """(NaN, Inf) counts of the weight stored as ``raw`` bytes, from the bit patterns (no conversion):
    e4m3fn has NaN at exponent and mantissa all ones and no Inf; e5m2 is IEEE-like (exponent all
    ones: Inf with a zero mantissa, else NaN). A non-finite scale makes every value NaN."""
    if scale != scale or scale in (float("inf"), float("-inf")):
        return raw.numel(), 0
    flat = raw.reshape(-1)
    mask = 0x7F if fmt == "fp8_e4m3fn" else 0x7C  # the bits that are all ones in a NaN/Inf
    nan = inf = 0
    for i in range(0, flat.numel(), chunk):
        b = flat[i:i + chunk] & mask
        if int(b.amax()) != mask:  # the common case: one max, no special value in the chunk
            continue
        special = b == mask
        if fmt == "fp8_e4m3fn":
            nan += int(special.sum())
        else:
            zero_m = (flat[i:i + chunk] & 0x03) == 0
            inf += int((special & zero_m).sum())
            nan += int((special & ~zero_m).sum())
    return nan, inf
