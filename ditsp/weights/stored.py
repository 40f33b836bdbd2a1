"""One tensor of a checkpoint file, described before it is read.

A :class:`StoredTensor` knows its logical shape (the model's layout, whatever the file's), its
stored format and size, and how to read its data from the (memory-mapped) file. Loaders check
names and shapes on these descriptions, then read the tensors one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import fp8 as _fp8
from . import ggml as _ggml

FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def fmt_of_dtype(dtype: torch.dtype) -> str:
    """The stored-format name of a torch dtype ("fp16", "fp8_e4m3fn", "int64", ...)."""
    for k, v in FLOATS.items():
        if v == dtype:
            return k
    return _fp8.fmt_of(dtype) or str(dtype).removeprefix("torch.")


@dataclass
class StoredTensor:
    """A tensor of a file: ``read()`` returns a float or FP8 tensor, or ``uint8`` GGUF blocks."""

    source: str  # its name in the file
    shape: tuple[int, ...]  # logical shape
    fmt: str  # a FLOATS key, an FP8 format, a GGUF quantized type, or a non-float dtype name
    nbytes: int
    read: Callable[[], torch.Tensor]
    scale_source: str | None = None  # the file key of its per-tensor scale (FP8), if any
    read_scale: Callable[[], float] | None = None
    owned: bool = False  # read() returns a fresh tensor (no copy needed to keep it), not a view of a file map

    @property
    def is_float(self) -> bool:
        return self.fmt in FLOATS or self.quantized

    @property
    def quantized(self) -> bool:
        return self.fmt in _fp8.FORMATS or self.fmt in _ggml.QUANTIZED

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "StoredTensor":
        """An in-memory tensor as a stored one."""
        return cls(name, tuple(t.shape), fmt_of_dtype(t.dtype), t.numel() * t.element_size(), lambda: t)
