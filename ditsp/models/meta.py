"""Building a model's structure on the meta device: shapes and names, no storage, no initialisation.

A meta tensor holds no values, so ``torch.nn.init`` has nothing to fill. Left alone, torch still runs
the fill: ``normal_`` on a meta tensor goes through a Python decomposition whose first call imports
``torch._dynamo`` (1.3 s of CPU per process on this project's CPU machines; a restoration paid it in the
memory check and again on every rank while loading the weights). :func:`meta_device` skips those fills.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


class _SkipMetaInit(TorchFunctionMode):
    """``torch.nn.init`` functions return a meta tensor as it is; every other call runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device():
    """Modules built inside get meta parameters and buffers, and their ``torch.nn.init`` calls are skipped."""
    with torch.device("meta"), _SkipMetaInit():
        yield
