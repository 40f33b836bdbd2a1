"""Strict loading of the VAE checkpoint (released ``ema_vae.pth``, a ``.safetensors`` export in
fp32/fp16/bf16 or FP8, or a GGUF file; any format of ``ditsp/weights/formats.py``), streamed.

The reference loads its VAE non-strictly, which would hide a wrong or partial checkpoint; here
every model tensor must be present with its exact shape, no extra tensor may remain, and every
value must be a finite float (fp32, fp16, bf16, converted to the model's dtype; FP8 or GGUF blocks,
kept quantized and dequantized per layer). The one rename
is the legacy attention naming (``query/key/value/proj_attn`` -> ``to_q/to_k/to_v/to_out.0``) that
the reference's loader also applies.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import nn

from ....weights import StoredTensor, assign, materialize, open_any, targets_of
from ....weights.shared import open_group, settle

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_FORMATS = ("fp32", "fp16", "bf16")
LEGACY = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; the message lists every offending key."""


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a file, read (kept for callers that want a plain state_dict)."""
    ckpt = _open(path)
    return {k: e.read() for k, e in ckpt.entries.items()}


def _open(path_or_sd):
    return open_any(path_or_sd, CheckpointError)


def _rename(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        nk = k
        for old, new in LEGACY.items():
            nk = nk.replace(old, new)
        if nk in out:
            raise CheckpointError(f"checkpoint keys collide after the legacy attention rename: {nk!r}")
        out[nk] = v
    return out


def _section(title: str, items: list[str], limit: int = 30) -> str:
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in items[:limit]) + more


def _dtype_name(fmt: str) -> str:
    return "torch." + {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(fmt, fmt)


def check_state_dict(model: nn.Module, sd: Mapping) -> dict[str, StoredTensor]:
    """Raise :class:`CheckpointError` listing missing, unexpected, mis-shaped and non-float tensors
    (``sd``: tensors or :class:`~ditsp.weights.StoredTensor` descriptions); returns the renamed entries."""
    sd = _rename({k: (v if isinstance(v, StoredTensor) else StoredTensor.of(k, v)) for k, v in sd.items()})
    expected = targets_of(model)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes, dtypes = [], []
    for k in sorted(set(sd) & set(expected)):
        v = sd[k]
        if tuple(v.shape) != tuple(expected[k].shape):
            shapes.append(f"{k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)}")
        elif v.fmt not in FLOAT_FORMATS and not v.quantized:
            dtypes.append(f"{k}: {_dtype_name(v.fmt)} (expected float32, float16, bfloat16, FP8 or GGUF)")
    _raise_if([("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes), ("not float", dtypes)])
    return sd


def _raise_if(problems) -> None:
    if any(v for _, v in problems):
        raise CheckpointError("VAE checkpoint does not match the model:\n"
                              + "\n".join(_section(t, v) for t, v in problems if v))


def load_checkpoint(model: nn.Module, path_or_sd, dtype: torch.dtype | None = None,
                    weights_dtype: str | None = None, comm=None, read: str | None = None) -> int:
    """Load strictly into ``model``, one tensor at a time (converted to ``dtype`` or the model's
    dtype; FP8/GGUF weights stay quantized, ``weights_dtype="fp8"`` quantizes float kernels and
    matrices at load); returns the tensor count. A model on the meta device is materialised.
    ``comm``/``read``: ranks loading together, as the DiT's loader (``ditsp/weights/shared.py``)."""
    ckpt = open_group(path_or_sd, comm, read, CheckpointError)
    entries = settle(comm, lambda: check_state_dict(model, ckpt.entries), CheckpointError)
    targets = targets_of(model)
    got = settle(comm, lambda: materialize(entries, targets, dtype, weights_dtype), CheckpointError)
    settle(comm, lambda: _raise_if([("non-finite", [f"{k}: {b[0] + b[1]} non-finite values"
                                                    for k, b in sorted(got.nonfinite.items())])]), CheckpointError)
    compute = dtype or next((t.dtype for t in targets.values() if t.dtype.is_floating_point), torch.float32)
    assign(model, got.kept, compute)
    if dtype is not None:
        model.to(dtype)
    del ckpt
    return len(got.kept)
