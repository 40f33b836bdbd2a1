"""Writing GGUF checkpoints (test fixtures, benchmark files, ``ditsp`` conversions) with the ``gguf`` package.

The writer, the file layout and the Q8_0/Q4_0/Q5_0/... encoders are the package's. The package
does not encode k-quants, so :func:`encode` has small Q4_K and Q6_K encoders of its own (a plain
min/max fit per sub-block: valid blocks that ``gguf`` decodes, not llama.cpp's error-optimised
search). Names get the ``model.diffusion_model.`` prefix the distributed DiT files use; tensors of
more than 4 dims (the VAE's 5-D convolution kernels) are stored as 2-D rows with their shape in
``comfy.gguf.orig_shape.<name>``, as ComfyUI's converter does.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np
import torch

from .formats import GGUF_ORIG_SHAPE
from .ggml import block, qtype
from .ggml import block

QK_K = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _encode_q4_k(rows: np.ndarray) -> np.ndarray:
    """(n, 256*k) float32 -> Q4_K blocks: x ~= d*sc_j*q - dmin*m_j, q in 0..15, sc/m 6-bit."""
    b = rows.reshape(-1, 8, 32).astype(np.float32)
    n = b.shape[0]
    lo = np.minimum(b.min(-1), 0.0)
    hi = b.max(-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = _fp16(scale.max(-1) / 63.0)
    dmin = _fp16(mins.max(-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(scale / df), 0, 63), 0).astype(np.uint8)
        mn = np.where(dminf > 0, np.clip(np.round(mins / dminf), 0, 63), 0).astype(np.uint8)
        step = (df * sc)[..., None]
        off = (dminf * mn)[..., None]
        q = np.where(step > 0, np.clip(np.round((b + off) / step), 0, 15), 0).astype(np.uint8)
    packed = np.empty((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed, qs], axis=1)


def _encode_q6_k(rows: np.ndarray) -> np.ndarray:
    """(n, 256*k) float32 -> Q6_K blocks: x ~= d*s_j*(q - 32), q in 0..63, s_j int8, 16 sub-blocks."""
    b = rows.reshape(-1, 16, 16).astype(np.float32)
    n = b.shape[0]
    s = np.abs(b).max(-1) / 31.0
    d = _fp16(s.max(-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(s / df), 0, 127), 0).astype(np.int8)
        step = (df * sc.astype(np.float32))[..., None]
        q = np.where(step > 0, np.clip(np.round(b / step), -32, 31), 0).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 256)
    lo, hi = q & 0x0F, q >> 4
    lo = lo.reshape(n, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hi = hi.reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)


_OWN = {"Q4_K": _encode_q4_k, "Q6_K": _encode_q6_k}


def encode(a: np.ndarray, fmt: str) -> np.ndarray:
    """Rows ``a`` (..., n) float32 as GGUF type ``fmt`` blocks (uint8 (..., bytes))."""
    import gguf  # local: a heavy optional package, loaded only when this runs


    per, size = block(fmt)
    if a.shape[-1] % per:
        raise ValueError(f"{fmt} needs rows of a multiple of {per} values, got {a.shape[-1]}")
    if fmt in _OWN:
        rows = a.reshape(-1, a.shape[-1])
        out = _OWN[fmt](rows)
        return out.reshape(a.shape[:-1] + (a.shape[-1] // per * size,))
    return gguf.quants.quantize(a.astype(np.float32), qtype(fmt))


class Lazy:
    """A tensor made only when it is written (benchmark files larger than memory): ``shape`` and ``make()``."""

    def __init__(self, shape, make):
        self.shape, self.make = tuple(shape), make


def _layout(name: str, shape: tuple, fmt: str, prefix: str):
    """(stored numpy shape, orig_shape metadata or None) of one tensor."""
    per = block(fmt)[0] if fmt not in ("F32", "F16", "BF16") else 1
    numel = int(np.prod(shape)) if shape else 1
    if len(shape) > 4 or (shape and shape[-1] % per):
        # GGUF holds 4 dims and whole blocks per row: store the values as rows that fit, and the
        # model's shape in the metadata (ComfyUI's convention).
        rows = (shape[0], numel // shape[0]) if shape[-1] % per == 0 and (numel // shape[0]) % per == 0 \
            else (numel // per, per)
        return rows, list(shape)
    return tuple(shape), None


def write_gguf(path: str | os.PathLike, tensors: Iterable[tuple[str, "torch.Tensor | Lazy", str]],
               prefix: str = "model.diffusion_model.", arch: str = "seedvr2") -> str:
    """Write ``(name, tensor, fmt)`` triples (fmt "F32"/"F16"/"BF16" or a quantized type) atomically,
    one tensor in memory at a time (a :class:`Lazy` tensor is made when it is written)."""
    import gguf  # local: a heavy optional package, loaded only when this runs


    items = list(tensors)
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    layouts = []
    for name, t, fmt in items:
        rows, orig = _layout(name, tuple(t.shape), fmt, prefix)
        if orig is not None:
            w.add_array(GGUF_ORIG_SHAPE + prefix + name, orig)
        numel = int(np.prod(rows)) if rows else 1
        if fmt == "F32":
            w.add_tensor_info(prefix + name, rows, np.dtype(np.float32), numel * 4)
        elif fmt == "F16":
            w.add_tensor_info(prefix + name, rows, np.dtype(np.float16), numel * 2)
        else:
            per, size = (1, 2) if fmt == "BF16" else block(fmt)
            w.add_tensor_info(prefix + name, rows, np.dtype(np.float32), numel // per * size, raw_dtype=qtype(fmt))
        layouts.append(rows)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for (name, t, fmt), rows in zip(items, layouts):
            t = t.make() if isinstance(t, Lazy) else t
            if fmt == "BF16":
                a = t.detach().cpu().to(torch.bfloat16).reshape(rows).view(torch.int16).numpy().view(np.uint8)
            else:
                a = t.detach().float().cpu().numpy().reshape(rows)
                a = a.astype(np.float32) if fmt == "F32" else a.astype(np.float16) if fmt == "F16" else encode(a, fmt)
            w.write_tensor_data(np.ascontiguousarray(a))
            del a, t
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def q4_k_m(name: str, shape) -> str:
    """A Q4_K_M-like type choice for fixtures and estimates: Q4_K for matrices and kernels, Q6_K for
    the output projections (``*.proj_out.*``, ``vid_out.*``) that such mixes keep finer, Q8_0 where
    the values do not fill 256-value blocks, F16 where they do not fill 32, F32 for vectors."""
    shape = tuple(shape)
    if len(shape) < 2:
        return "F32"
    n = int(np.prod(shape))
    if n % QK_K == 0:
        return "Q6_K" if (".proj_out." in name or name.startswith("vid_out.")) else "Q4_K"
    return "Q8_0" if n % 32 == 0 else "F16"


def q8_0(name: str, shape) -> str:
    """The Q8_0 file's choice: Q8_0 for matrices and kernels that fill 32-value blocks, F16 for other
    matrices, F32 for vectors."""
    shape = tuple(shape)
    if len(shape) < 2:
        return "F32"
    return "Q8_0" if int(np.prod(shape)) % 32 == 0 else "F16"
