"""AllGather-KV: every rank gathers the whole K/V, then attends locally.

The simple alternative to the ring: one all-gather of stacked K/V (bytes
``(P-1)/P`` of the full K/V per rank, like the ring, but in one call and
without overlap) and full-sequence K/V memory on every rank. Backward
reduce-scatters dK/dV back to their owners (one all-to-all).

The local attention is ONE fused call of the agreed backend over
``[text; gathered video]`` keys (the text K/V joined by a copy only when
there is text), so no LSE merge is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dist.comm import Comm
from .common import gather_rows
from .kernels import local_attention


def joined(t, x):
    """Text K (or V) in front of the video K (or V) along the sequence; ``x`` itself without text."""
    return x if t is None or not t.shape[2] else torch.cat([t, x], 2)


def allgather_attention(comm: Comm, q, k, v, kv_lens: Sequence[int], scale: float, tk=None, tv=None,
                        backend: str = "reference"):
    """Compute layout in and out, like :func:`ditsp.attention.ring.ring_attention`."""
    kv = gather_rows(torch.stack([k, v]), comm, kv_lens, dim=3, kind="allgather_kv")
    return local_attention(backend, q, joined(tk, kv[0]), joined(tv, kv[1]), scale)
