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
    import gguf  # local: a heavy optional package, loaded only when this runs

    return gguf.GGMLQuantizationType[name]


def block(name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    import gguf  # local: a heavy optional package, loaded only when this runs

    return gguf.GGML_QUANT_SIZES[qtype(name)]


def stored_bytes(name: str, numel: int) -> int:
    """Bytes ``numel`` values take in GGUF type ``name`` (whole blocks)."""
    n, size = block(name)
    return -(-numel // n) * size


# Values dequantized per NumPy call: bounds the package's float32 temporaries (a few per value)
# whatever the weight's size, so one layer's transient is its weight in the compute dtype plus this.
CHUNK_VALUES = 1 << 20


def chunk_bytes() -> int:
    """Host temporaries of one dequantization step (the package's float32 arrays for one chunk)."""
    return CHUNK_VALUES * 4 * 4


def dequantize(raw: torch.Tensor, fmt: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` on ``raw``'s device, from GGUF blocks ``raw`` (uint8),
    dequantized in chunks of rows into one output tensor."""
    import gguf  # local: a heavy optional package, loaded only when this runs

    host = raw.detach().cpu().numpy()
    host = host.reshape(-1, host.shape[-1]) if host.ndim else host.reshape(1, -1)
    per, size = block(fmt)
    row_values = host.shape[1] // size * per
    step = max(1, CHUNK_VALUES // max(row_values, 1))
    out = torch.empty((host.shape[0], row_values), dtype=dtype)
    qt = qtype(fmt)
    for r in range(0, host.shape[0], step):
        out[r:r + step] = torch.from_numpy(gguf.quants.dequantize(host[r:r + step], qt))
    return out.reshape(tuple(shape)).to(device=raw.device)
