"""Ulysses, Ring, USP and AllGather-KV against single-device SDPA: outputs and input gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditsp.attention import AllGatherKV, Ring, SPAttention, Ulysses
from ditsp.attention.common import even_splits, offsets
from ditsp.config import ParallelConfig
from ditsp.distributed.groups import build_sp_groups

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(B, L, H, Hk, D, T, dtype, seed=0):
    """Full video q/k/v [B,L,H,D], text q/k/v [B,T,H,D] and cotangents, identical on every process."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DT[dtype])  # noqa: E731
    video = [r(B, L, H, D), r(B, L, Hk, D), r(B, L, Hk, D)]
    text = [r(B, T, H, D), r(B, T, Hk, D), r(B, T, Hk, D)]
    return video, text, r(B, L, H, D), r(B, T, H, D)


def build(ctx, strategy, U, R, backend=None):
    if strategy == "ulysses":
        return Ulysses(ctx.group, backend=backend)
    if strategy == "ulysses-stacked":
        return Ulysses(ctx.group, stacked=True, backend=backend)
    if strategy == "ring":
        return Ring(ctx.group, backend=backend)
    if strategy == "allgather":
        return AllGatherKV(ctx.group, backend=backend)
    cfg = ParallelConfig(ulysses_degree=U, ring_degree=R, use_allgather=strategy == "usp-allgather", advanced_uaa=True)
    return SPAttention.from_config(cfg, build_sp_groups(cfg, ctx.group), backend=backend)


def rank_run(ctx, strategy, U, R, shape, joint, dtype, lens=None, backend=None, causal=False):
    """This rank's output and input gradients for its joined [text; video shard] tokens."""
    B, L, H, Hk, D, T = shape
    attn = build(ctx, strategy, U, R, backend)
    (vq, vk, vv), (tq, tk, tv), gv, gt = make_inputs(B, L, H, Hk, D, T, dtype)
    given, lens = lens, lens or even_splits(L, ctx.world_size)
    o = offsets(lens)
    lo, hi = o[ctx.rank], o[ctx.rank + 1]
    join = (lambda t, x: torch.cat([t, x], 1)) if joint == "front" else (lambda t, x: torch.cat([x, t], 1))
    q, k, v = (join(t, x[:, lo:hi]).requires_grad_() for t, x in ((tq, vq), (tk, vk), (tv, vv)))
    out = attn(q, k, v, text_len=T, joint=joint, seq_lens=given, causal=causal)  # seq_lens None: gathered
    # Sum convention: the replicated text output's cotangent is split over the ranks.
    g = join((gt.float() / ctx.world_size).to(gt.dtype), gv[:, lo:hi])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return {"out": out.detach(), "grads": (dq, dk, dv), "stats": attn.stats.as_dict(),
            "backend": attn.backend, "reason": attn.backend_reason}


def reference(shape, joint, dtype, precise=False, causal=False):
    B, L, H, Hk, D, T = shape
    (vq, vk, vv), (tq, tk, tv), gv, gt = make_inputs(B, L, H, Hk, D, T, dtype)
    cat = (lambda t, x: torch.cat([t, x], 1)) if joint == "front" else (lambda t, x: torch.cat([x, t], 1))
    xs = [cat(t, x) for t, x in ((tq, vq), (tk, vk), (tv, vv))]
    g = cat(gt, gv)
    if precise:
        xs, g = [x.double() for x in xs], g.double()
    xs = [x.requires_grad_() for x in xs]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in xs), enable_gqa=True,
                                         is_causal=causal).transpose(1, 2)
    return out.detach(), torch.autograd.grad(out, xs, g)


def assemble(results, shape, joint, lens):
    """Full output / gradients from per-rank results: video shards concatenated, text checked or summed."""
    T = shape[5]
    split = (lambda x: (x[:, :T], x[:, T:])) if joint == "front" else (lambda x: (x[:, x.shape[1] - T :], x[:, : x.shape[1] - T]))
    cat = (lambda t, x: torch.cat([t, x], 1)) if joint == "front" else (lambda t, x: torch.cat([x, t], 1))
    outs = [split(r["out"]) for r in results]
    for t, _ in outs[1:]:
        assert torch.equal(t, outs[0][0]), "text output differs between ranks"
    for r, n in zip(outs, lens):
        assert r[1].shape[1] == n
    out = cat(outs[0][0], torch.cat([x for _, x in outs], 1))
    grads = []
    for i in range(3):
        parts = [split(r["grads"][i]) for r in results]
        text = sum(t.float() for t, _ in parts)
        grads.append(cat(text, torch.cat([x.float() for _, x in parts], 1)))
    return out, grads


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def check(clusters, strategy, U, R, shape, joint="front", dtype="fp32", lens=None, backend=None, causal=False):
    P = U * R
    results = clusters(P).run(rank_run, strategy, U, R, shape, joint, dtype, lens, backend, causal)
    # The fused CPU kernel unless the reference path was asked for; the same on every rank.
    assert {r["backend"] for r in results} == {"reference" if backend == "reference" else "cpu_flash"}
    lens = lens or even_splits(shape[1], P)
    out, grads = assemble(results, shape, joint, lens)
    ref_out, ref_grads = reference(shape, joint, dtype, causal=causal)
    if dtype == "fp32":
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg.float(), rtol=1e-5, atol=1e-5)
    else:
        # bf16: no worse than single-device bf16 SDPA, both measured against fp64 on the same inputs.
        p_out, p_grads = reference(shape, joint, dtype, precise=True, causal=causal)
        assert rel_err(out, p_out) <= max(2 * rel_err(ref_out, p_out), 8e-3)
        for g, rg, pg in zip(grads, ref_grads, p_grads):
            assert rel_err(g, pg) <= max(2 * rel_err(rg, pg), 8e-3)
    return results


SMALL = (2, 24, 4, 4, 8, 0)  # B, L, H, Hkv, D, text
GQA = (1, 24, 8, 2, 8, 0)
TEXT = (1, 22, 4, 2, 8, 7)
CASES = [
    ("ulysses", 2, 1, SMALL), ("ulysses", 4, 1, GQA), ("ring", 1, 2, SMALL), ("ring", 1, 3, SMALL),
    ("ring", 1, 4, GQA), ("usp-ring", 2, 2, GQA), ("allgather", 1, 2, SMALL), ("usp-allgather", 2, 2, GQA),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R,shape", CASES, ids=[f"{s}-{u}x{r}" for s, u, r, _ in CASES])
def test_fp32_matches_sdpa(clusters, strategy, U, R, shape):
    check(clusters, strategy, U, R, shape)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R", [("ulysses", 2, 1), ("ring", 1, 2), ("usp-ring", 2, 2), ("allgather", 1, 2)])
def test_bf16_matches_sdpa(clusters, strategy, U, R):
    check(clusters, strategy, U, R, (1, 32, 4, 2, 16, 5), dtype="bf16")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R", [("ulysses", 2, 1), ("usp-ring", 2, 2), ("ulysses", 4, 1)])
def test_heads_not_divisible(clusters, strategy, U, R):
    check(clusters, strategy, U, R, (1, 16, 5, 5, 8, 3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [(1, 16, 6, 3, 8, 4), (1, 16, 4, 1, 8, 4)], ids=["gqa-straddle", "mqa"])
def test_gqa_kv_heads_shared_between_ranks(clusters, shape):
    check(clusters, "ulysses", 4, 1, shape)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R", [("ulysses", 4, 1), ("ring", 1, 4), ("usp-ring", 2, 2)])
def test_length_not_divisible_1001_tokens(clusters, strategy, U, R):
    check(clusters, strategy, U, R, (1, 1001, 4, 2, 8, 0))


@pytest.mark.timeout(120)
def test_uneven_and_empty_shards(clusters):
    check(clusters, "usp-ring", 2, 2, (1, 13, 4, 2, 8, 3), lens=[7, 0, 5, 1])
    check(clusters, "ring", 1, 3, (1, 9, 4, 2, 8, 2), lens=[0, 9, 0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("joint", ["front", "rear"])
@pytest.mark.parametrize("strategy,U,R", [("ulysses", 2, 1), ("ring", 1, 3), ("usp-ring", 2, 2), ("allgather", 1, 2),
                                          ("usp-allgather", 2, 2)])
def test_joint_text(clusters, strategy, U, R, joint):
    check(clusters, strategy, U, R, TEXT, joint=joint)


@pytest.mark.timeout(120)
def test_stacked_and_per_tensor_transport_agree_and_count(clusters):
    shape = (1, 16, 4, 2, 8, 0)
    a = check(clusters, "ulysses-stacked", 2, 1, shape)
    b = check(clusters, "ulysses", 2, 1, shape)
    for ra, rb in zip(a, b):
        assert torch.equal(ra["out"], rb["out"])
        fwd_a, fwd_b = ra["stats"]["ulysses_a2a"], rb["stats"]["ulysses_a2a"]
        assert fwd_a["calls"] == 2 and fwd_b["calls"] == 4  # QKV in + out back; Q, K, V separately + out
        assert fwd_a["bytes_sent"] == fwd_b["bytes_sent"]
        # Each rank sends the other half of its heads of its 8 rows: (2 + 1 + 1 heads) * 8 rows * 8 * 4 B, + out 2 heads.
        assert fwd_a["bytes_sent"] == (4 + 2) * 8 * 8 * 4


@pytest.mark.timeout(120)
def test_ring_traffic_counts(clusters):
    shape = (1, 24, 4, 2, 8, 5)
    res = check(clusters, "ring", 1, 3, shape)
    kv_block = 2 * 1 * 2 * 8 * 8 * 4  # K and V, B=1, Hkv=2, 8 rows, D=8, fp32
    for r in res:
        s = r["stats"]
        assert s["ring_kv"] == {"calls": 2, "bytes_sent": 2 * kv_block, "bytes_recv": 2 * kv_block}
        assert s["ring_kv_bwd"]["calls"] == 2 and s["ring_dkv"]["calls"] == 3
        assert "text_rows" in s  # the text K/V is never circulated: only text outputs are gathered


def rank_strict(ctx):
    from ditsp.config import ParallelConfigError

    cfg = ParallelConfig(ulysses_degree=2)  # strict: advanced_uaa=False
    attn = SPAttention.from_config(cfg, build_sp_groups(cfg, ctx.group))
    q = torch.randn(1, 4, 5, 8)
    try:
        attn(q, q, q)
    except ParallelConfigError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_strict_mode_rejects_uneven_heads_with_choices(clusters):
    msgs = clusters(2).run(rank_strict)
    assert all(m and "valid degrees: [1, 5]" in m and "advanced_uaa" in m for m in msgs)


FALLBACK = [("ulysses", 2, 1), ("ring", 1, 3), ("allgather", 1, 2), ("usp-ring", 2, 2), ("usp-allgather", 2, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy,U,R", FALLBACK, ids=[f"{s}-{u}x{r}" for s, u, r in FALLBACK])
def test_reference_fallback_matches_sdpa(clusters, strategy, U, R, dtype):
    """The pure-torch path (forced) stays exact: every strategy, GQA, joint text, uneven lengths."""
    res = check(clusters, strategy, U, R, (1, 23, 4, 2, 16, 5), dtype=dtype, backend="reference")
    assert all(r["reason"] == "requested" for r in res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R", [("ring", 1, 2), ("ulysses", 2, 1)])
def test_kernel_that_does_not_take_the_call_falls_back_and_says_so(clusters, strategy, U, R):
    # cuda_flash asked for on CPU tensors: no kernel takes the call, the reference path runs it.
    shape = (1, 16, 4, 2, 8, 3)
    results = clusters(U * R).run(rank_run, strategy, U, R, shape, "front", "fp32", None, "cuda_flash")
    assert all(r["backend"] == "reference" and "cuda_flash needs cuda" in r["reason"] for r in results)
    out, grads = assemble(results, shape, "front", even_splits(16, U * R))
    ref_out, ref_grads = reference(shape, "front", "fp32")
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)


def rank_contiguous_heads(ctx):
    from ditsp.attention.ulysses import head_plan, to_heads
    from ditsp.distributed.comm import Comm

    torch.manual_seed(ctx.rank)
    comm, plan, lens = Comm(ctx.group), head_plan(4, 2, 2), [6, 5]
    xs = [torch.randn(1, lens[ctx.rank], h, 8, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]
    res = {}
    for contiguous in (False, True):
        hs = to_heads(comm, plan, lens, *xs, contiguous=contiguous)
        sum(h.float().pow(2).sum() * (i + 1) for i, h in enumerate(hs)).backward()
        res[contiguous] = ([h.detach() for h in hs], [h.is_contiguous() for h in hs], [x.grad.clone() for x in xs])
        for x in xs:
            x.grad = None
    return res


def test_contiguous_head_shards_are_the_same_values_and_gradients(clusters):
    """Kernels that read contiguous bf16 faster get copies; values and gradients do not change."""
    from ditsp.attention.kernels import wants_contiguous

    assert wants_contiguous("cpu_flash", torch.bfloat16) and not wants_contiguous("cpu_flash", torch.float32)
    assert not wants_contiguous("reference", torch.bfloat16)
    for res in clusters(2).run(rank_contiguous_heads):
        (views, vc, vg), (copies, cc, cg) = res[False], res[True]
        assert all(cc) and not all(vc)
        assert all(torch.equal(a, b) for a, b in zip(views, copies))
        assert all(torch.equal(a, b) for a, b in zip(vg, cg))


CAUSAL = [("ulysses", 2, 1, SMALL, None), ("ulysses", 4, 1, GQA, None), ("ring", 1, 3, SMALL, [5, 0, 19]),
          ("ring", 1, 4, GQA, None), ("usp-ring", 2, 2, GQA, [3, 9, 0, 12]), ("allgather", 1, 3, GQA, [10, 4, 10]),
          ("usp-allgather", 2, 2, SMALL, None)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R,shape,lens", CAUSAL, ids=[f"{s}-{u}x{r}" for s, u, r, *_ in CAUSAL])
@pytest.mark.parametrize("backend", [None, "reference"], ids=["fused", "reference"])
def test_causal_matches_sdpa(clusters, strategy, U, R, shape, lens, backend):
    """Causal over the whole sequence (shards in rank order), uneven and empty shards, GQA, forward and
    gradients, on the fused kernel and on the pure-torch path."""
    check(clusters, strategy, U, R, shape, lens=lens, backend=backend, causal=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,U,R", [("ulysses", 2, 1), ("ring", 1, 2), ("usp-ring", 2, 2)])
def test_causal_bf16_matches_sdpa(clusters, strategy, U, R):
    check(clusters, strategy, U, R, (1, 32, 4, 2, 16, 0), dtype="bf16", causal=True)


def rank_causal_with_text(ctx):
    attn = Ulysses(ctx.group)
    x = torch.randn(1, 3 + 4, 2, 8)
    try:
        attn(x, x, x, text_len=3, causal=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_causal_with_joint_text_is_refused_on_every_rank(clusters):
    assert all("causal attention takes no joint text" in m for m in clusters(2).run(rank_causal_with_text))
