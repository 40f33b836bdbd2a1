"""GGUF quantized blocks as weights: the block types and their dequantization, via the ``gguf`` package.

The stored bytes are the file's blocks unchanged (``uint8``, one row of blocks per row of the
tensor's innermost dimension). Dequantization is ``gguf.quants.dequantize`` (NumPy, on the host):
the block formats are the package's, not re-implemented here. On an accelerator the blocks are
copied to the host for it and the weight back, one layer at a time.
"""

from __future__ import annotations

import numpy as np
import torch

# The GGUF types a rank keeps quantized (everything the package dequantizes that SeedVR2 files
# use: Q8_0 files, the k-quant mixes of Q*_K_S/M, and the legacy 4/5-bit types); F32/F16/BF16
# tensors are plain floats and load like any other float tensor.
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def block(name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[qtype(name)]


def stored_bytes(name: str, numel: int) -> int:
    """Bytes ``numel`` values take in GGUF type ``name`` (whole blocks)."""
    n, size = block(name)
    return -(-numel // n) * size


def dequantize(raw: torch.Tensor, fmt: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` on ``raw``'s device, from GGUF blocks ``raw`` (uint8)."""
    import gguf

    host = raw.detach().cpu().numpy()
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(host, qtype(fmt))))
    w = w.reshape(tuple(shape))
    return w.to(device=raw.device, dtype=dtype)
