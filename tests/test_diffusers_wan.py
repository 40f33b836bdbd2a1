"""diffusers' WanTransformer3DModel under ditsp.integrations.diffusers.parallelize vs the unmodified model.

Tiny seeded configs; every rank builds the same model and inputs, runs the parallelized forward on the
full inputs and back-propagates the same cotangent. The output must equal the single-device output of
the unmodified diffusers model, and the per-rank parameter gradients must sum to its gradients, within
a measured tolerance (different attention kernels: not the same bits).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig, ParallelConfigError  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize, reduce_gradients  # noqa: E402

# Measured (fp32, CPU, 2 cores): output max rel err 2.0e-7, worst parameter-gradient rel err 3.5e-6 (SP 2,
# 3 and USP 2x2; SP 1 the same bits); the bars are about 10x those.
OUT_TOL, GRAD_TOL = 1e-5, 3e-5


def build(heads=4, head_dim=12, layers=2, seed=0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64,
                                 num_layers=layers, rope_max_seq_len=32)


def inputs(grid=(2, 10, 14), per_token=False, seed=1):
    """Latents [1, 4, F, H, W], timestep (one, or one per post-patch token), text [1, 7, 16], cotangent."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(1, 4, f, h, w, generator=g)
    tokens = f * (h // 2) * (w // 2)
    t = torch.randint(0, 1000, (1, tokens), generator=g) if per_token else torch.tensor([437])
    return x, t, torch.randn(1, 7, 16, generator=g), torch.randn(1, 4, f, h, w, generator=g)


def forward_backward(model, grid, per_token):
    x, t, text, cot = inputs(grid, per_token)
    out = model(x, t, text, return_dict=False)[0]
    out.backward(cot)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_run(ctx, u, r, heads, grid, per_token, advanced_uaa=False, reduce=False):
    model = build(heads)
    parallelize(model, ParallelConfig(ulysses_degree=u, ring_degree=r, advanced_uaa=advanced_uaa), ctx.group)
    out, grads = forward_backward(model, grid, per_token)
    if reduce:
        reduce_gradients(model)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def compare(results, heads, grid, per_token, summed=True):
    ref_out, ref_grads = forward_backward(build(heads), grid, per_token)
    for out, _ in results:
        assert out.shape == ref_out.shape
        assert rel(out, ref_out) <= OUT_TOL
    grads = ({n: sum(g[n] for _, g in results) for n in ref_grads} if summed else results[0][1])
    worst = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    assert set(grads) == set(ref_grads)
    assert worst <= GRAD_TOL, worst


CASES = [  # (ulysses, ring, heads, grid, per_token, advanced_uaa)
    (2, 1, 4, (2, 10, 14), False, False),   # Ulysses 2, 70 tokens
    (1, 3, 4, (2, 10, 14), False, False),   # Ring 3, uneven tokens 24/23/23
    (3, 1, 4, (3, 6, 10), True, True),      # Ulysses 3: 4 heads (uneven), 45 tokens, Wan 2.2 per-token timesteps
    (1, 2, 4, (3, 6, 10), True, False),     # Ring 2, uneven 23/22, per-token timesteps
]


@pytest.mark.parametrize("u,r,heads,grid,per_token,uaa", CASES)
def test_wan_matches_one_device(clusters, u, r, heads, grid, per_token, uaa):
    results = clusters(u * r).run(rank_run, u, r, heads, grid, per_token, uaa)
    compare(results, heads, grid, per_token)


def test_wan_reduce_gradients(clusters):
    """After reduce_gradients every rank holds the single-device gradient itself."""
    results = clusters(2).run(rank_run, 1, 2, 4, (2, 10, 14), False, False, True)
    for res in results:
        compare([res], 4, (2, 10, 14), False, summed=False)


def test_wan_one_device_without_distributed():
    model = parallelize(build(), ParallelConfig())
    out, grads = forward_backward(model, (2, 10, 14), False)
    compare([(out, grads)], 4, (2, 10, 14), False)


def _strict_heads(ctx):
    try:
        parallelize(build(4), ParallelConfig(ulysses_degree=3), ctx.group)
    except ParallelConfigError as e:
        return str(e)
    return None


def test_uneven_heads_refused_in_strict_mode(clusters):
    msgs = clusters(3).run(_strict_heads)
    assert all(m and "advanced_uaa" in m for m in msgs), msgs


def test_refusals_name_the_module():
    with pytest.raises(ParallelizeError, match="cannot parallelize Linear"):
        parallelize(torch.nn.Linear(2, 2), ParallelConfig())
    model = build()

    class Custom:
        def __call__(self, *a, **k):
            raise AssertionError

    model.blocks[1].attn1.set_processor(Custom())
    with pytest.raises(ParallelizeError, match=r"blocks\.1\.attn1 .*Custom"):
        parallelize(model, ParallelConfig())
    model = parallelize(build(), ParallelConfig())
    with pytest.raises(ParallelizeError, match="already parallelized"):
        parallelize(model, ParallelConfig())
