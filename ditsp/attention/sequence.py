"""Public sequence helpers: cut a replicated sequence into per-rank shards, and put it back together.

The shard layout is the one every global-attention strategy here takes: SP
rank ``r`` holds the ``r``-th contiguous share of ``even_splits(n, P)`` (shares
differ by at most one row, larger first), so any length works on any degree,
also fewer rows than ranks (some ranks then hold none).

Gradient convention (what makes a parallelized model train like one device):

- :func:`shard` backward returns a full-size gradient that is zero outside
  this rank's rows. The true gradient of the replicated input is the *sum over
  the SP ranks* of these (the sum convention of ``ditsp.attention.common``).
- :func:`gather` with ``grad="replicated"`` (the default) assumes every rank
  back-propagates the same cotangent of the full output (the same loss
  computed on every rank); each rank keeps its own rows of it, no
  communication. ``grad="partial"`` is for cotangents that are per-rank
  partial sums: the backward sums them over ranks (one reduce-scatter).

With both defaults, a parameter used on every rank ends with a per-rank
gradient whose sum over the SP group is the single-device gradient; sum them
(:func:`ditsp.integrations.diffusers.reduce_gradients`, or any all-reduce)
before an optimizer step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..distributed.comm import Comm
from .common import even_splits, gather_rows, offsets
from .common import gather_lens


def _comm(group) -> Comm:
    return group if isinstance(group, Comm) else Comm.of(group)


def splits(n: int, group=None) -> list[int]:
    """Rows of every rank for a sequence of ``n`` rows on ``group`` (a process group, a Comm or None)."""
    return even_splits(int(n), _comm(group).world_size)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, lo: int, hi: int):
        ctx.dim, ctx.lo, ctx.n = dim, lo, x.shape[dim]
        return x.narrow(dim, lo, hi - lo).contiguous()

    @staticmethod
    def backward(ctx, g):
        shape = list(g.shape)
        shape[ctx.dim] = ctx.n
        full = g.new_zeros(shape)
        full.narrow(ctx.dim, ctx.lo, g.shape[ctx.dim]).copy_(g)
        return full, None, None, None


def shard(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """This rank's contiguous share of the replicated ``x`` along ``dim`` (no communication).

    Backward: zeros outside this rank's rows (sum over ranks = the true gradient).
    """
    comm = _comm(group)
    dim = dim % x.dim()
    if comm.world_size == 1:
        return x
    o = offsets(even_splits(x.shape[dim], comm.world_size))
    return _Shard.apply(x, dim, o[comm.rank], o[comm.rank + 1])


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, rows: Sequence[int], dim: int):
        ctx.dim, ctx.lo, ctx.n = dim, offsets(rows)[comm.rank], x.shape[dim]
        parts = comm.all_gather_rows(x.movedim(dim, 0).contiguous(), rows, kind="sequence_gather")
        return torch.cat(parts, 0).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.narrow(ctx.dim, ctx.lo, ctx.n).contiguous(), None, None, None


def gather(x: torch.Tensor, dim: int = 1, group=None, seq_lens: Sequence[int] | None = None,
           grad: str = "replicated") -> torch.Tensor:
    """The full sequence on every rank from each rank's share ``x`` along ``dim`` (one all-gather).

    ``seq_lens``: every rank's share (default: the :func:`shard` layout, found with one tiny
    all-gather of lengths). ``grad``: ``"replicated"`` (every rank's cotangent is the same; keep
    this rank's rows) or ``"partial"`` (per-rank partial cotangents; sum them by a reduce-scatter).
    """
    if grad not in ("replicated", "partial"):
        raise ValueError(f"grad must be 'replicated' or 'partial', got {grad!r}")
    comm = _comm(group)
    dim = dim % x.dim()
    if comm.world_size == 1:
        return x
    if seq_lens is None:
        seq_lens = gather_lens(comm, x.shape[dim])
    rows = [int(n) for n in seq_lens]
    if len(rows) != comm.world_size or rows[comm.rank] != x.shape[dim]:
        raise ValueError(f"rank {comm.rank} holds {x.shape[dim]} rows along dim {dim}, seq_lens says {rows}")
    if grad == "partial":
        return gather_rows(x, comm, rows, dim, kind="sequence_gather")
    return _GatherReplicated.apply(x, comm, rows, dim)
