"""Strict NaDiT checkpoint loading, both families: the reference ``.pth``, ``.safetensors`` in
fp32/fp16/bf16 or FP8 (the ComfyUI distributions, mixed FP8/fp16 files and per-tensor scales
included) and GGUF (Q8_0, the k-quants; ``ditsp/weights/formats.py`` reads them), streamed tensor
by tensor; quantized weights stay quantized on the rank (``ditsp/weights/quantized.py``).

The only rename is the RoPE buffer suffix ``.rope.rope.freqs`` ->
``.rope.freqs`` (the reference nests a RotaryEmbedding inside its RoPE
module; the 3B and 7B files both do). Anything else that does not match the
model exactly -- missing, unexpected, mis-shaped keys, two source keys landing
on one target, a non-float tensor (int/bool) for a float parameter, NaN or Inf
values -- fails with the full list, one line per problem, so a wrong checkpoint
never reaches inference. Float tensors of another precision (fp16, bf16, fp64)
are accepted and cast to the model's dtype. RoPE frequency buffers are checked
against their analytic values at the file dtype's precision and then replaced
by the analytic fp32 values: the 7B's frequencies reach 402, and rounded to
bf16 they would move the output by percents. A missing or unreadable file is a
one-line :class:`CheckpointError`. Loading a model with fewer blocks than the
checkpoint is a development fixture that needs ``allow_truncated=True``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from ....weights import StoredTensor, assign, error_line, materialize, targets_of
from ....weights.shared import open_group, settle
from .rope import RopeBuffer
from safetensors.torch import load_file

REF_SUFFIX, PORT_SUFFIX = ".rope.rope.freqs", ".rope.freqs"
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message lists every problem."""


@dataclass
class LoadReport:
    path: str
    loaded: int
    renamed: int
    dropped: list[str] = field(default_factory=list)  # keys skipped by allow_truncated
    formats: dict[str, int] = field(default_factory=dict)  # kept format -> tensors

    def __str__(self) -> str:
        extra = f", {len(self.dropped)} keys of truncated blocks skipped" if self.dropped else ""
        kept = ", ".join(f"{n} {f}" for f, n in sorted(self.formats.items()))
        return (f"{self.path}: {self.loaded} tensors loaded strictly ({self.renamed} RoPE keys renamed){extra}"
                + (f"; kept as {kept}" if kept else ""))


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, or of a ``.pth``/``.pt`` (``weights_only``, memory-mapped)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        if path.endswith(".safetensors"):
            return load_file(path, device="cpu")
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is an unreadable file
        raise CheckpointError(f"{path}: unreadable checkpoint ({error_line(e)})") from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a flat state_dict of tensors, got {type(sd).__name__}")
    return dict(sd)


def normalize_keys(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Rename exactly the suffix ``.rope.rope.freqs`` -> ``.rope.freqs``; collisions raise."""
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    renamed = 0
    for k, v in sd.items():
        nk = k[: -len(REF_SUFFIX)] + PORT_SUFFIX if k.endswith(REF_SUFFIX) else k
        renamed += nk != k
        if nk in out:
            raise CheckpointError(f"checkpoint keys {source[nk]!r} and {k!r} both map to {nk!r}")
        out[nk], source[nk] = v, k
    return out, renamed


def _truncation_drops(keys, num_layers: int, model_keys) -> list[str]:
    """Keys that a model with ``num_layers`` blocks legitimately lacks: later blocks,
    and the text branch of the new last block (vid-only ada/mlp)."""
    last = f"blocks.{num_layers - 1}."
    return [k for k in keys if k not in model_keys and (
        ((m := _BLOCK.match(k)) and int(m.group(1)) >= num_layers)
        or (k.startswith(last) and re.match(rf"^{re.escape(last)}(ada|mlp)\.txt\.", k)))]


def _list(title: str, items: list[str], limit: int = 25) -> str:
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in items[:limit]) + more


def check_state_dict(model: nn.Module, sd: Mapping, allow_truncated: bool = False) -> tuple[dict, list[str]]:
    """(normalised entries to load, dropped keys); raises :class:`CheckpointError` listing every mismatch.

    ``sd`` maps names to tensors or to :class:`~ditsp.weights.StoredTensor` descriptions (a file
    not read yet): names, shapes and dtypes are checked on the descriptions; values (NaN/Inf) as
    each tensor is read (:func:`load_checkpoint`)."""
    sd, _ = normalize_keys(sd)
    sd = {k: (v if isinstance(v, StoredTensor) else StoredTensor.of(k, v)) for k, v in sd.items()}
    expected = targets_of(model)
    n_layers = len(getattr(model, "blocks", []))
    ckpt_blocks = 1 + max((int(m.group(1)) for k in sd if (m := _BLOCK.match(k))), default=-1)
    dropped: list[str] = []
    if ckpt_blocks > n_layers:
        if not allow_truncated:
            raise CheckpointError(
                f"checkpoint has {ckpt_blocks} blocks but the model has {n_layers}; loading fewer blocks "
                f"is a development fixture: pass allow_truncated=True")
        dropped = _truncation_drops(sd, n_layers, expected)
        sd = {k: v for k, v in sd.items() if k not in set(dropped)}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(sd[k].shape)}, model {tuple(expected[k].shape)}"
                    for k in set(sd) & set(expected) if tuple(sd[k].shape) != tuple(expected[k].shape))
    dtypes = [f"{k}: checkpoint {sd[k].fmt}, model {str(expected[k].dtype).removeprefix('torch.')} "
              f"(a float tensor is required)" for k in sorted(set(sd) & set(expected))
              if expected[k].dtype.is_floating_point and not sd[k].is_float]
    _raise_if(missing=missing, unexpected=unexpected, shapes=shapes, dtypes=dtypes)
    _check_rope(model, sd)
    return dict(sd), dropped


def _raise_if(missing=(), unexpected=(), shapes=(), dtypes=(), nonfinite=()) -> None:
    if missing or unexpected or shapes or dtypes or nonfinite:
        parts = [_list(t, list(v)) for t, v in (("missing", missing), ("unexpected", unexpected),
                                                ("mis-shaped", shapes), ("wrong dtype", dtypes),
                                                ("non-finite", nonfinite)) if v]
        raise CheckpointError("checkpoint does not match the model:\n" + "\n".join(parts))


def _rope_modules(model: nn.Module):
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, RopeBuffer)]


def _check_rope(model: nn.Module, sd: Mapping[str, StoredTensor]) -> None:
    """A RoPE buffer must hold the analytic frequencies (to its stored dtype's precision)."""
    for name, mod in _rope_modules(model):
        if f"{name}.freqs" in sd:
            got = sd[f"{name}.freqs"].read()
            if got.is_meta:
                continue
            want = mod.analytic_freqs()
            tol = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
            if not torch.allclose(got.float().cpu(), want, rtol=tol, atol=0.0):
                raise CheckpointError(f"{name}.freqs holds {got.flatten()[:3].tolist()}..., not the model's "
                                      f"RoPE frequencies {want[:3].tolist()}... ({mod.describe()})")


def load_checkpoint(model: nn.Module, path_or_sd, allow_truncated: bool = False, dtype: torch.dtype | None = None,
                    weights_dtype: str | None = None, comm=None, read: str | None = None) -> LoadReport:
    """Strictly load a checkpoint file (any format of :data:`ditsp.weights.FORMATS`) or an in-memory
    state_dict into ``model``, one tensor at a time.

    Float tensors are cast to ``dtype`` (default: the model's dtypes); FP8 and GGUF-quantized
    weights stay in their stored form, dequantized per layer in the compute dtype;
    ``weights_dtype="fp8"`` quantizes float weight matrices at load. A model built on the meta
    device is materialised tensor by tensor. RoPE buffers keep their analytic values.

    ``comm``: the ranks loading together (``ditsp/weights/shared.py``): ``read`` "one-reader" has
    one rank read the file and send the others each tensor as stored; "every-rank" reads it on
    each. Either way a problem raises the same error on every rank.
    """
    is_path = isinstance(path_or_sd, (str, os.PathLike))
    ckpt = open_group(path_or_sd, comm, read, CheckpointError)
    raw_names = ckpt.entries
    entries, dropped = settle(comm, lambda: check_state_dict(model, raw_names, allow_truncated), CheckpointError)
    targets = targets_of(model)
    rope = {f"{name}.freqs" for name, _ in _rope_modules(model)}
    got = settle(comm, lambda: materialize(entries, targets, dtype, weights_dtype), CheckpointError)
    settle(comm, lambda: _raise_if(nonfinite=[f"{k}: {n_nan} NaN, {n_inf} Inf of {n} values"
                                              for k, (n_nan, n_inf, n) in sorted(got.nonfinite.items())]),
           CheckpointError)
    for name, mod in _rope_modules(model):  # full-precision analytic RoPE, whatever the file stored
        key = f"{name}.freqs"
        if key in got.kept:
            got.kept[key].tensor = mod.analytic_freqs().to(got.kept[key].tensor.device)
    compute = dtype or next((t.dtype for k, t in targets.items() if k not in rope and t.dtype.is_floating_point),
                            torch.float32)
    assign(model, got.kept, compute)
    del ckpt
    return LoadReport(str(path_or_sd) if is_path else "<state_dict>", len(got.kept), normalize_keys(raw_names)[1],
                      dropped, got.formats())


def load_text_embedding(path: str | os.PathLike, txt_in_dim: int | None = None) -> torch.Tensor:
    """A ``pos_emb.pt``-style text embedding: one (L, txt_in_dim) tensor (bf16 in the release)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        tensors = read_state_dict(path)
        if len(tensors) != 1:
            raise CheckpointError(f"{path}: expected one tensor, found {sorted(tensors)}")
        emb = next(iter(tensors.values()))
    else:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such text embedding file")
        try:
            emb = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: unreadable text embedding ({error_line(e)})") from None
    if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or (txt_in_dim and emb.shape[1] != txt_in_dim):
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise CheckpointError(f"{path}: expected a (L, {txt_in_dim or 'C'}) text embedding, got {shape}")
    return emb
