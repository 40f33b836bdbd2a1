"""AllGather-KV: every rank gathers the whole K/V, then attends locally.

The simple alternative to the ring: one all-gather of stacked K/V (bytes
``(P-1)/P`` of the full K/V per rank, like the ring, but in one call and
without overlap) and full-sequence K/V memory on every rank. Backward
reduce-scatters dK/dV back to their owners (one all-to-all).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dist.comm import Comm
from .common import gather_rows
from .ring import ring_attention

_LOCAL = Comm.single()


def allgather_attention(comm: Comm, q, k, v, kv_lens: Sequence[int], scale: float, tk=None, tv=None):
    """Compute layout in and out, like :func:`ditsp.attention.ring.ring_attention`."""
    kv = gather_rows(torch.stack([k, v]), comm, kv_lens, dim=3, kind="allgather_kv")
    return ring_attention(_LOCAL, q, kv[0], kv[1], [kv.shape[3]], scale, tk, tv)
