"""Sparse attention front end and kernel: Top-p / Top-k rules, full mask == dense, masked equality, forward only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditsp.attention.sparse import SparseConfig, SparseUlysses, block_layout, block_sparse_attention, route, top_p_mask
from ditsp.attention.sparse.routing import augment


def test_top_p_keeps_the_crossing_block_and_the_floor():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05],   # p=0.7: 0.5 < 0.7, 0.8 crosses -> keep 2
                          [0.1, 0.2, 0.6, 0.1],     # 0.6 < 0.7 -> keep 0.6 and 0.2 (crossing)
                          [0.7, 0.1, 0.1, 0.1]])    # exactly 0.7 reached by the first: keep 1
    m = top_p_mask(probs, 0.7)
    assert m.tolist() == [[True, True, False, False], [False, True, True, False], [True, False, False, False]]
    for row, keep in zip(probs, m):
        assert row[keep].sum() >= 0.7 - 1e-6
    floor = top_p_mask(probs, 0.7, k_min=3)
    assert floor.sum(-1).tolist() == [3, 3, 3]
    assert floor[2].tolist() == [True, True, True, False]  # ties broken by position (stable)
    assert top_p_mask(probs, 1.0).all()


def test_layout_cubes_edges_and_text():
    lay = block_layout((5, 6, 7), (2, 4, 4), text_len=11)
    assert lay.block == 32 and lay.text_blocks == 1
    assert int(lay.counts.sum()) == lay.tokens == 11 + 5 * 6 * 7
    assert int(lay.counts[1]) == 32 and int(lay.counts[-1]) == 1 * 2 * 3  # a corner cube is partial
    x = torch.randn(2, lay.tokens, 3)
    assert torch.equal(lay.from_blocks(lay.to_blocks(x)), x)
    # A full interior cube holds a 2x4x4 box of the grid.
    first = lay.idx[1] - 11
    t, h, w = first // 42, (first // 7) % 6, first % 7
    assert set(t.tolist()) == {0, 1} and set(h.tolist()) == {0, 1, 2, 3} and set(w.tolist()) == {0, 1, 2, 3}


def _inputs(seed=0, B=2, H=3, D=16):
    lay = block_layout((5, 6, 7), (2, 4, 4), text_len=11)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, lay.tokens, D, generator=g) for _ in range(3))
    return lay, q, k, v


def _token_mask(lay, mask):
    bid = torch.empty(lay.tokens, dtype=torch.long)
    bid[lay.idx[lay.valid]] = torch.arange(lay.nblocks).repeat_interleave(lay.counts)
    return mask[..., bid[:, None], bid[None, :]]


@pytest.mark.parametrize("impl", ["sdpa", "online"])
def test_full_mask_is_dense(impl):
    lay, q, k, v = _inputs()
    full = torch.ones(2, 3, lay.nblocks, lay.nblocks, dtype=torch.bool)
    with torch.no_grad():
        o = block_sparse_attention(*(lay.to_blocks(x) for x in (q, k, v)), full, lay.valid, 0.25, 5, 3, impl)
    torch.testing.assert_close(lay.from_blocks(o), F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "online"])
@pytest.mark.parametrize("top_p,k_min", [(0.3, 0), (0.6, 2), (0.9, 4)])
def test_block_sparse_equals_masked_dense(impl, top_p, k_min):
    lay, q, k, v = _inputs(1)
    qb, kb, vb = (lay.to_blocks(x) for x in (q, k, v))
    r = route(qb, kb, lay, SparseConfig(cube=(2, 4, 4), top_p=top_p, k_min=k_min), 0.25)
    assert r.mask.diagonal(dim1=-2, dim2=-1).all() and r.mask[..., 0].all() and r.mask[..., 0, :].all()
    assert (r.mask.sum(-1) >= min(k_min, lay.nblocks)).all()
    with torch.no_grad():
        o = lay.from_blocks(block_sparse_attention(qb, kb, vb, r.mask, lay.valid, 0.25, 7, 2, impl))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_token_mask(lay, r.mask), scale=0.25)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)  # per head: masks differ between heads


def test_augment_stays_within_budget_and_adds_best_blocks():
    lay, q, k, v = _inputs(2)
    qb, kb = lay.to_blocks(q), lay.to_blocks(k)
    r = route(qb, kb, lay, SparseConfig(cube=(2, 4, 4), top_p=0.3), 0.25)
    m0, c0 = r.mask.clone(), float(r.cost.sum())
    budget = 0.1 * c0
    added = augment(r, lay, budget)
    assert 0 < added <= budget and abs(float(r.cost.sum()) - c0 - added) < 1e-6
    assert (r.mask | ~m0).all()  # only additions


def test_gradients_are_refused():
    lay, q, k, v = _inputs()
    qb, kb, vb = (lay.to_blocks(x).requires_grad_() for x in (q, k, v))
    with pytest.raises(RuntimeError, match="forward-only"):
        block_sparse_attention(qb, kb, vb, torch.ones(2, 3, lay.nblocks, lay.nblocks, dtype=torch.bool), lay.valid, 0.25)
    attn = SparseUlysses(None, (5, 6, 7), SparseConfig(cube=(2, 4, 4)))
    x = torch.randn(1, 11 + 210, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward-only"):
        attn(x, x, x, text_len=11)


def test_config_is_checked():
    with pytest.raises(ValueError, match="top_p"):
        SparseConfig(top_p=0.0)
    with pytest.raises(ValueError, match="cube"):
        SparseConfig(cube=(4, 4))
