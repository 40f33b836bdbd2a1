"""Ulysses transport: sequence shards <-> head shards by all-to-all.

Head shards: query heads split as evenly as possible (``even_splits``), so a
head count that does not divide by the degree gives uneven shards (allowed
when ``ParallelConfig.advanced_uaa``), never padding. A rank receives the K/V
heads its query heads use (GQA/MQA); a K/V head shared by two ranks is sent to
both and its gradients are summed on the way back.

Sequence shards may be uneven (lengths gathered once per call): buffers are
packed flat, one element-split per peer, so no padding and no masks.

Transport: by default Q, K and V go in one all-to-all each (3 calls, like
the peers): the send stage then holds one tensor's crossing rows at a time,
the lowest peak. ``stacked=True`` (``ParallelConfig.ulysses_a2a_stacked``)
moves all three in one call instead (fewer rounds, a send stage of all
three). Gradients on the way back always go one all-to-all each. Either way
the send side is packed by the transport straight from the tensors
(:class:`WireBlocks`), and a rank's own block is copied into place without
entering the collective. Results are identical.

Layouts (no copy after an exchange): the wire block for a peer is sequence-major with the tensors'
head shares side by side in each row, so the received buffer already is ``[S, B, heads x D]`` and
the head shards handed to the kernel are strided views of it; the way back sends rows of the
kernel's sequence-major output as they lie, and the receiver writes each peer's heads into place
(a copy; zero-fill and sum only for heads that several ranks hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..distributed import transport
from ..distributed.transport import Transport
from .common import even_splits, offsets, ranges


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


def _widths(xs, head_ranges, rank):
    """Elements per (sequence row, batch item) of every tensor's head share of ``rank``."""
    return [(hr[rank][1] - hr[rank][0]) * x.shape[-1] for x, hr in zip(xs, head_ranges)]


def _move(link: Transport, src, ins, outs, kind, key, planes: int, grad: bool):
    """One transport all-to-all of a flat source (element splits); ``planes`` as the codec reports them."""
    if isinstance(src, torch.Tensor):
        src = transport.Rows(src)
    src.planes = planes  # per-plane sizes as before: (batch items x tensors x peers) planes
    return link.all_to_all(src, ins, outs, kind, key=key, grad=True if grad else None)


class WireBlocks:
    """The flat send buffer of :func:`seq_to_head`, packed on demand (a transport source).

    Peer p's block is ``[s_me, B, W_p]``: each sequence row holds the p-shares of all tensors side
    by side. :meth:`copy_rows` writes any element range of it straight from the tensors, so the
    transport stages only the chunk in flight and copies this rank's own block into the output
    without building the whole buffer.
    """

    def __init__(self, xs, head_ranges, n: int):
        self.xs, self.head_ranges = xs, head_ranges
        self.b, self.s = xs[0].shape[0], xs[0].shape[1]
        self.widths = [sum(_widths(xs, head_ranges, p)) for p in range(n)]
        self.offsets = offsets([self.s * self.b * w for w in self.widths])
        self.rows, self.row_shape = self.offsets[-1], ()
        self.dtype, self.device, self.planes = xs[0].dtype, xs[0].device, 1
        self.requires_grad = False  # the codec's autograd Functions own the gradients

    def materialize(self) -> torch.Tensor:
        buf = self.xs[0].new_empty(self.rows)
        self.copy_rows(0, self.rows, buf)
        return buf

    def view_rows(self, a: int, b: int):
        return None

    def _block_rows(self, p: int, r0: int, r1: int, dst: torch.Tensor) -> None:
        """Sequence rows ``[r0, r1)`` of peer p's block into ``dst`` (``(r1 - r0) * B * W_p`` elements)."""
        blk, c = dst.view(r1 - r0, self.b, self.widths[p]), 0
        for x, hr in zip(self.xs, self.head_ranges):
            lo, hi = hr[p]
            w = (hi - lo) * x.shape[-1]
            if w:
                blk[:, :, c : c + w].view(r1 - r0, self.b, hi - lo, x.shape[-1]).copy_(
                    x[:, r0:r1, lo:hi].transpose(0, 1))
            c += w

    def copy_rows(self, a: int, b: int, dst: torch.Tensor) -> None:
        o = 0
        for p in range(len(self.widths)):
            row = self.b * self.widths[p]  # elements per sequence row of peer p's block
            e, end = max(a, self.offsets[p]) - self.offsets[p], min(b, self.offsets[p + 1]) - self.offsets[p]
            while e < end:
                r = e // row
                if e % row == 0 and end - e >= row:  # whole rows, straight from the tensors
                    step = (end - e) // row * row
                    self._block_rows(p, r, r + step // row, dst[o : o + step])
                else:  # part of one row: pack the row, keep the slice
                    step = min(end, (r + 1) * row) - e
                    tmp = dst.new_empty(row)
                    self._block_rows(p, r, r + 1, tmp)
                    dst[o : o + step].copy_(tmp[e - r * row : e - r * row + step])
                o, e = o + step, e + step


def seq_to_head(link: Transport, xs, head_ranges, seq_lens, kind="ulysses_a2a", stacked=True, contiguous=False):
    """``[B, s_me, H_t, D]`` sequence shards -> ``[B, h_t(me), S, D]`` head shards, per tensor t.

    Wire layout (:class:`WireBlocks`): every rank sends peer p one block ``[s_me, B, W_p]`` whose
    rows hold the p-shares of all tensors side by side (``W_p`` = sum over t of ``h_t(p) * D_t``).
    Blocks arrive in rank order, so the receive buffer is already ``[S, B, W_me]``: every returned
    head shard is a strided view of it (sequence stride ``B * W_me``), with no copy after the
    exchange. The send side is packed by the transport, chunk by chunk, straight from the tensors.
    ``link``: the caller's Transport (a bare Comm gets a fresh one, as for every function here).
    """
    link = Transport.of(link)
    if not stacked:  # one exchange per tensor; ``contiguous``: its copy, and the receive buffer goes at once
        res = []
        for x, hr in zip(xs, head_ranges):
            h = seq_to_head(link, [x], [hr], seq_lens, kind, True)[0]
            res.append(h.contiguous() if contiguous else h)
        return res
    me, n = link.rank, link.world_size
    b = xs[0].shape[0]
    wire = WireBlocks(xs, head_ranges, n)
    s_me = wire.s
    ws = _widths(xs, head_ranges, me)
    W = sum(ws)
    key = ("ulysses_s2h", tuple(int(v) for v in seq_lens), b,
           tuple((tuple(map(tuple, hr)), int(x.shape[-1])) for x, hr in zip(xs, head_ranges)))
    out = _move(link, wire, [s_me * b * w for w in wire.widths], [int(s) * b * W for s in seq_lens], kind, key,
                b * n * len(xs), any(x.requires_grad for x in xs))
    S = sum(int(s) for s in seq_lens)
    full = out.view(S, b, W)
    res, c = [], 0
    for x, w in zip(xs, ws):
        d = x.shape[-1]
        res.append(full[:, :, c : c + w].view(S, b, w // d if d else 0, d).permute(1, 2, 0, 3))
        c += w
    return res


def head_to_seq(link: Transport, xs, head_ranges, seq_lens, total_heads, kind="ulysses_a2a", stacked=True):
    """Inverse of :func:`seq_to_head`; heads held by several ranks are summed.

    Packs ``[S, B, W_me]`` (no copy when one tensor already lies sequence-major, as the fused kernels
    write their output), sends every peer its rows, and writes each peer's heads into place: a plain
    copy, except for heads that more than one rank holds (a K/V head shared under GQA), which are
    zero-filled and summed.
    """
    link = Transport.of(link)
    if not stacked:
        return [head_to_seq(link, [x], [hr], seq_lens, [th], kind, True)[0]
                for x, hr, th in zip(xs, head_ranges, total_heads)]
    me, n = link.rank, link.world_size
    b, S = xs[0].shape[0], xs[0].shape[2]
    s_me = int(seq_lens[me])
    ws = _widths(xs, head_ranges, me)
    W = sum(ws)
    if len(xs) == 1 and xs[0].permute(2, 0, 1, 3).is_contiguous():
        buf = xs[0].permute(2, 0, 1, 3).reshape(-1)
    else:
        buf = xs[0].new_empty(S * b * W)
        full, c = buf.view(S, b, W), 0
        for x, w in zip(xs, ws):
            if w:
                full[:, :, c : c + w].view(S, b, x.shape[1], x.shape[-1]).copy_(x.permute(2, 0, 1, 3))
            c += w
    recv_w = [sum(_widths(xs, head_ranges, r)) for r in range(n)]
    key = ("ulysses_h2s", tuple(int(v) for v in seq_lens), b,
           tuple((tuple(map(tuple, hr)), int(x.shape[-1])) for x, hr in zip(xs, head_ranges)))
    out = _move(link, buf, [int(s) * b * W for s in seq_lens], [s_me * b * w for w in recv_w], kind, key,
                b * n * len(xs), any(x.requires_grad for x in xs))
    del buf  # a packed send buffer goes before the outputs are allocated
    outs = []
    for t, (x, hr, th) in enumerate(zip(xs, head_ranges, total_heads)):
        d = x.shape[-1]
        cover = [0] * th
        for lo, hi in hr:
            for h in range(lo, hi):
                cover[h] += 1
        shared = any(c > 1 for c in cover)
        y = (x.new_zeros if shared or 0 in cover else x.new_empty)((b, s_me, th, d))
        o = 0
        for r in range(n):
            blk = out[o : o + s_me * b * recv_w[r]].view(s_me, b, recv_w[r])
            c = sum(_widths(xs[:t], head_ranges[:t], r))
            lo, hi = hr[r]
            if hi > lo:
                piece = blk[:, :, c : c + (hi - lo) * d].view(s_me, b, hi - lo, d).transpose(0, 1)
                if shared:
                    y[:, :, lo:hi] += piece
                else:
                    y[:, :, lo:hi] = piece
            o += s_me * b * recv_w[r]
        outs.append(y)
    return outs


class SeqToHead(torch.autograd.Function):
    """Forward :func:`seq_to_head`; backward runs the inverse all-to-all."""

    @staticmethod
    def forward(ctx, link, head_ranges, seq_lens, stacked, contiguous, *xs):
        ctx.args = (link, head_ranges, seq_lens, [x.shape[2] for x in xs], stacked)
        return tuple(seq_to_head(link, list(xs), head_ranges, seq_lens, stacked=stacked, contiguous=contiguous))

    @staticmethod
    def backward(ctx, *gs):
        link, hr, lens, total, stacked = ctx.args
        # One exchange per gradient even when the forward stacked them: the three gradients are alive
        # anyway (the engine holds them until this returns), so a stacked send buffer and receive buffer
        # would add twice their size at once; per tensor it is twice the largest one.
        return (None,) * 5 + tuple(head_to_seq(link, gs, hr, lens, total, "ulysses_a2a_bwd", False))


class HeadToSeq(torch.autograd.Function):
    """Forward :func:`head_to_seq`; backward runs the inverse all-to-all."""

    @staticmethod
    def forward(ctx, link, head_ranges, seq_lens, total_heads, stacked, *xs):
        ctx.args = (link, head_ranges, seq_lens, stacked)
        return tuple(head_to_seq(link, list(xs), head_ranges, seq_lens, total_heads, stacked=stacked))

    @staticmethod
    def backward(ctx, *gs):
        # The output's gradient stays a view of its receive buffer even for kernels that prefer
        # contiguous input: a copy here would sit at the backward's memory peak (measured +10%).
        link, hr, lens, stacked = ctx.args
        return (None,) * 5 + tuple(seq_to_head(link, gs, hr, lens, "ulysses_a2a_bwd", stacked))


def to_heads(link: Transport, plan: HeadPlan, seq_lens: Sequence[int], q, k, v, stacked: bool = False,
             contiguous: bool = False):
    """Sequence-sharded q, k, v -> this rank's head shard of the whole sequence (one all-to-all each,
    or one in all with ``stacked``). ``contiguous``: return contiguous copies instead of views of the
    receive buffers (for kernels that read them faster; per-tensor exchanges only)."""
    hr = [plan.q, plan.kv, plan.kv]
    return SeqToHead.apply(Transport.of(link), hr, list(seq_lens), stacked, contiguous, q, k, v)


def to_seq(link: Transport, plan: HeadPlan, seq_lens: Sequence[int], out, stacked: bool = False):
    """Head-sharded output -> sequence shard with all heads."""
    return HeadToSeq.apply(Transport.of(link), [plan.q], list(seq_lens), [plan.heads], stacked, out)[0]
