"""Ring attention: K/V blocks travel around the ring, partial outputs merge by LSE.

Each rank keeps its queries and, at step i, attends to the K/V block of rank
``r - i``. The transfer of the next block is posted (``batch_isend_irecv``)
before the current block is computed, so communication overlaps compute
(double buffering: the block being read is never the one being written).
K and V travel stacked in one buffer. Blocks may have uneven lengths (the
ring knows every rank's length).

Backward passes K/V around again together with a dK/dV accumulator that every
rank adds its share to; after a full turn each accumulator is back home. The
accumulator travels in fp32 so bf16 gradients sum without extra rounding.

``extra`` K/V (the replicated joint text) is attended once, locally: it is
not circulated, so it costs no traffic and is counted once.

Every block is one call of the agreed backend (:mod:`ditsp.attention.kernels`):
a fused kernel returning its LSE, or the pure-torch reference. Block outputs
merge by LSE in fp32; the backward calls the fused backward per block with
the final output and LSE.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dist.comm import Comm
from .common import merge
from .kernels import block_bwd, block_fwd


def _post(comm: Comm, send: torch.Tensor | None, recv: torch.Tensor | None, kind: str):
    """Send to the next rank and receive from the previous one; empty tensors are skipped."""
    nxt, prv = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    sends = [(send, nxt)] if send is not None and send.numel() else []
    recvs = [(recv, prv)] if recv is not None and recv.numel() else []
    return comm.batch_isend_irecv(sends, recvs, kind=kind) if sends or recvs else []


def _post_next_kv(comm: Comm, kv: torch.Tensor, kv_lens: Sequence[int], step: int, kind: str):
    """Post the transfer of the block held at ``step + 1`` (none after the last step): (buffer, requests)."""
    n = comm.world_size
    if step + 1 >= n:
        return None, []
    nxt = kv.new_empty(kv.shape[:3] + (kv_lens[(comm.rank - step - 1) % n],) + kv.shape[4:])
    return nxt, _post(comm, kv, nxt, kind)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def ring_fwd(comm: Comm, q, kv, kv_lens: Sequence[int], scale: float, extra=None, backend: str = "reference"):
    """``q`` [B,H,Sq,D]; ``kv`` [2,B,Hkv,s_me,D] stacked K/V. Returns fp32 (out, lse)."""
    n = comm.world_size
    out = lse = None
    if extra is not None and extra.shape[3]:
        out, lse = block_fwd(backend, q, extra[0], extra[1], scale)
    for step in range(n):
        nxt, reqs = _post_next_kv(comm, kv, kv_lens, step, "ring_kv")
        if kv.shape[3]:
            out, lse = merge(out, lse, *block_fwd(backend, q, kv[0], kv[1], scale))
        if nxt is not None:
            _wait(reqs)
            kv = nxt
    if out is None:  # no keys at all
        out = q.new_zeros(q.shape[:3] + (kv.shape[-1],), dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    return out, lse


def ring_bwd(comm: Comm, q, kv, kv_lens, scale, out, lse, dout, extra=None, backend: str = "reference"):
    """Returns fp32 ``dq``, ``dkv`` (this rank's block, summed over all ranks' queries), ``dextra``."""
    n, me = comm.world_size, comm.rank
    delta = (dout.float() * out.float()).sum(-1) if backend == "reference" else None
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dextra = None
    if extra is not None:
        dextra = torch.zeros(extra.shape, dtype=torch.float32)
        if extra.shape[3]:
            g = block_bwd(backend, q, extra[0], extra[1], out, lse, dout, scale, delta)
            dq += g[0]
            dextra[0], dextra[1] = g[1], g[2]
    dkv, dkv_reqs = None, []
    for step in range(n):
        nxt, kv_reqs = _post_next_kv(comm, kv, kv_lens, step, "ring_kv_bwd")
        blk = torch.zeros(kv.shape, dtype=torch.float32)
        if kv.shape[3]:
            g = block_bwd(backend, q, kv[0], kv[1], out, lse, dout, scale, delta)
            dq += g[0]
            blk[0], blk[1] = g[1], g[2]
        if dkv is not None:
            _wait(dkv_reqs)
            blk += dkv
        # Pass the accumulator of the block we hold on; receive the one of the block we hold next.
        dkv = blk.new_empty(blk.shape[:3] + (kv_lens[(me - step - 1) % n],) + blk.shape[4:])
        if n > 1:
            dkv_reqs = _post(comm, blk, dkv, "ring_dkv")
        else:
            dkv = blk
        if nxt is not None:
            _wait(kv_reqs)
            kv = nxt
    _wait(dkv_reqs)
    return dq, dkv, dextra


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, kv_lens, scale, backend, q, k, v, tk, tv):
        kv = torch.stack([k, v])
        extra = torch.stack([tk, tv]) if tk is not None else None
        out, lse = ring_fwd(comm, q, kv, kv_lens, scale, extra, backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, extra, out, lse)
        ctx.args = (comm, kv_lens, scale, k.dtype, tk is not None, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, extra, out, lse = ctx.saved_tensors
        comm, kv_lens, scale, kdt, has_extra, backend = ctx.args
        dq, dkv, dex = ring_bwd(comm, q, kv, kv_lens, scale, out, lse, dout, extra if has_extra else None, backend)
        dtk = dtv = None
        if has_extra:
            dtk, dtv = dex[0].to(kdt), dex[1].to(kdt)
        return None, None, None, None, dq.to(q.dtype), dkv[0].to(kdt), dkv[1].to(kdt), dtk, dtv


def ring_attention(comm: Comm, q, k, v, kv_lens: Sequence[int], scale: float, tk=None, tv=None,
                   backend: str = "reference"):
    """Attention of local queries on every rank's K/V block (plus local ``tk``/``tv``), compute layout.

    With a one-rank ``comm`` this is plain local attention with an fp32 LSE merge.
    """
    return RingAttention.apply(comm, list(kv_lens), scale, backend, q, k, v, tk, tv)
