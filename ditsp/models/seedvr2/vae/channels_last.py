"""The VAE's activation layout: channels-last 3-D under the fast policy on CPU, else contiguous.

oneDNN's CPU convolutions compute in a channels-innermost layout. Handed a (B, C, T, H, W)
tensor they reorder it in and their result back out on every call; handed a channels-last one
(memory order B, T, H, W, C) they read and write it directly. On one AVX-512 core a 128-channel
3x3x3 conv over 11x130x128 takes 390 ms in bf16 and 747 ms in float32 from the contiguous
layout, 317 and 622 ms from channels-last. Converting around each conv would cost what it saves
(one 128-channel transpose of that activation: 41 ms bf16), so the whole piece runs in the layout:
the executor arranges a piece's input once (:meth:`.execution.Exec.arrange`), every layer indexes
logical dimensions only, and the copies the layers make keep the layout.

The layout changes speed and rounding, never what is computed, so it is for the fast policy,
which promises results within tolerance. The deterministic policy keeps the contiguous layout its
fixed-shape, bit-for-bit calls were established on. CUDA keeps it too: not measured there. The
``vae_channels_last`` field of :class:`~ditsp.cpu.settings.CpuSettings` (``DITSP_VAE_CHANNELS_LAST=0``)
turns it off, as benchmarks and tests do to compare the layouts.
"""

from __future__ import annotations

import torch

from ....cpu import settings
from ....fixed_shape import current


def enabled() -> bool:
    """Whether the ``vae_channels_last`` setting in force allows the layout (default: on)."""
    return settings.current().vae_channels_last


def wanted(x: torch.Tensor) -> bool:
    """Whether the piece ``x`` (B, C, T, H, W) should run channels-last (module doc)."""
    return enabled() and x.device.type == "cpu" and x.dim() == 5 and not current().deterministic


def is_channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is laid out channels-last 3-D (and not also plainly contiguous, as size-1 dims allow)."""
    return x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
