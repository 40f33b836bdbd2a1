"""Streaming materialization: a model's tensors read one at a time from a described checkpoint.

The model's names and shapes are checked by the model's loader on the descriptions first; here
each tensor is read from the (memory-mapped) file, checked for NaN/Inf, converted to what the
rank keeps -- a float tensor in the compute dtype, or stored bytes behind a dequantizing
parametrization (FP8 from the file or quantized at load, GGUF blocks) -- and dropped from the
file's pages before the next one is read. Nothing is put into the model until every tensor
passed, so a failure leaves the model as it was; a model built on the meta device therefore
peaks at about one copy of the weights as kept, plus one tensor in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from . import fp8 as _fp8
from .formats import FormatError
from .quantized import QuantSpec, attach, dequantize
from .stored import StoredTensor
from .quantized import quantized_weights
from torch.nn.utils import parametrize


@dataclass
class Kept:
    """What the rank keeps for one model tensor: a plain tensor, or bytes plus a :class:`QuantSpec`."""

    tensor: torch.Tensor
    spec: QuantSpec | None = None


@dataclass
class Materialized:
    kept: dict[str, Kept]
    nonfinite: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # key -> (NaN, Inf, numel)

    def formats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kept.values():
            name = k.spec.fmt if k.spec else str(k.tensor.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + 1
        return out


def _count_nonfinite(w: torch.Tensor) -> tuple[int, int] | None:
    """(NaN, Inf) counts of ``w``, or None when all are finite. The common case is one ``aminmax``
    (min and max propagate NaN and reach any Inf; ``isfinite`` is ~40x slower on bf16)."""
    if w.numel() == 0:
        return None
    lo, hi = torch.aminmax(w.reshape(-1))
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return None
    return int(torch.isnan(w).sum()), int(torch.isinf(w).sum())


CHECK_ROWS_VALUES = 1 << 22  # values per NaN/Inf check of stored bytes (bounds the check's fp32 copy)


def _nonfinite_stored(raw: torch.Tensor, spec: QuantSpec) -> tuple[int, int] | None:
    """NaN/Inf of the weight ``raw`` stands for, dequantized a slice of rows at a time."""
    if spec.fmt in _fp8.FORMATS:
        bad = _fp8.nonfinite(raw, spec.fmt, spec.scale)
        return bad if any(bad) else None
    rows = raw.reshape(-1, raw.shape[-1]) if raw.dim() else raw.reshape(1, -1)
    per_row = max(1, spec.numel // rows.shape[0])
    step = max(1, CHECK_ROWS_VALUES // per_row)
    total = [0, 0]
    for r in range(0, rows.shape[0], step):
        part = rows[r:r + step]
        bad = _count_nonfinite(dequantize(part, QuantSpec(spec.fmt, (part.shape[0] * per_row,)), torch.float32))
        if bad:
            total[0] += bad[0]
            total[1] += bad[1]
    return tuple(total) if any(total) else None


def fp8_scales(entries: Mapping[str, StoredTensor]) -> dict[str, float]:
    """Every FP8 weight's per-tensor scale (scalars: read before any weight), each a finite number > 0;
    otherwise one-line :class:`FormatError` naming the scale keys and their values."""
    scales = {k: float(e.read_scale()) for k, e in entries.items() if e.fmt in _fp8.FORMATS and e.read_scale}
    bad = sorted(f"{entries[k].scale_source or k} = {v!r}" for k, v in scales.items() if not _fp8.valid_scale(v))
    if bad:
        raise FormatError(f"FP8 scales must be finite numbers > 0; {len(bad)} are not: {', '.join(bad[:8])}"
                          + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
    return scales


def materialize(entries: Mapping[str, StoredTensor], targets: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                weights_dtype: str | None = None, keep: Callable[[str], bool] | None = None,
                device: torch.device | str = "cpu") -> Materialized:
    """Read and convert every entry (keys already the model's names, checked against ``targets``).

    ``dtype``: the compute dtype for float parameters (None: each target's own dtype); buffers
    keep their target's dtype. ``weights_dtype``: an FP8 format to quantize eligible float weights
    into (:func:`fp8.eligible`); ``keep(name)`` True keeps a weight in float anyway.
    """
    fmt8 = _fp8.canonical(weights_dtype)
    params = {k for k, t in targets.items() if isinstance(t, nn.Parameter)}
    scales = fp8_scales(entries)
    out = Materialized({})
    for k, e in entries.items():
        ref = targets[k]
        want = dtype if (dtype is not None and k in params and ref.dtype.is_floating_point) else ref.dtype
        if e.quantized:
            raw = e.read()
            scale = scales.get(k, 1.0)
            spec = QuantSpec(e.fmt, tuple(e.shape), scale)
            raw = raw.contiguous().view(torch.uint8)
            bad = _nonfinite_stored(raw, spec)  # NaN/Inf of the weight as the model sees it
            if k in params:
                kept = Kept(raw.to(device=device, copy=not e.owned), spec)
            else:  # a quantized buffer: kept as a plain tensor
                kept = Kept(dequantize(raw, spec, want).to(device))
            del raw
        else:
            t = e.read()
            bad = _count_nonfinite(t) if t.dtype.is_floating_point else None
            if (fmt8 and k in params and t.dtype.is_floating_point and _fp8.eligible(k, e.shape)
                    and not (keep and keep(k))):
                raw, scale = _fp8.quantize(t, fmt8)
                kept = Kept(raw.to(device), QuantSpec(fmt8, tuple(e.shape), scale))
            elif t.dtype.is_floating_point:
                kept = Kept(t.to(device=device, dtype=want, copy=not e.owned))
            else:
                kept = Kept(t.to(device=device, copy=not e.owned))
            del t
        if bad is not None:
            out.nonfinite[k] = (bad[0], bad[1], e.numel)
        out.kept[k] = kept
    return out


def assign(model: nn.Module, kept: Mapping[str, Kept], compute_dtype: torch.dtype | None = None) -> None:
    """Put every kept tensor into ``model`` under its name (parameters stay parameters)."""
    for k, v in kept.items():
        mod_name, _, leaf = k.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if v.spec is not None:
            attach(mod, leaf, v.tensor, v.spec, compute_dtype or torch.float32)
            continue
        if leaf in mod._parameters:
            old = mod._parameters[leaf]
            mod._parameters[leaf] = nn.Parameter(v.tensor, requires_grad=bool(old is not None and old.requires_grad
                                                                                and v.tensor.is_floating_point()))
        elif leaf in mod._buffers:
            mod._buffers[leaf] = v.tensor
        else:
            if parametrize.is_parametrized(mod, leaf):  # a float tensor where a quantized one was
                parametrize.remove_parametrizations(mod, leaf, leave_parametrized=False)
                mod._parameters[leaf] = nn.Parameter(v.tensor, requires_grad=False)
            else:
                raise KeyError(k)


def targets_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by its plain name (a quantized weight under the name
    of the weight it stands for, as a meta tensor of its logical shape)."""

    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, mod, p, _ in quantized_weights(model):
        mod_name = name.rpartition(".")[0]
        leaf = name.rpartition(".")[2]
        prefix = f"{mod_name}.parametrizations.{leaf}." if mod_name else f"parametrizations.{leaf}."
        for k in [k for k in out if k.startswith(prefix)]:
            del out[k]
        out[name] = nn.Parameter(torch.empty(p.spec.shape, dtype=p.probe.dtype, device="meta"), requires_grad=False)
    return out


def quantize_(model: nn.Module, weights_dtype: str | None, dtype: torch.dtype | None = None) -> nn.Module:
    """Quantize ``model``'s eligible float weights in place (``--weights-dtype`` on seeded weights)."""
    if _fp8.canonical(weights_dtype) is None:
        return model
    targets = targets_of(model)
    entries = {k: StoredTensor.of(k, t) for k, t in targets.items() if isinstance(t, nn.Parameter)
               and not t.is_meta and _fp8.eligible(k, t.shape) and t.dtype.is_floating_point}
    got = materialize(entries, targets, dtype, weights_dtype)
    assign(model, {k: v for k, v in got.kept.items() if v.spec is not None}, dtype or torch.float32)
    return model
