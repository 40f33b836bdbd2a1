"""AllGather-KV: every rank gathers the whole K/V, then attends locally.

The simple alternative to the ring: one all-gather of stacked K/V (bytes
``(P-1)/P`` of the full K/V per rank, like the ring, but in one call and
without overlap) and full-sequence K/V memory on every rank. Backward
reduce-scatters dK/dV back to their owners (one all-to-all).

The local attention is ONE fused call of the agreed backend over
``[text; gathered video]`` keys (the text K/V joined by a copy only when
there is text), so no LSE merge is needed. Causal: the rank's queries are
its own block of the sequence, so they see the earlier ranks' keys in full
and their own block causally (two calls merged by LSE); later keys are not
used.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..distributed.comm import Comm
from .common import gather_rows, merge
from .kernels import block_bwd, block_fwd, local_attention


def joined(t, x):
    """Text K (or V) in front of the video K (or V) along the sequence; ``x`` itself without text."""
    return x if t is None or not t.shape[2] else torch.cat([t, x], 2)


class PrefixCausal(torch.autograd.Function):
    """Queries at positions ``[p, p + s)`` on keys ``[0, p + s)``: keys before ``p`` in full, the
    queries' own block causally; the two blocks merge by LSE, and the backward runs each block's
    fused backward with the final output and LSE."""

    @staticmethod
    def forward(ctx, backend, scale, p, q, k, v):
        out = lse = None
        for lo, hi, diag in ((0, p, False), (p, k.shape[2], True)):
            if hi > lo:
                out, lse = merge(out, lse, *block_fwd(backend, q, k[:, :, lo:hi], v[:, :, lo:hi], scale, diag))
        if out is None:
            out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float32)
            lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (backend, scale, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, scale, p = ctx.args
        f32 = dict(dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.zeros(q.shape, **f32), torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32)
        for lo, hi, diag in ((0, p, False), (p, k.shape[2], True)):
            if hi > lo:
                g = block_bwd(backend, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, dout, scale, causal=diag)
                dq += g[0]
                dk[:, :, lo:hi], dv[:, :, lo:hi] = g[1], g[2]
        return None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def allgather_attention(comm: Comm, q, k, v, kv_lens: Sequence[int], scale: float, tk=None, tv=None,
                        backend: str = "reference", causal: bool = False):
    """Compute layout in and out, like :func:`ditsp.attention.ring.ring_attention`."""
    kv = gather_rows(torch.stack([k, v]), comm, kv_lens, dim=3, kind="allgather_kv")
    if causal:
        p = sum(int(n) for n in kv_lens[: comm.rank])
        end = p + int(kv_lens[comm.rank])
        return PrefixCausal.apply(backend, scale, p, q, kv[0][:, :, :end], kv[1][:, :, :end])
    return local_attention(backend, q, joined(tk, kv[0]), joined(tv, kv[1]), scale)
