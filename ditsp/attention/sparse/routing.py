"""Routing front end: which key blocks each query block attends, per head (pure functions).

1. Mean-pool every block's queries and keys over its valid tokens.
2. Block logits ``pq @ pk^T * scale``; a row softmax weighted by key-block
   size (a block of n keys with the same score carries n times the mass):
   ``P[i, j] = n_j exp(s_ij) / sum_j' n_j' exp(s_ij')``.
3. **Top-p**: sort a row by mass, keep blocks until the kept mass reaches
   ``top_p`` (the crossing block is kept, so kept mass >= p).
4. **Top-k floor**: at least ``k_min`` blocks per row (flat rows of low
   concentration keep many, peaked rows would otherwise keep one).
5. Always kept: the diagonal block and, with ``keep_text``, every text key
   block (sinks); text query rows keep everything.

The cost of a mask is its selected token pairs ``sum mask[i, j] n_i n_j``.
:func:`augment` adds the next-best unselected blocks (by mass) to a mask
within a cost budget: the slack-filling step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockLayout
from .config import SparseConfig


@dataclass
class Routing:
    mask: torch.Tensor  # [..., nb, nb] bool
    probs: torch.Tensor  # [..., nb, nb] fp32 block mass per row
    row_cost: torch.Tensor  # [..., nb] float64 selected token pairs per query block

    @property
    def cost(self) -> torch.Tensor:
        """[...] selected token pairs per head."""
        return self.row_cost.sum(-1)


def pooled(xb: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[..., nb, block, D]`` -> ``[..., nb, D]`` mean over each block's valid tokens (fp32)."""
    return xb.float().sum(-2) / layout.counts.to(torch.float32)[:, None]


def block_probs(qb: torch.Tensor, kb: torch.Tensor, layout: BlockLayout, scale: float) -> torch.Tensor:
    """Row-softmax block mass ``[..., nb, nb]``, weighted by key-block valid counts."""
    s = pooled(qb, layout) @ pooled(kb, layout).transpose(-1, -2) * scale
    return torch.softmax(s + layout.counts.to(torch.float32).log(), dim=-1)


def top_p_mask(probs: torch.Tensor, top_p: float, k_min: int = 0) -> torch.Tensor:
    """Keep each row's highest-mass blocks until the kept mass >= ``top_p``, and at least ``k_min``."""
    sp, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = sp.cumsum(-1) - sp  # mass kept before this block
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep_sorted = (before < top_p) | (rank < k_min)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def forced_mask(layout: BlockLayout, cfg: SparseConfig) -> torch.Tensor:
    """``[nb, nb]`` blocks every head keeps (diagonal, text sinks, text rows)."""
    nb = layout.nblocks
    m = torch.zeros(nb, nb, dtype=torch.bool)
    if cfg.keep_diagonal:
        m |= torch.eye(nb, dtype=torch.bool)
    if cfg.keep_text:
        m[:, layout.is_text] = True
        m[layout.is_text, :] = True
    return m


def row_costs(mask: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[..., nb] selected token pairs per query block (float64)."""
    return (mask.to(torch.float64) * layout.pair_costs()).sum(-1)


def route(qb: torch.Tensor, kb: torch.Tensor, layout: BlockLayout, cfg: SparseConfig, scale: float) -> Routing:
    """Masks of blocked ``q``/``k`` ``[..., nb, block, D]`` (one per leading index, e.g. batch x head)."""
    probs = block_probs(qb, kb, layout, scale)
    mask = top_p_mask(probs, cfg.top_p, cfg.k_min) | forced_mask(layout, cfg)
    return Routing(mask, probs, row_costs(mask, layout))


def augment(routing: Routing, layout: BlockLayout, budget: float, rows: torch.Tensor | None = None) -> float:
    """Add unselected blocks by descending mass while their cost fits ``budget`` (in place).

    ``rows``: a bool ``[..., nb]`` of query rows that may grow (None: all).
    Greedy over one global order of candidates: a candidate that does not fit
    is skipped, later cheaper ones may still fit. Returns the cost added.
    """
    if budget <= 0:
        return 0.0
    cand = ~routing.mask
    if rows is not None:
        cand &= rows[..., None]
    vals = torch.where(cand, routing.probs, torch.full_like(routing.probs, -1.0)).reshape(-1)
    n = int(cand.sum())
    if n == 0:
        return 0.0
    top = torch.topk(vals, n, sorted=True).indices  # candidates by mass, highest first
    pair = layout.pair_costs().to(torch.float64)
    nb = layout.nblocks
    cost = pair.reshape(-1)[top % (nb * nb)]
    # Greedy with skips, in chunks: take a prefix that fits, then continue with what is left.
    take = torch.zeros(n, dtype=torch.bool)
    left = float(budget)
    start = 0
    while start < n and left > 0:
        c = cost[start:]
        fits = c.cumsum(0) <= left
        k = int(fits.sum()) if bool(fits[0]) else 0
        if k:
            take[start : start + k] = True
            left -= float(c[:k].sum())
            start += k
        # the next candidate does not fit: skip every candidate too big for what is left
        rest = torch.nonzero(cost[start:] <= left).reshape(-1)
        if rest.numel() == 0:
            break
        start += int(rest[0])
    chosen = top[take]
    flat = routing.mask.view(-1)
    flat[chosen] = True
    added = float(cost[take].sum())
    routing.row_cost = row_costs(routing.mask, layout)
    return added
