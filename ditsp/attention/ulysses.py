"""Ulysses transport: sequence shards <-> head shards by all-to-all.

Head shards: query heads split as evenly as possible (``even_splits``), so a
head count that does not divide by the degree gives uneven shards (allowed
when ``ParallelConfig.advanced_uaa``), never padding. A rank receives the K/V
heads its query heads use (GQA/MQA); a K/V head shared by two ranks is sent to
both and its gradients are summed on the way back.

Sequence shards may be uneven (lengths gathered once per call): buffers are
packed flat, one element-split per peer, so no padding and no masks.

Transport: by default Q, K and V travel in ONE stacked all-to-all.
``ulysses_a2a_permute=True`` permutes each tensor to head-major and exchanges
Q, K and V separately: three calls instead of one, but no stacked pack buffer
(peak extra memory of the largest tensor instead of all three). Results are
identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..dist import transport
from ..dist.comm import Comm
from .common import even_splits, ranges


@dataclass(frozen=True)
class HeadPlan:
    """Which query and K/V heads every rank of a Ulysses group computes."""

    heads: int
    kv_heads: int
    q: tuple[tuple[int, int], ...]
    kv: tuple[tuple[int, int], ...]

    def kv_index(self, rank: int) -> list[int] | None:
        """Local K/V head of each local query head, or None when heads group contiguously."""
        (qlo, qhi), (klo, khi) = self.q[rank], self.kv[rank]
        g = self.heads // self.kv_heads
        idx = [(qlo + i) // g - klo for i in range(qhi - qlo)]
        nq, nk = qhi - qlo, khi - klo
        if nk and nq % nk == 0 and idx == [i // (nq // nk) for i in range(nq)]:
            return None
        return idx


def head_plan(heads: int, kv_heads: int, degree: int) -> HeadPlan:
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads need a divisor as K/V head count, got {kv_heads}")
    g = heads // kv_heads
    q = tuple(ranges(even_splits(heads, degree)))
    kv = tuple((lo // g, -(-hi // g)) if hi > lo else (0, 0) for lo, hi in q)
    return HeadPlan(heads, kv_heads, q, kv)


def _exchange(comm: Comm, chunks: list[list[torch.Tensor]], shapes: list[list[tuple]], kind: str):
    """Send ``chunks[p]`` to peer p, receive tensors of ``shapes[r]`` from r; one flat all-to-all."""
    # Packed straight into the send buffer (whole, or chunk by chunk within a capacity): ditsp.dist.transport.
    flat = transport.Concat([c for per in chunks for c in per])
    sizes = [[int(torch.Size(s).numel()) for s in per] for per in shapes]
    out = transport.all_to_all(comm, flat, [sum(c.numel() for c in per) for per in chunks], [sum(s) for s in sizes],
                               kind, key=transport.shape_key(chunks, shapes))
    pieces, o = [], 0
    for per, ss in zip(shapes, sizes):
        pieces.append([])
        for s, n in zip(per, ss):
            pieces[-1].append(out[o : o + n].view(s))
            o += n
    return pieces


def seq_to_head(comm: Comm, xs, head_ranges, seq_lens, kind="ulysses_a2a", stacked=True):
    """``[B, s_me, H_t, D]`` sequence shards -> ``[B, h_t(me), S, D]`` head shards, per tensor t."""
    if not stacked:
        return [seq_to_head(comm, [x], [hr], seq_lens, kind, True)[0] for x, hr in zip(xs, head_ranges)]
    me, n = comm.rank, comm.world_size
    b = xs[0].shape[0]
    chunks = [[x[:, :, hr[p][0] : hr[p][1]].transpose(1, 2) for x, hr in zip(xs, head_ranges)] for p in range(n)]
    shapes = [[(b, hr[me][1] - hr[me][0], seq_lens[r], x.shape[-1]) for x, hr in zip(xs, head_ranges)] for r in range(n)]
    pieces = _exchange(comm, chunks, shapes, kind)
    return [torch.cat([pieces[r][t] for r in range(n)], dim=2) for t in range(len(xs))]


def head_to_seq(comm: Comm, xs, head_ranges, seq_lens, total_heads, kind="ulysses_a2a", stacked=True):
    """Inverse of :func:`seq_to_head`; heads held by several ranks are summed."""
    if not stacked:
        return [head_to_seq(comm, [x], [hr], seq_lens, [th], kind, True)[0]
                for x, hr, th in zip(xs, head_ranges, total_heads)]
    me, n = comm.rank, comm.world_size
    b = xs[0].shape[0]
    o = [0]
    for s in seq_lens:
        o.append(o[-1] + s)
    chunks = [[x[:, :, o[p] : o[p + 1]] for x in xs] for p in range(n)]
    shapes = [[(b, hr[r][1] - hr[r][0], seq_lens[me], x.shape[-1]) for x, hr in zip(xs, head_ranges)] for r in range(n)]
    pieces = _exchange(comm, chunks, shapes, kind)
    outs = []
    for t, (x, hr, th) in enumerate(zip(xs, head_ranges, total_heads)):
        y = x.new_zeros((b, seq_lens[me], th, x.shape[-1]))
        for r in range(n):
            y[:, :, hr[r][0] : hr[r][1]] += pieces[r][t].transpose(1, 2)
        outs.append(y)
    return outs


class SeqToHead(torch.autograd.Function):
    """Forward :func:`seq_to_head`; backward runs the inverse all-to-all."""

    @staticmethod
    def forward(ctx, comm, head_ranges, seq_lens, stacked, *xs):
        ctx.args = (comm, head_ranges, seq_lens, [x.shape[2] for x in xs], stacked)
        return tuple(seq_to_head(comm, list(xs), head_ranges, seq_lens, stacked=stacked))

    @staticmethod
    def backward(ctx, *gs):
        comm, hr, lens, total, stacked = ctx.args
        gs = [g.contiguous() for g in gs]
        return (None, None, None, None, *head_to_seq(comm, gs, hr, lens, total, "ulysses_a2a_bwd", stacked))


class HeadToSeq(torch.autograd.Function):
    """Forward :func:`head_to_seq`; backward runs the inverse all-to-all."""

    @staticmethod
    def forward(ctx, comm, head_ranges, seq_lens, total_heads, stacked, *xs):
        ctx.args = (comm, head_ranges, seq_lens, stacked)
        return tuple(head_to_seq(comm, list(xs), head_ranges, seq_lens, total_heads, stacked=stacked))

    @staticmethod
    def backward(ctx, *gs):
        comm, hr, lens, stacked = ctx.args
        gs = [g.contiguous() for g in gs]
        return (None, None, None, None, None, *seq_to_head(comm, gs, hr, lens, "ulysses_a2a_bwd", stacked))


def to_heads(comm: Comm, plan: HeadPlan, seq_lens: Sequence[int], q, k, v, stacked: bool = True):
    """Sequence-sharded q, k, v -> this rank's head shard of the whole sequence (one all-to-all)."""
    hr = [plan.q, plan.kv, plan.kv]
    return SeqToHead.apply(comm, hr, list(seq_lens), stacked, q, k, v)


def to_seq(comm: Comm, plan: HeadPlan, seq_lens: Sequence[int], out, stacked: bool = True):
    """Head-sharded output -> sequence shard with all heads."""
    return HeadToSeq.apply(comm, [plan.q], list(seq_lens), [plan.heads], stacked, out)[0]
