"""The one table of compute dtypes a user can name (CLI flags, configs, requests, estimates)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = tuple(DTYPES)


def itemsize(name: str) -> int:
    """Bytes per element of the named dtype (memory estimates)."""
    return DTYPES[name].itemsize
