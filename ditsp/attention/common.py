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
    t = torch.tensor([int(n)], dtype=torch.int64)
    return [int(x) for x in comm.all_gather_rows(t, [1] * comm.world_size, kind="lengths")]


# -- block attention with LSE -------------------------------------------------


def merge(out, lse, blk_out, blk_lse):
    """Fold one block's ``(out, lse)`` into the running fp32 pair (None = nothing yet)."""
    if out is None:
        return blk_out, blk_lse
    new = torch.logaddexp(lse, blk_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + blk_out * torch.exp(blk_lse - new).unsqueeze(-1)
    return out, new


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


# -- gathers whose backward is a reduce-scatter --------------------------------


def reduce_scatter_rows(comm: Comm, full: torch.Tensor, rows: Sequence[int], kind: str = "reduce_scatter"):
    """Sum over ranks of ``full[my rows]`` (every rank holds a full partial), via one all-to-all."""
    me, n = comm.rank, comm.world_size
    recv = comm.all_to_all_single(full.contiguous(), rows, [rows[me]] * n, kind=kind)
    return recv.view(n, rows[me], *full.shape[1:]).sum(0)


class GatherRows(torch.autograd.Function):
    """All-gather uneven shares along ``dim``; backward reduce-scatters (sum convention)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, rows: Sequence[int], dim: int, kind: str):
        ctx.comm, ctx.rows, ctx.dim, ctx.kind = comm, list(rows), dim, kind
        parts = comm.all_gather_rows(x.movedim(dim, 0).contiguous(), rows, kind=kind)
        return torch.cat(parts, 0).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        d = reduce_scatter_rows(ctx.comm, g.movedim(ctx.dim, 0), ctx.rows, kind=ctx.kind + "_bwd")
        return d.movedim(0, ctx.dim), None, None, None, None


def gather_rows(x, comm: Comm, rows: Sequence[int], dim: int, kind: str = "all_gather"):
    if comm.world_size == 1:
        return x
    return GatherRows.apply(x, comm, list(rows), dim, kind)
