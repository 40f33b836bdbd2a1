"""Sparse attention under Ulysses: migration changes nothing but who computes; plans agree; configs agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditsp.attention.common import even_splits
from ditsp.attention.sparse import SparseConfig, SparseUlysses, plan_migrations
from ditsp.attention.ulysses import head_plan
from ditsp.bench.sparse import video_qkv
from ditsp.distributed.agree import DisagreementError
from ditsp.models.global_dit import GlobalDiTBlock

GRID, T, D = (4, 8, 8), 5, 16
CFG = dict(cube=(2, 4, 4), top_p=0.6, k_min=2, slack=False, rows_per_step=7)


def shard(x, P, r):
    """Rank r's [text; video shard] of a full [B, T+L, H, D] tensor."""
    lens = even_splits(x.shape[1] - T, P)
    lo = T + sum(lens[:r])
    return torch.cat([x[:, :T], x[:, lo : lo + lens[r]]], 1), lens


def rank_sparse(ctx, heads, kv_heads, cfgs):
    q, k, v = video_qkv(GRID, heads, D, T, batch=2, seed=3)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    out = {}
    for name, kw in cfgs.items():
        attn = SparseUlysses(ctx.group, GRID, SparseConfig(**kw))
        (qs, lens), (ks, _), (vs, _) = (shard(x, ctx.world_size, ctx.rank) for x in (q, k, v))
        with torch.no_grad():
            out[name] = (attn(qs, ks, vs, text_len=T, seq_lens=lens), attn.reports[-1])
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P,heads,kv_heads", [(2, 6, 6), (3, 7, 7), (4, 6, 3)])
def test_migration_matches_no_migration_and_single_device(clusters, P, heads, kv_heads):
    q, k, v = video_qkv(GRID, heads, D, T, batch=2, seed=3)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    with torch.no_grad():
        ref = SparseUlysses(None, GRID, SparseConfig(**CFG))(q, k, v, text_len=T)
    cfgs = {"moved": dict(CFG, max_moves=8, min_gain=0.0), "still": dict(CFG, balance=False)}
    res = clusters(P).run(rank_sparse, heads, kv_heads, cfgs)
    lens = even_splits(q.shape[1] - T, P)
    for name in cfgs:
        outs = [r[name][0] for r in res]
        for o in outs[1:]:
            torch.testing.assert_close(o[:, :T], outs[0][:, :T], rtol=0, atol=0)  # same text output everywhere
        full = torch.cat([outs[0][:, :T]] + [o[:, T:] for o in outs], 1)
        assert [o.shape[1] - T for o in outs] == lens
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5, msg=name)
    reps = [r["moved"][1] for r in res]
    assert reps[0]["moves"] > 0, "the test inputs should make the plan move work"
    for rep in reps:  # every rank derived the same plan, and it did not lengthen the critical path
        assert rep["plan"] == reps[0]["plan"] and rep["loads_after"] == reps[0]["loads_after"]
        assert rep["critical_after"] <= rep["critical_before"]
        assert rep["imbalance_after"] < rep["imbalance_before"]
    assert sum(r["bytes_moved"] for r in reps) > 0
    assert all(r["still"][1]["moves"] == 0 for r in res)


def rank_slack(ctx):
    q, k, v = video_qkv(GRID, 6, D, T, batch=1, seed=3)
    (qs, lens), (ks, _), (vs, _) = (shard(x, ctx.world_size, ctx.rank) for x in (q, k, v))
    attn = SparseUlysses(ctx.group, GRID, SparseConfig(**dict(CFG, slack=True)))
    with torch.no_grad():
        attn(qs, ks, vs, text_len=T, seq_lens=lens)
    return attn.reports[-1]


@pytest.mark.timeout(120)
def test_slack_fills_up_to_the_critical_path(clusters):
    reps = clusters(2).run(rank_slack)
    for rep in reps:
        assert 0 <= rep["slack_filled"] <= rep["slack_available"] + 1e-6
        assert rep["loads_after"][0] * 0 + max(rep["loads_after"]) == rep["critical_after"]


def rank_mismatch(ctx):
    top_p = 0.5 if ctx.rank == 0 else 0.6
    attn = SparseUlysses(ctx.group, GRID, SparseConfig(cube=(2, 4, 4), top_p=top_p))
    x = torch.randn(1, T + 128 // ctx.world_size, 4, D)
    try:
        with torch.no_grad():
            attn(x, x, x, text_len=T)
    except DisagreementError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_mismatched_sparsity_configs_raise_on_every_rank(clusters):
    msgs = clusters(2).run(rank_mismatch)
    assert all(m and "top_p" in m for m in msgs)


def test_plan_is_pure_and_never_worsens_the_critical_path():
    rng = np.random.default_rng(0)
    for trial in range(40):
        H, P = int(rng.integers(1, 20)), int(rng.integers(2, 9))
        costs = rng.gamma(1.0, 1.0, (H, 1)) * rng.random((H, int(rng.integers(1, 30))))
        for split in (True, False):
            cfg = SparseConfig(split_heads=split, min_gain=0.0)
            p = plan_migrations(costs, head_plan(H, H, P).q, cfg)
            assert p == plan_migrations(costs.copy(), head_plan(H, H, P).q, cfg)
            assert p.critical_after <= p.critical_before
            assert abs(sum(p.loads_after) - sum(p.loads_before)) < 1e-6 * max(1.0, sum(p.loads_before))
            if p.moves:
                assert p.critical_after < p.critical_before
            for m in p.moves:
                assert split or (m.lo == 0 and m.hi == costs.shape[1])


def test_global_dit_block_runs_sparse_and_full_mask_matches_dense():
    torch.manual_seed(0)
    block = GlobalDiTBlock(32, 4, 2)
    x = torch.randn(1, T + 256, 32)
    with torch.no_grad():
        dense = block(x, text_len=T)
        full = block(x, attn=SparseUlysses(None, GRID, SparseConfig(cube=(2, 4, 4), top_p=1.0)), text_len=T)
        sparse_attn = SparseUlysses(None, GRID, SparseConfig(cube=(2, 4, 4), top_p=0.5))
        sparse = block(x, attn=sparse_attn, text_len=T)
    torch.testing.assert_close(full, dense, rtol=1e-5, atol=1e-5)
    assert sparse_attn.reports[-1]["density"] < 1.0 and torch.isfinite(sparse).all()
