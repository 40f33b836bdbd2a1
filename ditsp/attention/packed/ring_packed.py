"""Document-aware ring attention over a packed stream.

Every rank holds the rows of its :class:`~.dispatch.Dispatch` segments. For
each ordered pair (query rank ``r``, key rank ``s``) a :class:`RingSchedule`
lists only the blocks the two share: query segment x key segment of the same
document, dropping blocks a causal mask hides completely. The K/V rows ``r``
needs from ``s`` are exactly the key segments of those blocks, so:

- a pair that shares no (visible) document moves nothing and computes nothing;
- a transfer carries only the needed rows, never a whole shard.

Transfers go straight from ``s`` to ``r``: at step ``i`` (1..P-1) rank ``r``
receives from ``r - i`` and sends to ``r + i`` (one permutation per step, so
every rank sends once and receives once per step at most); the next step's
transfer is posted before the current step's blocks are computed. Backward
re-fetches the same rows, computes each block's gradients from the saved
output and LSE, and returns dK/dV (fp32) to their owner on the reverse path.

The schedule is a pure function of the document signature, the dispatch and
the world size, computed once and cached (:func:`ring_schedule`); the ranks
agree on the signature on every call (``agree_docs``), so all derive the same
schedule. ``skip=False`` turns the skipping off (every step moves the whole
shard, every shared block is still masked per document): the
document-unaware transport, for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ...distributed.agree import agree
from ...distributed.comm import Comm
from ..common import merge, post, ring_loop, wait
from ..kernels import attn_bwd, attn_fwd
from .dispatch import Dispatch, dispatch
from .docs import PackedDocs

# -- per-document blocks: the kernel table's reference kernel on THD views ----------------------


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """THD ``[S, H, D]`` -> the kernels' ``[1, H, S, D]`` (a view)."""
    return x.transpose(0, 1)[None]


def block_visible(q_pos: int, sq: int, k_pos: int, sk: int, causal: bool) -> bool:
    """Whether any query of the block sees any key (False: skip transfer and compute)."""
    return sq > 0 and sk > 0 and (not causal or k_pos <= q_pos + sq - 1)


def block_fwd(q, k, v, scale: float, q_pos: int = 0, k_pos: int = 0, causal: bool = False):
    """fp32 ``(out [Sq,H,Dv], lse [Sq,H])`` of queries at document positions ``q_pos..`` on keys at
    ``k_pos..`` (:func:`ditsp.attention.kernels.attn_fwd`: GQA by grouping query rows, no K/V copy);
    rows that see no key get out 0, lse -inf."""
    out, lse = attn_fwd(_bhsd(q), _bhsd(k), _bhsd(v), scale, causal, q_pos - k_pos)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def block_bwd(q, k, v, lse, delta, dout, scale: float, q_pos: int = 0, k_pos: int = 0, causal: bool = False):
    """fp32 ``(dq, dk, dv)`` of one block (THD) given the *final* ``lse`` [Sq,H] and ``delta = rowsum(dout*out)``."""
    g = attn_bwd(_bhsd(q), _bhsd(k), _bhsd(v), _bhsd(lse), _bhsd(delta), _bhsd(dout), scale, causal, q_pos - k_pos)
    return tuple(x[0].transpose(0, 1) for x in g)


# (q local offset, q rows, q doc position, k offset in buffer, k rows, k doc position, causal)
Block = tuple[int, int, int, int, int, int, bool]


@dataclass(frozen=True)
class PairPlan:
    """What query rank ``r`` computes with key rank ``s``'s rows."""

    src: int
    dst: int
    rows: np.ndarray  # s-local rows s sends to r (the receive buffer's order)
    blocks: tuple[Block, ...]

    @property
    def empty(self) -> bool:
        return not self.blocks


@dataclass(frozen=True, eq=False)
class RingSchedule:
    """Every pair's blocks and rows, identical on every rank."""

    dispatch: Dispatch
    skip: bool
    pairs: dict  # (dst r, src s) -> PairPlan

    @property
    def world_size(self) -> int:
        return self.dispatch.world_size

    def pair(self, dst: int, src: int) -> PairPlan:
        return self.pairs[(dst, src)]

    def text_blocks(self, rank: int) -> list[tuple[int, int, int]]:
        """``(q offset, q rows, doc)`` of every local segment whose document has text."""
        docs = self.dispatch.docs
        return [(o, b - a, d) for d, a, b, o in self.dispatch.local_segments(rank) if docs.text_lens[d]]

    def rows_moved(self) -> int:
        """K/V rows crossing ranks in one forward (all ranks together)."""
        return sum(int(p.rows.size) for (r, s), p in self.pairs.items() if r != s)

    def pairs_skipped(self) -> int:
        """Ordered rank pairs that move no K/V at all (transfer and compute skipped)."""
        return sum(p.rows.size == 0 for (r, s), p in self.pairs.items() if r != s)


def _pair(disp: Dispatch, r: int, s: int, skip: bool) -> PairPlan:
    docs = disp.docs
    qsegs, ksegs = disp.local_segments(r), disp.local_segments(s)
    live: list[tuple] = []
    needed: set[int] = set()
    for qd, qa, qb, qo in qsegs:
        for j, (kd, ka, kb, ko) in enumerate(ksegs):
            if kd == qd and block_visible(qa, qb - qa, ka, kb - ka, docs.causal[qd]):
                live.append((qo, qb - qa, qa, j, kb - ka, ka, docs.causal[qd]))
                needed.add(j)
    if r == s or not skip:
        needed = set(range(len(ksegs)))
    buf_off, rows, o = {}, [], 0
    for j, (kd, ka, kb, ko) in enumerate(ksegs):
        if j in needed:
            buf_off[j] = o
            rows.append(np.arange(ko, ko + kb - ka, dtype=np.int64))
            o += kb - ka
    blocks = tuple((qo, sq, qp, buf_off[j], sk, kp, c) for qo, sq, qp, j, sk, kp, c in live)
    arr = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return PairPlan(s, r, arr, blocks)


@lru_cache(maxsize=64)
def _schedule(sig: tuple, p: int, mode: str, tolerance: float, skip: bool) -> RingSchedule:
    disp = dispatch(PackedDocs(*sig), p, mode, tolerance)
    pairs = {(r, s): _pair(disp, r, s, skip) for r in range(p) for s in range(p)}
    return RingSchedule(disp, skip, pairs)


def ring_schedule(docs: PackedDocs, world_size: int, mode: str = "area", skip: bool = True,
                  tolerance: float = 1.05) -> RingSchedule:
    """The cached send/recv and block schedule of ``docs`` on ``world_size`` ranks."""
    return _schedule(docs.signature(), int(world_size), mode, float(tolerance), bool(skip))


def schedule_cache_info():
    return _schedule.cache_info()


# -- transport -----------------------------------------------------------------


def _post(comm: Comm, sched: RingSchedule, kv: torch.Tensor, step: int, kind: str):
    """Post step ``step``'s K/V transfer: (receive buffer or None, requests)."""
    p, me = comm.world_size, comm.rank
    dst, src = (me + step) % p, (me - step) % p
    out_rows = sched.pair(dst, me).rows
    in_rows = sched.pair(me, src).rows
    sends = [(kv[:, torch.from_numpy(out_rows)].contiguous(), dst)] if out_rows.size else []
    buf = kv.new_empty((kv.shape[0], int(in_rows.size)) + tuple(kv.shape[2:])) if in_rows.size else None
    return buf, post(comm, sends, [(buf, src)] if buf is not None else [], kind)


def ring_fwd(comm: Comm, sched: RingSchedule, q, kv, tkv, scale: float):
    """``q`` [S,H,D], ``kv`` [2,S,Hkv,D], ``tkv`` [2,T,Hkv,D] or None -> fp32 (out, lse)."""
    p, me = comm.world_size, comm.rank
    docs = sched.dispatch.docs
    out = torch.zeros(q.shape[:2] + (kv.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)

    def fold(qo, sq, o, l):  # merge one block's result into rows [qo, qo + sq), in place
        _, lse[qo:qo + sq] = merge(out[qo:qo + sq], lse[qo:qo + sq], o, l)

    def compute(step, buf):
        if step == 0 and tkv is not None:  # the documents' text, attended locally once
            to = docs.text_offsets
            for qo, sq, d in sched.text_blocks(me):
                fold(qo, sq, *block_fwd(q[qo:qo + sq], tkv[0, to[d]:to[d + 1]], tkv[1, to[d]:to[d + 1]], scale))
        if buf is not None:
            for qo, sq, qp, ko, sk, kp, causal in sched.pair(me, (me - step) % p).blocks:
                fold(qo, sq, *block_fwd(q[qo:qo + sq], buf[0, ko:ko + sk], buf[1, ko:ko + sk], scale, qp, kp, causal))

    ring_loop(p, kv, lambda step, _: _post(comm, sched, kv, step, "packed_ring_kv"), compute)
    return out, lse


def ring_bwd(comm: Comm, sched: RingSchedule, q, kv, tkv, scale: float, out, lse, dout):
    """fp32 ``dq``, ``dkv`` (this rank's rows, summed over every rank's queries), ``dtkv``."""
    p, me = comm.world_size, comm.rank
    docs = sched.dispatch.docs
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dtkv = torch.zeros(tkv.shape, dtype=torch.float32, device=q.device) if tkv is not None else None

    def run(buf, dbuf, blocks):
        for qo, sq, qp, ko, sk, kp, causal in blocks:
            g = block_bwd(q[qo:qo + sq], buf[0, ko:ko + sk], buf[1, ko:ko + sk], lse[qo:qo + sq],
                          delta[qo:qo + sq], dout[qo:qo + sq], scale, qp, kp, causal)
            dq[qo:qo + sq] += g[0]
            dbuf[0, ko:ko + sk] += g[1]
            dbuf[1, ko:ko + sk] += g[2]

    def compute(step, buf):
        if step == 0:
            if tkv is not None:
                to = docs.text_offsets
                for qo, sq, d in sched.text_blocks(me):
                    a, b = to[d], to[d + 1]
                    g = block_bwd(q[qo:qo + sq], tkv[0, a:b], tkv[1, a:b], lse[qo:qo + sq], delta[qo:qo + sq],
                                  dout[qo:qo + sq], scale)
                    dq[qo:qo + sq] += g[0]
                    dtkv[0, a:b] += g[1]
                    dtkv[1, a:b] += g[2]
            run(kv, dkv, sched.pair(me, me).blocks)
            return
        src, dst = (me - step) % p, (me + step) % p
        dbuf = torch.zeros(buf.shape, dtype=torch.float32, device=q.device) if buf is not None else None
        if buf is not None:
            run(buf, dbuf, sched.pair(me, src).blocks)
        # dK/dV of the rows we received go back to their owner; ours come back from dst.
        back_rows = sched.pair(dst, me).rows
        ret = torch.empty((2, int(back_rows.size)) + tuple(kv.shape[2:]), dtype=torch.float32, device=q.device)
        wait(post(comm, [(dbuf, src)] if dbuf is not None else [], [(ret, dst)] if back_rows.size else [],
                  "packed_ring_dkv"))
        if back_rows.size:
            dkv.index_add_(1, torch.from_numpy(back_rows).to(q.device), ret)

    ring_loop(p, kv, lambda step, _: _post(comm, sched, kv, step, "packed_ring_kv_bwd"), compute)
    return dq, dkv, dtkv


class PackedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, sched, scale, q, k, v, tk, tv):
        kv = torch.stack([k, v])
        tkv = torch.stack([tk, tv]) if tk is not None else None
        out, lse = ring_fwd(comm, sched, q, kv, tkv, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, tkv, out, lse)
        ctx.args = (comm, sched, scale, k.dtype, tk is not None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, tkv, out, lse = ctx.saved_tensors
        comm, sched, scale, kdt, has_text = ctx.args
        dq, dkv, dtkv = ring_bwd(comm, sched, q, kv, tkv if has_text else None, scale, out, lse, dout)
        dtk = dtv = None
        if has_text:
            dtk, dtv = dtkv[0].to(kdt), dtkv[1].to(kdt)
        return None, None, None, dq.to(q.dtype), dkv[0].to(kdt), dkv[1].to(kdt), dtk, dtv


def packed_ring_attention(comm: Comm, q, k, v, docs: PackedDocs, mode: str = "area", tk=None, tv=None,
                          scale: float | None = None, skip: bool = True, tolerance: float = 1.05):
    """Per-document attention of this rank's rows ``q, k, v`` [s, H(kv), D] (THD, dispatch order).

    ``q``/``k``/``v`` hold the rows of ``dispatch(docs, P, mode).rank_rows(rank)``
    (:func:`shard_rows`). ``tk``/``tv`` [sum(text_lens), Hkv, D]: the documents'
    joint text K/V, replicated on every rank (sum convention for their
    gradients: all-reduce them with the parameters). Returns [s, H, Dv].
    """
    if comm.world_size > 1:  # one small gather per call: documents and options together
        agree(comm, "the packed ring documents (cu_seqlens, causal flags, text lengths) and options",
              {"cu_seqlens": list(docs.cu_seqlens), "causal": list(docs.causal), "text": list(docs.text_lens),
               "mode": mode, "skip": bool(skip), "tolerance": float(tolerance)})
    sched = ring_schedule(docs, comm.world_size, mode, skip, tolerance)
    n = sched.dispatch.rank_lens[comm.rank]
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"rank {comm.rank} holds {q.shape[0]} rows; the dispatch gives it {n}")
    if (tk is None) != (sum(docs.text_lens) == 0):
        raise ValueError("pass text K/V exactly when the documents declare text lengths")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return PackedRing.apply(comm, sched, sc, q, k, v, tk, tv)


def shard_rows(x: torch.Tensor, disp: Dispatch, rank: int) -> torch.Tensor:
    """This rank's rows of a full stream ``x`` [N, ...] (tests, single-process drivers)."""
    return x.index_select(0, torch.from_numpy(disp.rank_rows(rank)).to(x.device))


def unshard_rows(parts, disp: Dispatch) -> torch.Tensor:
    """Every rank's rows (in rank order) back to one stream in global order."""
    out = parts[0].new_empty((disp.docs.total,) + tuple(parts[0].shape[1:]))
    for r, part in enumerate(parts):
        out[torch.from_numpy(disp.rank_rows(r)).to(out.device)] = part
    return out
