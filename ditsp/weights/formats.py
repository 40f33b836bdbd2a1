"""Checkpoint file formats, one list: each opens a file as named :class:`StoredTensor` descriptions.

- ``safetensors``: float tensors (fp32/fp16/bf16), FP8 (``float8_e4m3fn``/``float8_e5m2``, mixed
  files where some blocks are fp16 included); a per-tensor FP8 scale is a scalar key next to the
  weight (``<module>.scale_weight`` as ComfyUI's scaled-FP8 files name it, or
  ``<module>.weight_scale``), and the ``scaled_fp8`` marker key those files carry is accepted (a
  file with the marker must then carry a scale for every FP8 tensor).
  Memory-mapped; a tensor is read when asked for.
- ``gguf``: through the ``gguf`` package's reader (memory-mapped). Names lose a leading
  ``model.diffusion_model.`` when the file uses it (every tensor must then carry it); the shape is
  the file's dims reversed (GGUF lists the innermost first), or the ``comfy.gguf.orig_shape.<name>``
  metadata where a converter stored a tensor reshaped (5-D convolution kernels: GGUF has 4 dims).
- ``torch``: a ``.pth``/``.pt`` state_dict (``weights_only``, memory-mapped), optionally nested
  under ``"state_dict"``.

A missing or unreadable file, and every problem found while describing it, is a one-line
:class:`FormatError`; name/shape strictness is the model loader's job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch

from . import fp8 as _fp8
from . import ggml as _ggml
from .stored import StoredTensor, fmt_of_dtype
from safetensors import safe_open

SCALE_SUFFIXES = (".scale_weight", ".weight_scale")  # FP8 per-tensor scale keys, -> "<module>.weight"
MARKERS = ("scaled_fp8",)  # keys that describe a file, not a tensor of the model
GGUF_PREFIXES = ("model.diffusion_model.",)
GGUF_ORIG_SHAPE = "comfy.gguf.orig_shape."


class FormatError(ValueError):
    """A file that cannot be read as a checkpoint (one line)."""


@dataclass
class Checkpoint:
    """The tensors of one file, described (nothing read yet), plus where they came from."""

    path: str
    format: str
    entries: dict[str, StoredTensor]
    markers: list[str] = field(default_factory=list)
    _close: Callable[[], None] | None = None

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def stored_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def formats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries.values():
            out[e.fmt] = out.get(e.fmt, 0) + 1
        return out


def error_line(e: Exception) -> str:
    """The first line of an exception message, minus torch's ``weights_only`` advice (never advise unsafe loading)."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    if "weights_only" in line or "Weights only load failed" in line:
        return "not a plain tensor state_dict"
    return line[:200]


def _pair_scales(entries: dict[str, StoredTensor], path: str) -> tuple[dict[str, StoredTensor], list[str]]:
    """Attach each FP8 scale key to its weight; drop marker keys. A scale without an FP8 weight stays
    (the strict check then lists it as unexpected). A file marked ``scaled_fp8`` must have a scale
    for every FP8 tensor: one without would load at scale 1, a silently wrong weight."""
    markers = [k for k in entries if k in MARKERS]
    out = {k: v for k, v in entries.items() if k not in MARKERS}
    for k in list(out):
        suffix = next((s for s in SCALE_SUFFIXES if k.endswith(s)), None)
        if suffix is None:
            continue
        w = k[: -len(suffix)] + ".weight"
        target, scale = out.get(w), out[k]
        if target is None or target.fmt not in ("fp8_e4m3fn", "fp8_e5m2") or scale.numel != 1:
            continue
        target.scale_source = k
        target.read_scale = (lambda s=scale: float(s.read().float().reshape(-1)[0]))
        del out[k]
    if "scaled_fp8" in markers:
        unscaled = sorted(k for k, v in out.items() if v.fmt in _fp8.FORMATS and v.read_scale is None)
        if unscaled:
            raise FormatError(f"{path}: marked scaled_fp8 but {len(unscaled)} FP8 tensor(s) have no scale "
                              f"(<module>.scale_weight): {_names(unscaled)}")
    return out, markers


def _names(keys: list[str], limit: int = 8) -> str:
    """The first ``limit`` names, then how many more."""
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _read_safetensors(path: str, key: str) -> torch.Tensor:
    """One tensor, copied out of a map opened for it alone: the file's pages leave this process's
    memory with the map, so a load holds the weights once, not once more as mapped file pages."""
    with safe_open(path, framework="pt", device="cpu") as f:
        return f.get_tensor(key).clone()


def open_safetensors(path: str) -> Checkpoint:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            entries = {}
            for k in list(f.keys()):
                sl = f.get_slice(k)
                dtype = _SAFE_DTYPES.get(sl.get_dtype())
                shape = tuple(int(s) for s in sl.get_shape())
                if dtype is None:
                    raise FormatError(f"{path}: tensor {k!r} has dtype {sl.get_dtype()}, which torch cannot hold")
                numel = int(np.prod(shape)) if shape else 1
                entries[k] = StoredTensor(k, shape, fmt_of_dtype(dtype), numel * dtype.itemsize,
                                          (lambda k=k: _read_safetensors(path, k)), owned=True)
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is an unreadable file
        raise FormatError(f"{path}: unreadable checkpoint ({error_line(e)})") from None
    entries, markers = _pair_scales(entries, path)
    return Checkpoint(path, "safetensors", entries, markers)


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def open_torch(path: str) -> Checkpoint:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001
        raise FormatError(f"{path}: unreadable checkpoint ({error_line(e)})") from None
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise FormatError(f"{path}: expected a flat state_dict of tensors, got {type(sd).__name__}")
    entries, markers = _pair_scales({k: StoredTensor.of(k, v) for k, v in sd.items()}, path)
    return Checkpoint(path, "torch", entries, markers)


def _gguf_shape(reader, t) -> tuple[int, ...]:
    f = reader.get_field(GGUF_ORIG_SHAPE + t.name)
    if f is not None:
        return tuple(int(v) for v in f.contents())
    return tuple(int(v) for v in reversed(t.shape.tolist()))


def open_gguf(path: str) -> Checkpoint:
    try:
        import gguf  # local: a heavy optional package, loaded only when this runs
    except ImportError:  # pragma: no cover - a declared dependency
        raise FormatError(f"{path}: reading GGUF needs the gguf package (pip install gguf)") from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001
        raise FormatError(f"{path}: unreadable checkpoint ({error_line(e)})") from None
    names = [t.name for t in reader.tensors]
    prefix = next((p for p in GGUF_PREFIXES if any(n.startswith(p) for n in names)), "")
    bare = [n for n in names if not n.startswith(prefix)]
    if prefix and bare:
        raise FormatError(f"{path}: {len(names) - len(bare)} tensors are named {prefix}* but {len(bare)} are not "
                          f"({', '.join(bare[:5])}{', ...' if len(bare) > 5 else ''})")
    entries = {}
    for t in reader.tensors:
        name, kind = t.name[len(prefix):], t.tensor_type.name
        shape = _gguf_shape(reader, t)
        numel = int(np.prod(shape)) if shape else 1
        if numel != int(t.n_elements):
            raise FormatError(f"{path}: tensor {t.name!r} has {int(t.n_elements)} values but its shape {shape} "
                              f"has {numel}")
        if kind in _ggml.FLOAT:
            fmt = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}[kind]
        elif kind in _ggml.QUANTIZED:
            fmt = kind
        else:
            fmt = kind.lower()
        read = (lambda t=t, shape=shape, kind=kind: _gguf_read(path, t, shape, kind))
        entries[name] = StoredTensor(t.name, shape, fmt, int(t.n_bytes), read, owned=True)
    return Checkpoint(path, "gguf", entries, [prefix] if prefix else [])


def _gguf_read(path: str, t, shape, kind: str) -> torch.Tensor:
    """One tensor's data, copied through a map of its own bytes (at the offset the reader gives):
    the pages leave this process with the map. Quantized: the uint8 blocks in the reader's layout."""
    view = np.memmap(path, dtype=np.uint8, mode="r", offset=int(t.data_offset), shape=(int(t.n_bytes),))
    data = np.array(view)
    del view
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
    if kind in _ggml.FLOAT:
        return torch.from_numpy(data.view({"F32": np.float32, "F16": np.float16}[kind])).reshape(shape)
    if kind in _ggml.QUANTIZED:
        return torch.from_numpy(data.reshape(t.data.shape))
    return torch.from_numpy(data.view(t.data.dtype).reshape(t.data.shape))


# The one list of formats: (name, file suffixes, opener). The first whose suffix matches opens it.
FORMATS = (
    ("safetensors", (".safetensors",), open_safetensors),
    ("gguf", (".gguf",), open_gguf),
    ("torch", (".pth", ".pt", ".bin", ".ckpt"), open_torch),
)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Describe the tensors of ``path`` (any format of :data:`FORMATS`, chosen by suffix; ``.pth``
    otherwise)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FormatError(f"{path}: no such checkpoint file")
    if not os.access(path, os.R_OK):  # the readers word EACCES as "No such file or directory"
        raise FormatError(f"{path}: not readable (permission denied)")
    for _, suffixes, opener in FORMATS:
        if path.endswith(suffixes):
            return opener(path)
    return open_torch(path)


def from_tensors(sd: Mapping[str, torch.Tensor], name: str = "<state_dict>") -> Checkpoint:
    """An in-memory state_dict as a checkpoint (FP8 scale keys paired as in a file)."""
    entries, markers = _pair_scales({k: StoredTensor.of(k, v) for k, v in sd.items()}, name)
    return Checkpoint(name, "memory", entries, markers)



def open_any(path_or_sd, error: type[Exception] = FormatError) -> Checkpoint:
    """A file or an in-memory state_dict as a described checkpoint; a file problem raises ``error`` in one line."""
    try:
        if isinstance(path_or_sd, (str, os.PathLike)):
            return open_checkpoint(path_or_sd)
        return from_tensors(path_or_sd)
    except FormatError as e:
        raise error(str(e)) from None