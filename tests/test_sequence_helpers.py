"""Public shard/gather (values moved, never recomputed: exact) and the layout= argument of Ring/USP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditsp.attention import LAYOUTS, USP, Ring, gather, shard, splits
from ditsp.attention.common import even_splits, offsets
from ditsp.config import ParallelConfig
from ditsp.distributed.groups import build_sp_groups


def _round_trip(ctx, n, grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, 3, generator=g, dtype=torch.float64).requires_grad_()
    cot = torch.randn(2, n, 3, generator=g, dtype=torch.float64)
    local = shard(x, 1, ctx.group)
    full = gather(local * 2, 1, ctx.group, grad=grad)
    (dx,) = torch.autograd.grad(full, x, cot)
    return local.shape[1], torch.equal(full, 2 * x.detach()), dx, splits(n, ctx.group)


@pytest.mark.parametrize("n", [7, 2])  # uneven shares; fewer rows than ranks (one rank holds none)
def test_shard_gather_round_trip_and_gradients(clusters, n):
    res = clusters(3).run(_round_trip, n, "replicated")
    assert [r[0] for r in res] == even_splits(n, 3) == res[0][3]
    assert all(r[1] for r in res)
    # replicated cotangent: each rank's dx is the cotangent on its own rows, zero elsewhere; the sum is exact
    g = torch.Generator().manual_seed(0)
    torch.randn(2, n, 3, generator=g, dtype=torch.float64)
    cot = torch.randn(2, n, 3, generator=g, dtype=torch.float64)
    o = offsets(even_splits(n, 3))
    for r, (_, _, dx, _) in enumerate(res):
        want = torch.zeros_like(cot)
        want[:, o[r]:o[r + 1]] = 2 * cot[:, o[r]:o[r + 1]]
        assert torch.equal(dx, want)
    assert torch.equal(sum(r[2] for r in res), 2 * cot)


def test_gather_partial_sums_the_cotangents(clusters):
    res = clusters(2).run(_round_trip, 5, "partial")
    g = torch.Generator().manual_seed(0)
    torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    # each rank's rows get the cotangent summed over both ranks (2 ranks x the same cotangent)
    torch.testing.assert_close(sum(r[2] for r in res), 2 * 2 * cot, rtol=0, atol=1e-12)


def test_gather_rejects_an_unknown_convention():
    with pytest.raises(ValueError, match="replicated"):
        gather(torch.zeros(1, 2), grad="mean")


def test_layout_must_be_known():
    assert LAYOUTS == ("contiguous", "zigzag")
    with pytest.raises(ValueError, match="layout must be one of contiguous, zigzag"):
        Ring(None, layout="striped")


def _zigzag(ctx, causal, strategy):
    """Rank r holds chunks r and 2P-1-r of 2P (zigzag); returns this rank's rows of the output or the error."""
    P = ctx.world_size
    g = torch.Generator().manual_seed(3)
    L = 4 * P
    q, k, v = (torch.randn(1, L, 2, 8, generator=g) for _ in range(3))
    c = L // (2 * P)
    rows = list(range(ctx.rank * c, (ctx.rank + 1) * c)) + list(range((2 * P - 1 - ctx.rank) * c, (2 * P - ctx.rank) * c))
    if strategy == "ring":
        attn = Ring(ctx.group, layout="zigzag")
    else:
        cfg = ParallelConfig(ulysses_degree=1, ring_degree=P)
        attn = USP(cfg, build_sp_groups(cfg, ctx.group), layout="zigzag")
    try:
        out = attn(q[:, rows], k[:, rows], v[:, rows], causal=causal)
    except ValueError as e:
        return "refused", str(e)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal).transpose(1, 2)
    return "ran", (out - ref[:, rows]).abs().max().item()


@pytest.mark.parametrize("strategy", ["ring", "usp"])
def test_zigzag_causal_is_refused_and_non_causal_is_right(clusters, strategy):
    refused = clusters(2).run(_zigzag, True, strategy)
    assert all(r[0] == "refused" and "zigzag" in r[1] for r in refused), refused  # every rank, no hang
    ran = clusters(2).run(_zigzag, False, strategy)
    assert all(r[0] == "ran" and r[1] < 1e-5 for r in ran), ran  # order does not matter without a mask
