"""The small global-attention DiT block: same output and gradients single-device and under every strategy."""

from __future__ import annotations

import pytest
import torch

from ditsp.attention.common import even_splits, offsets
from ditsp.models.global_dit import GlobalDiTBlock
from tests.test_attention_sp import build

B, L, T, DIM, HEADS, KV = 1, 30, 6, 32, 4, 2


def setup(seed=0):
    torch.manual_seed(seed)
    block = GlobalDiTBlock(DIM, HEADS, KV)
    g = torch.Generator().manual_seed(seed + 1)
    text, video = torch.randn(B, T, DIM, generator=g), torch.randn(B, L, DIM, generator=g)
    gt, gv = torch.randn(B, T, DIM, generator=g), torch.randn(B, L, DIM, generator=g)
    return block, text, video, gt, gv


def cat(t, x, joint):
    return torch.cat([t, x], 1) if joint == "front" else torch.cat([x, t], 1)


def rank_block(ctx, strategy, U, R, joint):
    block, text, video, gt, gv = setup()
    o = offsets(even_splits(L, ctx.world_size))
    lo, hi = o[ctx.rank], o[ctx.rank + 1]
    x = cat(text, video[:, lo:hi], joint).requires_grad_()
    y = block(x, build(ctx, strategy, U, R), text_len=T, joint=joint)
    # Replicated text: its cotangent split over ranks, so parameter grads sum over ranks (sum convention).
    y.backward(cat(gt / ctx.world_size, gv[:, lo:hi], joint))
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


STRATEGIES = [("ulysses", 2, 1), ("ring", 1, 3), ("usp-ring", 2, 2), ("allgather", 1, 2), ("usp-allgather", 2, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("joint", ["front", "rear"])
@pytest.mark.parametrize("strategy,U,R", STRATEGIES, ids=[s for s, *_ in STRATEGIES])
def test_block_matches_single_device(clusters, strategy, U, R, joint):
    block, text, video, gt, gv = setup()
    x = cat(text, video, joint).requires_grad_()
    y = block(x)
    y.backward(cat(gt, gv, joint))
    ref_params = {n: p.grad for n, p in block.named_parameters()}

    res = clusters(U * R).run(rank_block, strategy, U, R, joint)
    split = (lambda t: (t[:, :T], t[:, T:])) if joint == "front" else (lambda t: (t[:, t.shape[1] - T :], t[:, : t.shape[1] - T]))
    ys, gs = [split(r[0]) for r in res], [split(r[1]) for r in res]
    for t, _ in ys:
        torch.testing.assert_close(t, ys[0][0], rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cat(ys[0][0], torch.cat([v for _, v in ys], 1), joint), y.detach(), **tol)
    dx = cat(sum(t for t, _ in gs), torch.cat([v for _, v in gs], 1), joint)
    torch.testing.assert_close(dx, x.grad, **tol)
    for name, want in ref_params.items():
        torch.testing.assert_close(sum(r[2][name] for r in res), want, rtol=1e-5, atol=5e-5, msg=name)
