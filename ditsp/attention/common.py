"""Pieces shared by the global-attention SP strategies.

Layouts: strategies take and return ``[B, L, H, D]`` (sequence-major, as a
DiT block holds its tokens); compute happens in ``[B, H, S, D]``.

Block attention returns a *real* log-sum-exp, so partial results over K/V
blocks (ring steps, text block) merge exactly (in fp32). The backward is the
flash-attention one: with the final output and LSE saved, every K/V block's
gradients are computed independently, which is what lets ring backward pass
dK/dV around instead of rebuilding the full matrix. Block calls go through
the kernels of :mod:`ditsp.attention.kernels`, whose ``reference`` backend
(``kernels.attn_fwd``/``attn_bwd``: pure torch, fp32 score chunks) runs
whatever no fused kernel takes.

Replicated tensors (joint text) follow the *sum convention*: a replicated
output's true cotangent is the sum of the per-rank cotangents, and the true
gradient of a replicated input is the sum of the per-rank gradients, which is
what an all-reduce of parameter gradients over the SP group expects.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..distributed.comm import Comm
from ..distributed.transport import offsets  # noqa: F401 - re-exported (attention modules use it)
from .kernels import attn_bwd, attn_fwd  # noqa: F401 - the reference kernel lives in the kernel table


# -- uneven splits ----------------------------------------------------------


def even_splits(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous shares differing by at most one (larger first)."""
    if parts < 1 or n < 0:
        raise ValueError(f"cannot split {n} into {parts} parts")
    q, r = divmod(n, parts)
    return [q + (i < r) for i in range(parts)]


def ranges(splits: Sequence[int]) -> list[tuple[int, int]]:
    o = offsets(splits)
    return [(o[i], o[i + 1]) for i in range(len(splits))]


def gather_lens(comm: Comm, n: int) -> list[int]:
    """Every rank's local length (one tiny counted all-gather), so splits need no masks."""
    if comm.world_size == 1:
        return [int(n)]
    t = torch.tensor([int(n)], dtype=torch.int64, device=comm.wire_device)  # NCCL takes device tensors only
    return [int(x) for x in comm.all_gather_rows(t, [1] * comm.world_size, kind="lengths")]


# -- block attention with LSE -------------------------------------------------


def merge(out, lse, blk_out, blk_lse):
    """Fold one block's ``(out, lse)`` into the running fp32 pair, in place on ``out``; returns the pair.

    The one LSE merge of ditsp (ring, all-gather causal, packed ring). ``out`` None (nothing yet): the
    block becomes the pair, as fp32. ``out`` may be a view (a slice of a larger output), which is
    updated in place; an fp32 ``blk_out`` is consumed. Rows whose merged LSE is -inf (no key seen yet)
    stay 0 instead of NaN; every other row gets ``out * exp(lse - new) + blk * exp(blk_lse - new)``.
    """
    if out is None:
        return blk_out.float(), blk_lse.float()
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    b = torch.exp(blk_lse - safe).unsqueeze(-1)
    out.add_(blk_out.mul_(b) if blk_out.dtype == torch.float32 else blk_out * b)
    return out, new


# -- the ring loop: one transfer in flight while one block is computed ------------


def post(comm: Comm, sends, recvs, kind: str) -> list:
    """Post point-to-point ``(tensor, peer)`` sends and receives as one batch (empty tensors skipped):
    the requests to :func:`wait` on."""
    sends = [(t, p) for t, p in sends if t is not None and t.numel()]
    recvs = [(t, p) for t, p in recvs if t is not None and t.numel()]
    return comm.batch_isend_irecv(sends, recvs, kind=kind) if sends or recvs else []


def wait(reqs) -> None:
    for r in reqs:
        r.wait()


def ring_loop(steps: int, first, post_step, compute) -> None:
    """The one post/wait loop of the ring strategies (:mod:`.ring`, :mod:`.packed.ring_packed`).

    Step 0 computes ``first`` (the local block). The transfer that step s needs is posted by
    ``post_step(s, held)`` (``held``: the block of step s-1; returns ``(block or None, requests)``)
    before step s-1 is computed, and waited for after it, so one transfer overlaps one compute; then
    ``compute(s, block)``. Every rank runs the same steps and posts, whatever it computes.
    """
    blk = first
    nxt = post_step(1, blk) if steps > 1 else (None, [])
    compute(0, blk)
    for s in range(1, steps):
        blk, reqs = nxt
        wait(reqs)
        nxt = post_step(s + 1, blk) if s + 1 < steps else (None, [])
        compute(s, blk)


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


# -- gathers whose backward is a reduce-scatter --------------------------------


class GatherRows(torch.autograd.Function):
    """All-gather uneven shares along ``dim``; backward reduce-scatters (sum convention)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, rows: Sequence[int], dim: int, kind: str):
        ctx.comm, ctx.rows, ctx.dim, ctx.kind = comm, list(rows), dim, kind
        parts = comm.all_gather_rows(x.movedim(dim, 0).contiguous(), rows, kind=kind)
        return torch.cat(parts, 0).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        d = ctx.comm.reduce_scatter_rows(g.movedim(ctx.dim, 0), ctx.rows, kind=ctx.kind + "_bwd")
        return d.movedim(0, ctx.dim), None, None, None, None


def gather_rows(x, comm: Comm, rows: Sequence[int], dim: int, kind: str = "all_gather"):
    if comm.world_size == 1:
        return x
    return GatherRows.apply(x, comm, list(rows), dim, kind)
