"""Pure pieces of global-attention SP: split helpers, head plans, block attention LSE and merging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.attention import common, kernels  # noqa: F401
from ditsp.attention.common import attn_bwd, attn_fwd, even_splits, merge, offsets, ranges
from ditsp.attention.ulysses import head_plan


@given(st.integers(0, 5000), st.integers(1, 64))
def test_even_splits(n, parts):
    s = even_splits(n, parts)
    assert len(s) == parts and sum(s) == n and min(s) >= 0
    assert max(s) - min(s) <= 1 and s == sorted(s, reverse=True)
    o = offsets(s)
    assert o[0] == 0 and o[-1] == n and ranges(s) == list(zip(o[:-1], o[1:]))


@given(st.integers(1, 16), st.integers(1, 8), st.integers(1, 16))
def test_head_plan_covers_heads_and_needed_kv(kv_heads, group, degree):
    heads = kv_heads * group
    plan = head_plan(heads, kv_heads, degree)
    assert [lo for lo, _ in plan.q] == offsets([b - a for a, b in plan.q])[:-1] and plan.q[-1][1] == heads
    sizes = [b - a for a, b in plan.q]
    assert max(sizes) - min(sizes) <= 1  # uneven head shards differ by at most one head
    for rank, ((qlo, qhi), (klo, khi)) in enumerate(zip(plan.q, plan.kv)):
        needed = {h // group for h in range(qlo, qhi)}
        assert needed == set(range(klo, khi))  # exactly the K/V heads its query heads use
        idx = plan.kv_index(rank)
        local = [(qlo + i) // group - klo for i in range(qhi - qlo)]
        if idx is None:
            nq, nk = qhi - qlo, khi - klo
            assert local == [i // (nq // nk) for i in range(nq)]
        else:
            assert idx == local


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(2, 12), st.integers(1, 3), st.integers(1, 3), st.data())
def test_block_lse_is_real_and_merges_exactly(sq, sk, kv_heads, group, data):
    torch.manual_seed(sq * 100 + sk)
    q = torch.randn(2, kv_heads * group, sq, 4, dtype=torch.float64) * 3
    k = torch.randn(2, kv_heads, sk, 4, dtype=torch.float64) * 3
    v = torch.randn(2, kv_heads, sk, 4, dtype=torch.float64)
    out, lse = attn_fwd(q, k, v, 0.5)
    kk = k.repeat_interleave(group, 1)
    assert torch.allclose(lse.double(), torch.logsumexp(q @ kk.transpose(-1, -2) * 0.5, -1), atol=1e-5)
    assert torch.allclose(out.double(), F.scaled_dot_product_attention(q, kk, v.repeat_interleave(group, 1), scale=0.5), atol=1e-5)
    cut = data.draw(st.integers(1, sk - 1))
    m = merge(*attn_fwd(q, k[:, :, :cut], v[:, :, :cut], 0.5), *attn_fwd(q, k[:, :, cut:], v[:, :, cut:], 0.5))
    assert torch.allclose(m[0], out, atol=1e-5) and torch.allclose(m[1], lse, atol=1e-5)


@pytest.mark.parametrize("score_elems", [1 << 22, 40], ids=["whole", "chunked-rows"])
def test_block_backward_matches_autograd(monkeypatch, score_elems):
    monkeypatch.setattr(kernels, "SCORE_ELEMS", score_elems)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    ref = _sdpa(q, k, v)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), 8**-0.5)
    delta = (g * out).sum(-1)
    # Two K/V halves, each with the final LSE, sum to the full gradients.
    a = attn_bwd(q.detach(), k[:, :, :4].detach(), v[:, :, :4].detach(), lse, delta, g, 8**-0.5)
    b = attn_bwd(q.detach(), k[:, :, 4:].detach(), v[:, :, 4:].detach(), lse, delta, g, 8**-0.5)
    torch.testing.assert_close(a[0] + b[0], want[0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 2), want[1].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([a[2], b[2]], 2), want[2].float(), rtol=1e-5, atol=1e-5)


# -- the fused-kernel table (ditsp/attention/kernels.py) -----------------------------------------

from ditsp.attention import kernels  # noqa: E402


def test_table_choices_without_running_a_kernel():
    pick = lambda dev, dt, d: kernels.choose(dev, dt, d, probe=False)  # noqa: E731
    assert pick("cpu", torch.float32, 64) == kernels.Choice("cpu_flash")
    assert pick("cpu", torch.bfloat16, 7).name == "cpu_flash"
    assert pick("cuda", torch.bfloat16, 128).name == "cuda_flash"
    assert pick("cuda", torch.float32, 64).name == "cuda_efficient"
    c = pick("cuda", torch.float64, 64)  # no fused CUDA kernel takes fp64
    assert c.name == "reference" and "cuda_flash does not take float64" in c.reason
    c = pick("cuda", torch.bfloat16, 12)  # head dim not a multiple of 8
    assert c.name == "reference" and "head dim 12" in c.reason
    c = pick("mps", torch.float32, 64)
    assert c.name == "reference" and "no fused kernel for float32 on mps" in c.reason
    assert kernels.choose("cpu", torch.float32, 64, "reference") == kernels.Choice("reference", "requested")
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.choose("cpu", torch.float32, 64, "triton")


def test_env_switch_forces_the_reference(monkeypatch):
    from ditsp.attention import Ulysses

    monkeypatch.setenv(kernels.ENV, "reference")
    attn = Ulysses(None)
    q = torch.randn(1, 6, 2, 8)
    attn(q, q, q)
    assert attn.backend == "reference" and attn.backend_reason == "requested"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("heads,kv_heads,sq,sk", [(4, 2, 7, 9), (3, 3, 5, 1), (2, 1, 1, 6)])
def test_cpu_kernel_blocks_match_the_reference(dtype, heads, kv_heads, sq, sk):
    """Two K/V halves through the fused kernel merge to the reference; their backward (final LSE) sums up."""
    torch.manual_seed(heads * 10 + sq)
    q = torch.randn(2, heads, sq, 8, dtype=dtype)
    k = torch.randn(2, kv_heads, sk + 1, 8, dtype=dtype)
    v = torch.randn(2, kv_heads, sk + 1, 8, dtype=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ref_o, ref_l = attn_fwd(q, k, v, 0.3)
    cut = (sk + 1) // 2
    a, b = (kernels.block_fwd("cpu_flash", q, k[:, :, s], v[:, :, s], 0.3) for s in (slice(0, cut), slice(cut, None)))
    o, l = merge(*a, *b)
    torch.testing.assert_close(o.float(), ref_o, rtol=tol, atol=tol)
    torch.testing.assert_close(l.float(), ref_l, rtol=tol, atol=tol)
    g = torch.randn(q.shape, dtype=dtype)
    out = ref_o.to(dtype)
    want = kernels.block_bwd("reference", q, k, v, out, ref_l, g, 0.3)
    ga = kernels.block_bwd("cpu_flash", q, k[:, :, :cut], v[:, :, :cut], out, ref_l, g, 0.3)
    gb = kernels.block_bwd("cpu_flash", q, k[:, :, cut:], v[:, :, cut:], out, ref_l, g, 0.3)
    torch.testing.assert_close((ga[0].float() + gb[0].float()), want[0], rtol=tol, atol=tol)
    for i in (1, 2):
        torch.testing.assert_close(torch.cat([ga[i], gb[i]], 2).float(), want[i], rtol=tol, atol=tol)


def test_empty_blocks_and_zero_heads_need_no_kernel():
    # The CPU kernel dies (SIGFPE) on zero-length inputs; block calls never hand it one.
    for q, k in [(torch.randn(1, 2, 0, 8), torch.randn(1, 2, 5, 8)), (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8)),
                 (torch.randn(1, 0, 4, 8), torch.randn(1, 0, 5, 8))]:
        o, lse = kernels.block_fwd("cpu_flash", q, k, k, 0.5)
        assert o.shape == q.shape and not o.abs().sum() and lse.shape == q.shape[:3]
        dq, dk, dv = kernels.block_bwd("cpu_flash", q, k, k, o, lse, torch.ones_like(o), 0.5)
        assert dq.shape == q.shape and dk.shape == k.shape and not dq.abs().sum()
    with pytest.raises(ValueError, match="do not group"):
        kernels.block_fwd("cpu_flash", torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), 0.5)
