"""Ring attention: K/V blocks travel around the ring, partial outputs merge by LSE.

Each rank keeps its queries and, at step i, attends to the K/V block of rank
``r - i``. The transfer of the next block is posted (``batch_isend_irecv``)
before the current block is computed, so communication overlaps compute
(double buffering: the block being read is never the one being written).
K and V travel as two messages of one batch, in the sequence-major layout
``[B, s, Hkv, D]`` the caller's tensors already have (so the first step sends
them as they lie, with no stacking copy); the kernels read transposed views.
Blocks may have uneven lengths (the ring knows every rank's length).

Backward passes K/V around again together with a dK/dV accumulator that every
rank adds its share to; after a full turn each accumulator is back home. The
accumulator travels in fp32 so bf16 gradients sum without extra rounding.

``extra`` K/V (the replicated joint text) is attended once, locally: it is
not circulated, so it costs no traffic and is counted once.

Causal (sequence order = rank order): a rank attends the blocks of earlier
ranks in full, its own block with the causal diagonal, and skips later ranks'
blocks (they still pass through, so every rank posts the same transfers).

Every block is one call of the agreed backend (:mod:`ditsp.attention.kernels`):
a fused kernel returning its LSE, or the pure-torch reference. Block outputs
merge by LSE in fp32, in place on the running output (the first block's
output becomes it); the backward calls the fused backward per block with the
final output and LSE, and adds each block's dK/dV straight into the
accumulator that arrived from the previous rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..distributed.comm import Comm
from .common import merge, post, ring_loop, wait
from .kernels import block_bwd, block_fwd


def _post_kv(comm: Comm, kv, kv_lens: Sequence[int], step: int, kind: str):
    """Post the receive of the block held at ``step`` and the send of ``kv`` (held at ``step - 1``) to the
    next rank: (buffers, requests). ``kv`` is the pair (K, V) in wire layout ``[B, s, Hkv, D]``
    (contiguous); K and V travel as two messages of one batch, so neither is ever stacked.
    """
    n = comm.world_size
    nxt_rank, prv = (comm.rank + 1) % n, (comm.rank - 1) % n
    s = kv_lens[(comm.rank - step) % n]
    nxt = tuple(x.new_empty(x.shape[:1] + (s,) + x.shape[2:]) for x in kv)
    return nxt, post(comm, [(t, nxt_rank) for t in kv], [(t, prv) for t in nxt], kind)


def _compute(x):
    """Wire layout [B, s, H, D] -> the kernels' compute layout [B, H, s, D] (a view)."""
    return x.transpose(1, 2)


def _wire(x):
    """Compute layout [B, H, s, D] -> contiguous wire layout [B, s, H, D] (no copy when it already lies so)."""
    return x.transpose(1, 2).contiguous()


def _block_mask(causal: bool, me: int, src: int) -> tuple[bool, bool]:
    """(attend, causal diagonal) for the block of rank ``src`` seen from rank ``me``."""
    if not causal:
        return True, False
    return src <= me, src == me


def ring_fwd(comm: Comm, q, kv, kv_lens: Sequence[int], scale: float, extra=None, backend: str = "reference",
             causal: bool = False):
    """``q`` [B,H,Sq,D]; ``kv`` (K, V) in wire layout [B,s_me,Hkv,D]. Returns fp32 (out, lse)."""
    n = comm.world_size
    acc = [None, None]  # the running (out, lse)
    if extra is not None and extra.shape[3]:
        acc[:] = merge(None, None, *block_fwd(backend, q, extra[0], extra[1], scale))

    def compute(step, blk):
        attend, diag = _block_mask(causal, comm.rank, (comm.rank - step) % n)
        if blk[0].shape[1] and attend:
            acc[:] = merge(*acc, *block_fwd(backend, q, _compute(blk[0]), _compute(blk[1]), scale, diag))

    ring_loop(n, kv, lambda step, held: _post_kv(comm, held, kv_lens, step, "ring_kv"), compute)
    out, lse = acc
    if out is None:  # no keys at all
        out = q.new_zeros(q.shape[:3] + (kv[1].shape[-1],), dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    return out, lse


def _acc(acc, g):
    """Running fp32 sum: the first term itself (as fp32), then in place."""
    if acc is None:
        return g.float()
    return acc.add_(g)


def ring_bwd(comm: Comm, q, kv, kv_lens, scale, out, lse, dout, extra=None, backend: str = "reference",
             causal: bool = False):
    """Returns fp32 ``dq``, ``dkv`` (this rank's dK and dV in wire layout, summed over all ranks' queries), ``dextra``.

    The dK/dV accumulator that arrives from the previous rank is the one the local block's
    gradients are added into (no fresh buffer per step); the first one is the kernel's own dK/dV.
    dK and dV travel in fp32 as two messages of one batch.
    """
    n, me = comm.world_size, comm.rank
    delta = (dout.float() * out.float()).sum(-1) if backend == "reference" else None
    dq = None
    dextra = None
    if extra is not None:
        dextra = torch.zeros(extra.shape, dtype=torch.float32, device=q.device)
        if extra.shape[3]:
            g = block_bwd(backend, q, extra[0], extra[1], out, lse, dout, scale, delta)
            dq = _acc(dq, g[0])
            dextra[0], dextra[1] = g[1], g[2]
    state = {"dq": dq, "dkv": None, "reqs": []}  # the dK/dV accumulator arriving from the previous rank

    def compute(step, blk_kv):
        k, v = blk_kv
        attend, diag = _block_mask(causal, me, (me - step) % n)
        g = (block_bwd(backend, q, _compute(k), _compute(v), out, lse, dout, scale, delta, diag)
             if k.shape[1] and attend else None)
        if g is not None:
            state["dq"] = _acc(state["dq"], g[0])
        if state["dkv"] is not None:
            wait(state["reqs"])
            blk = state["dkv"]
            if g is not None:
                _compute(blk[0]).add_(g[1])
                _compute(blk[1]).add_(g[2])
        elif g is not None:  # the block's own dK/dV become the accumulator (fp32, wire layout)
            blk = tuple(_wire(x).float() for x in g[1:])
        else:
            blk = tuple(torch.zeros(tuple(x.shape), dtype=torch.float32, device=x.device) for x in blk_kv)
        # Pass the accumulator of the block we hold on; receive the one of the block we hold next.
        if n > 1:
            s = kv_lens[(me - step - 1) % n]
            state["dkv"] = tuple(x.new_empty(x.shape[:1] + (s,) + x.shape[2:]) for x in blk)
            state["reqs"] = post(comm, [(t, (me + 1) % n) for t in blk],
                                 [(t, (me - 1) % n) for t in state["dkv"]], "ring_dkv")
        else:
            state["dkv"] = blk

    ring_loop(n, kv, lambda step, held: _post_kv(comm, held, kv_lens, step, "ring_kv_bwd"), compute)
    wait(state["reqs"])
    dq, dkv = state["dq"], state["dkv"]
    if dq is None:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return dq, dkv, dextra


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, kv_lens, scale, backend, causal, q, k, v, tk, tv):
        kv = (_wire(k), _wire(v))  # the caller's own tensors when they already lie sequence-major
        extra = torch.stack([tk, tv]) if tk is not None else None
        out, lse = ring_fwd(comm, q, kv, kv_lens, scale, extra, backend, causal)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv[0], kv[1], extra, out, lse)
        ctx.args = (comm, kv_lens, scale, k.dtype, tk is not None, backend, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, wk, wv, extra, out, lse = ctx.saved_tensors
        comm, kv_lens, scale, kdt, has_extra, backend, causal = ctx.args
        dq, dkv, dex = ring_bwd(comm, q, (wk, wv), kv_lens, scale, out, lse, dout, extra if has_extra else None,
                                backend, causal)
        dtk = dtv = None
        if has_extra:
            dtk, dtv = dex[0].to(kdt), dex[1].to(kdt)
        return (None, None, None, None, None, dq.to(q.dtype), _compute(dkv[0]).to(kdt), _compute(dkv[1]).to(kdt),
                dtk, dtv)


def ring_attention(comm: Comm, q, k, v, kv_lens: Sequence[int], scale: float, tk=None, tv=None,
                   backend: str = "reference", causal: bool = False):
    """Attention of local queries on every rank's K/V block (plus local ``tk``/``tv``), compute layout.

    With a one-rank ``comm`` this is plain local attention with an fp32 LSE merge. ``causal``: the
    queries are this rank's own block of the sequence (no text).
    """
    return RingAttention.apply(comm, list(kv_lens), scale, backend, causal, q, k, v, tk, tv)
