"""Strict loading of the VAE checkpoint (released ``ema_vae.pth`` or a ``.safetensors`` export).

The reference loads its VAE non-strictly, which would hide a wrong or partial checkpoint; here
every model tensor must be present with its exact shape, no extra tensor may remain, and every
value must be a finite float (fp32, fp16 or bf16; converted to the model's dtype). The one rename
is the legacy attention naming (``query/key/value/proj_attn`` -> ``to_q/to_k/to_v/to_out.0``) that
the reference's loader also applies.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import nn

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LEGACY = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; the message lists every offending key."""


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a flat state_dict of tensors, got {type(sd).__name__}")
    return dict(sd)


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


def check_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raise :class:`CheckpointError` listing missing, unexpected, mis-shaped, non-float and non-finite tensors."""
    sd = _rename(sd)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes, dtypes, nonfinite = [], [], []
    for k in sorted(set(sd) & set(expected)):
        v = sd[k]
        if tuple(v.shape) != tuple(expected[k].shape):
            shapes.append(f"{k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)}")
        elif v.dtype not in FLOAT_DTYPES:
            dtypes.append(f"{k}: {v.dtype} (expected float32, float16 or bfloat16)")
        elif not bool(torch.isfinite(v).all()):
            nonfinite.append(f"{k}: {int((~torch.isfinite(v)).sum())} non-finite values")
    problems = [("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes), ("not float", dtypes),
                ("non-finite", nonfinite)]
    if any(v for _, v in problems):
        raise CheckpointError("VAE checkpoint does not match the model:\n"
                              + "\n".join(_section(t, v) for t, v in problems if v))
    return sd


def load_checkpoint(model: nn.Module, path_or_sd, dtype: torch.dtype | None = None) -> int:
    """Load strictly into ``model`` (converted to ``dtype`` or the model's dtype); returns the tensor count."""
    sd = read_state_dict(path_or_sd) if isinstance(path_or_sd, (str, os.PathLike)) else dict(path_or_sd)
    sd = check_state_dict(model, sd)
    if dtype is not None:
        model.to(dtype)
    target = model.state_dict()
    model.load_state_dict({k: v.to(target[k].dtype) for k, v in sd.items()}, strict=True)
    return len(sd)
