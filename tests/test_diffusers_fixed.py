"""Fixed-shape kernel calls on a parallelized diffusers Wan (ditsp.integrations.diffusers.fixed): the same
function as the unmodified model, forward and backward (within float tolerance: other kernels), the same
bits with autograd on and off, and refusals in one line. Bits across SP degrees: tests/test_rl_identity.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize  # noqa: E402
from ditsp.integrations.diffusers.fixed import FixedShapeLinear, fix_shapes  # noqa: E402


def _wan(head_dim=16, ffn=128, seed=0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=head_dim,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=ffn, num_layers=2,
                                 rope_max_seq_len=32)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 4, 2, 6, 10, generator=g), torch.tensor([437.5]), torch.randn(1, 7, 32, generator=g),
            torch.randn(1, 4, 2, 6, 10, generator=g))


def _forward_backward(model):
    x, t, e, cot = _inputs()
    out = model(x, t, e, return_dict=False)[0]
    out.backward(cot)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_fixed_model_is_the_same_function_forward_and_backward(one_thread):
    ref_out, ref_grads = _forward_backward(_wan())
    model = fix_shapes(parallelize(_wan(), ParallelConfig()))
    assert any(type(m) is FixedShapeLinear for m in model.modules())
    out, grads = _forward_backward(model)
    scale = ref_out.abs().max()
    assert (out - ref_out).abs().max() <= 1e-5 * scale
    floor = 1e-3 * max(g.abs().max() for g in ref_grads.values())
    for n, g in ref_grads.items():
        assert (grads[n] - g).abs().max() <= 3e-5 * max(g.abs().max(), floor), n
    x, t, e, _ = _inputs()
    with torch.no_grad():
        assert torch.equal(model(x, t, e, return_dict=False)[0], out)  # autograd off: the same bits


def test_refusals_are_one_line():
    with pytest.raises(ParallelizeError, match="not parallelized"):
        fix_shapes(_wan())
    with pytest.raises(ParallelizeError, match="hidden width 48 is not a multiple of 64"):
        fix_shapes(parallelize(_wan(head_dim=12), ParallelConfig()))
    with pytest.raises(ParallelizeError, match="ffn_dim 96 is not a multiple of 64"):
        fix_shapes(parallelize(_wan(ffn=96), ParallelConfig()))
    model = fix_shapes(parallelize(_wan(), ParallelConfig()))
    with pytest.raises(ParallelizeError, match="already fixed-shape"):
        fix_shapes(model)
    with pytest.raises(ParallelizeError, match="built for WanTransformer3DModel"):
        fix_shapes(torch.nn.Linear(2, 2))
