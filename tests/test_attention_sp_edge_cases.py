"""Global-attention SP hardening: fewer heads than ranks, and ranks that disagree on the call."""

from __future__ import annotations

import pytest
import torch

from ditsp.attention import Ulysses
from ditsp.attention.common import even_splits
from ditsp.distributed.agree import DisagreementError

from .test_attention_sp import check

# B, L, H, Hkv, D, text: some Ulysses ranks hold no head at all.
ZERO_HEAD_CASES = [
    ("ulysses", 2, 1, (1, 12, 1, 1, 8, 0)),  # H=1 at SP=2
    ("ulysses", 3, 1, (1, 12, 2, 2, 8, 3)),  # H=2 at SP=3, joint text
    ("usp-allgather", 2, 2, (1, 12, 1, 1, 8, 3)),  # USP-AllGather 2x2 with H=1
    ("usp-ring", 2, 2, (1, 13, 1, 1, 8, 2)),
    ("ulysses-stacked", 3, 1, (1, 10, 2, 1, 8, 2)),  # MQA, Q/K/V in one stacked exchange
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R,shape", ZERO_HEAD_CASES,
                         ids=[f"{s}-{u}x{r}-H{sh[2]}" for s, u, r, sh in ZERO_HEAD_CASES])
def test_fewer_heads_than_ranks_matches_sdpa(clusters, strategy, U, R, shape):
    results = check(clusters, strategy, U, R, shape)
    # The zero-head rank still took part in every all-to-all (forward and backward).
    calls = [r["stats"].get("ulysses_a2a", {}).get("calls") for r in results]
    assert len(set(calls)) == 1


def rank_mismatch(ctx, what):
    """Call Ulysses with inputs that differ on rank 1 in ``what``; the error this rank got."""
    heads, dim, dtype = 4, 8, torch.float32
    if ctx.rank == 1:
        heads = 2 if what == "heads" else heads
        dim = 16 if what == "head_dim" else dim
        dtype = torch.bfloat16 if what == "dtype" else dtype
    backend = "reference" if what == "backend" and ctx.rank == 1 else None
    lens = even_splits(12, ctx.world_size)
    q = torch.randn(1, lens[ctx.rank], heads, dim, dtype=dtype)
    seq_lens = None
    if what == "seq_lens":  # every rank says [6, 6], but rank 1 holds 5 tokens
        seq_lens = [6, 6]
        q = torch.randn(1, 5 if ctx.rank == 1 else 6, heads, dim)
    attn = Ulysses(ctx.group, backend=backend)
    try:
        attn(q, q, q, seq_lens=seq_lens)
    except (DisagreementError, ValueError) as e:
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,field", [("heads", "heads"), ("head_dim", "head_dim"), ("dtype", "dtype"),
                                        ("backend", "backend")])
def test_disagreement_raises_on_every_rank(clusters, what, field):
    res = clusters(2).run(rank_mismatch, what, timeout_s=30)
    for kind, msg in res:
        assert kind == "DisagreementError"
        first = msg.splitlines()[0]
        assert first.startswith("ranks disagree on the ulysses attention call") and field in first
    assert res[0] == res[1]  # the same message on every rank
    # The cluster is still usable: nobody was left inside a collective.
    assert clusters(2).run(rank_mismatch, "none", timeout_s=30) == [(None, None)] * 2


@pytest.mark.timeout(60)
def test_bad_local_lengths_raise_on_every_rank(clusters):
    res = clusters(2).run(rank_mismatch, "seq_lens", timeout_s=30)
    for kind, msg in res:
        assert kind == "ValueError"
        assert "bad input on rank 1" in msg.splitlines()[0] and "seq_lens says 6" in msg


def rank_cached(ctx):
    attn = Ulysses(ctx.group)
    calls = []
    for length in (6, 6, 7, 6):  # the agreement runs for new signatures only (lengths are not in it)
        q = torch.randn(1, length, 4, 8)
        attn(q, q, q)
        calls.append(attn.stats.kinds["all_gather_object"].calls)
    q = torch.randn(2, 6, 4, 8)  # a new batch size: a new signature
    attn(q, q, q)
    calls.append(attn.stats.kinds["all_gather_object"].calls)
    return calls


@pytest.mark.timeout(60)
def test_agreement_is_cached_per_signature(clusters):
    assert clusters(2).run(rank_cached, timeout_s=30) == [[1, 1, 1, 1, 2]] * 2
