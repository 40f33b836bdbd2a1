"""Autograd across an SP group: the gradient rules of the collectives a window model's forward makes.

Convention (the one tensor-parallel training uses): a tensor every rank holds
whole (replicated: parameters, text, the time embedding) carries on each rank
only that rank's *partial* gradient, the contribution of the rows and windows
it computed; the true gradient is the sum over ranks. Two consequences:

- the text reduction (a SUM all-reduce of per-rank window sums) reduces its
  gradient again in the backward (:func:`all_reduce_sum`): the gradient of a
  replicated output is partial, and every rank's local sum needs the total;
- the output gather (every rank gets every row; the loss is then computed
  identically on every rank, i.e. once) needs no communication backward:
  each rank keeps its own rows' gradient (:func:`replicated_gather`).

Parameters' partial gradients are summed after the backward by
:func:`reduce_gradients`, in rank order (one fixed order, the same bits on
every rank and every run).

The autograd engine runs a rank's backward nodes in reverse creation order,
so every rank issues the backward collectives in the same order, provided
every collective node is reachable from the loss on every rank: a rank with
no window in a layer connects its (empty) outputs to its text inputs with a
zero (:func:`connect_empty`), so its reduction nodes stay in the graph.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .comm import Comm


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Comm, kind: str, x: torch.Tensor, anchor: torch.Tensor):
        ctx.comm, ctx.kind = comm, kind
        # Saved so that, inside an activation-checkpointed block, this node's backward unpacks a
        # tensor and so triggers the block's recomputation before its own collective.
        ctx.save_for_backward(anchor.detach()[:0])
        return comm.all_reduce(x.detach().clone().contiguous(), kind=kind)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        total = ctx.comm.all_reduce_ordered(g.contiguous(), kind=ctx.kind + "_bwd")
        return None, None, total, None


def all_reduce_sum(comm: Comm, x: torch.Tensor, anchor: torch.Tensor | None = None,
                   kind: str = "all_reduce") -> torch.Tensor:
    """SUM all-reduce that autograd sees; ``anchor`` (any tensor of the graph) keeps the node in the
    graph on a rank whose ``x`` does not require grad (no local window). Outside autograd: the plain call."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or (anchor is not None and anchor.requires_grad))
    if not tracked or comm.world_size == 1:
        if tracked:
            return x if anchor is None or x.requires_grad else x + 0 * anchor.sum().to(x.dtype)
        return comm.all_reduce(x.contiguous(), kind=kind)
    if not x.requires_grad:
        x = x + 0 * anchor.sum().to(x.dtype)
    anchor = anchor if anchor is not None else x
    return _AllReduceSum.apply(comm, kind, x, anchor)


class _ReplicatedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, own: torch.Tensor, y: torch.Tensor):
        ctx.own = own
        with torch.no_grad():
            return fn(y.detach())

    @staticmethod
    def backward(ctx, g):
        return None, None, g.index_select(0, ctx.own.to(g.device))


def replicated_gather(fn: Callable[[torch.Tensor], torch.Tensor], y_local: torch.Tensor,
                      own_ids: torch.Tensor) -> torch.Tensor:
    """``fn(y_local)`` (a gather of every rank's rows to canonical order), differentiable: the gradient
    of this rank's rows is the output gradient at ``own_ids`` (their canonical positions)."""
    if not (torch.is_grad_enabled() and y_local.requires_grad):
        return fn(y_local)
    return _ReplicatedGather.apply(fn, own_ids, y_local)


def connect_empty(out: torch.Tensor, txt: torch.Tensor | None, *inputs: torch.Tensor | None):
    """``out`` and ``txt`` plus zero times the ``inputs``: keeps a rank with no window in the graph."""
    if not torch.is_grad_enabled():
        return out, txt
    live = [t for t in inputs if t is not None and t.requires_grad]
    if not live:
        return out, txt
    zero = sum(t.sum() for t in live) * 0
    out = out + zero.to(out.dtype)
    if txt is not None:
        txt = txt + zero.to(txt.dtype)
    return out, txt


@torch.no_grad()
def reduce_gradients(comm: Comm, params: Iterable[torch.nn.Parameter], kind: str = "grad_all_reduce") -> None:
    """Sum every parameter's partial gradient over the group, in rank order, in place.

    Flattened per dtype into one buffer (one collective per dtype); a parameter without a
    gradient counts as zeros, so every rank sends the same layout."""
    params = [p for p in params if p.requires_grad]
    if comm.world_size == 1 or not params:
        return
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        total = comm.all_reduce_ordered(flat, kind=kind)
        offset = 0
        for p in group:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p).clone()
            offset += n
