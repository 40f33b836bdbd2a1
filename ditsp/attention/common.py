"""Pieces shared by the global-attention SP strategies.

Layouts: strategies take and return ``[B, L, H, D]`` (sequence-major, as a
DiT block holds its tokens); compute happens in ``[B, H, S, D]``.

Block attention returns a *real* log-sum-exp, so partial results over K/V
blocks (ring steps, text block) merge exactly (in fp32). The backward is the
flash-attention one: with the final output and LSE saved, every K/V block's
gradients are computed independently, which is what lets ring backward pass
dK/dV around instead of rebuilding the full matrix. Block calls go through
the fused kernels of :mod:`ditsp.attention.kernels`; :func:`attn_fwd` and
:func:`attn_bwd` here are the pure-torch reference (fp32 score chunks) that
the ``reference`` backend runs for whatever no kernel takes.

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
from .kernels import grouped, ungrouped

# Bound on fp32 score elements materialised at once (query rows are chunked).
SCORE_ELEMS = 1 << 22


# -- uneven splits ----------------------------------------------------------


def even_splits(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous shares differing by at most one (larger first)."""
    if parts < 1 or n < 0:
        raise ValueError(f"cannot split {n} into {parts} parts")
    q, r = divmod(n, parts)
    return [q + (i < r) for i in range(parts)]


def offsets(splits: Sequence[int]) -> list[int]:
    """Start of every share, plus the total at the end."""
    out = [0]
    for s in splits:
        out.append(out[-1] + int(s))
    return out


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


_grouped, _ungrouped = grouped, ungrouped  # GQA query heads as rows of their K/V head, no K/V copy


def _chunks(rows: int, cols: int, heads: int):
    step = max(1, SCORE_ELEMS // max(1, cols * heads))
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def _causal_mask(i: int, j: int, sk: int, groups: int, device) -> torch.Tensor:
    """True where grouped query rows ``[i, j)`` (``groups`` heads' rows stacked) must not see a key."""
    pos = torch.arange(i, j, device=device).repeat(groups)
    return pos[:, None] < torch.arange(sk, device=device)[None, :]


def attn_fwd(q, k, v, scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention of ``q`` [B,H,Sq,D] on one K/V block [B,Hkv,Sk,D] (H % Hkv == 0, contiguous groups).

    Returns ``(out, lse)`` in fp32: out [B,H,Sq,Dv], lse [B,H,Sq] = logsumexp of the scaled scores.
    ``causal``: query row i sees keys 0..i.
    """
    b, h, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if h == 0 or hk == 0:  # a Ulysses rank holding no heads (fewer heads than ranks)
        if h != hk:
            raise ValueError(f"{h} query heads cannot attend to {hk} K/V heads")
        return (q.new_zeros((b, 0, sq, v.shape[-1]), dtype=torch.float32),
                q.new_zeros((b, 0, sq), dtype=torch.float32))
    if h % hk:
        raise ValueError(f"{h} query heads do not group onto {hk} K/V heads")
    out = q.new_empty((b, h, sq, v.shape[-1]), dtype=torch.float32)
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    kf, vf = k.float(), v.float()
    for i, j in _chunks(sq, sk, h):
        qc = _grouped(q[:, :, i:j].float(), hk)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i, j, sk, h // hk, s.device), float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l.unsqueeze(-1))
        out[:, :, i:j] = _ungrouped(torch.matmul(p, vf), h)
        lse[:, :, i:j] = _ungrouped(l, h)
    return out, lse


def attn_bwd(q, k, v, lse, delta, dout, scale: float, causal: bool = False):
    """Reference gradients of one K/V block given the *final* ``lse`` and ``delta = rowsum(dout * out)``.

    Returns fp32 ``(dq, dk, dv)``; dk/dv sum over the query heads of each group.
    """
    h, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if h == 0 or hk == 0:  # a rank holding no heads: nothing to differentiate
        return (torch.zeros(q.shape, dtype=torch.float32), torch.zeros(k.shape, dtype=torch.float32),
                torch.zeros(v.shape, dtype=torch.float32))
    kf, vf, lse, delta = k.float(), v.float(), lse.float(), delta.float()
    dq = torch.empty(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for i, j in _chunks(sq, sk, h):
        qc = _grouped(q[:, :, i:j].float(), hk)
        do = _grouped(dout[:, :, i:j].float(), hk)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i, j, sk, h // hk, s.device), float("-inf"))
        p = torch.exp(s - _grouped(lse[:, :, i:j, None], hk))
        dv += torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, vf.transpose(-1, -2))
        ds = p * (dp - _grouped(delta[:, :, i:j, None], hk)) * scale
        dq[:, :, i:j] = _ungrouped(torch.matmul(ds, kf), h)
        dk += torch.matmul(ds.transpose(-1, -2), qc)
    return dq, dk, dv


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
