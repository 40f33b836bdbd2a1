"""Cache-sized row blocks (ditsp.row_blocks) give the bits of the whole-tensor computation at every block
size: the DiT's RMSNorm and the VAE's GroupNorm row moments, from one row per block to one block."""

import pytest
import torch

from ditsp import row_blocks
from ditsp.models.seedvr2.nadit.blocks import rms_norm
from ditsp.models.seedvr2.vae.execution import row_moments

BLOCKS = (1, 4096, 1 << 20, 1 << 40)  # bytes: one row per block, a few rows, the default, the whole tensor


def test_rows_per_block():
    assert row_blocks.rows_per_block(row_blocks.BLOCK_BYTES // 4) == 4
    assert row_blocks.rows_per_block(row_blocks.BLOCK_BYTES * 3) == 1  # a row wider than a block: one row
    assert row_blocks.rows_per_block(0) == row_blocks.BLOCK_BYTES


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 96), (37, 5, 64), (0, 8, 16), (1, 3)])
def test_rms_norm_blocks_are_the_whole_tensor_bits(monkeypatch, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    strided = torch.randn(shape[0], 3, *shape[1:], generator=g).to(dtype)[:, 1]  # q of a fused qkv: a view
    for w in (None, weight):
        for src in (x, strided):
            with torch.enable_grad():  # autograd on: the whole-tensor chain
                whole = rms_norm(src, w, 1e-6)
            for block in BLOCKS:
                monkeypatch.setattr(row_blocks, "BLOCK_BYTES", block)
                with torch.no_grad():
                    got = rms_norm(src, w, 1e-6)
                assert got.dtype == dtype and torch.equal(got, whole), (block, w is None)


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_row_moments_blocks_are_the_whole_tensor_bits(monkeypatch, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 8, 3, 5, 24, generator=g) * 2 + 1).to(dtype)
    gapped = torch.zeros(2, 8, 3, 5, 25, dtype=dtype)[..., :24].copy_(x)  # not contiguous: the whole-tensor path
    whole = row_moments(gapped, 4)
    for block in BLOCKS:
        monkeypatch.setattr(row_blocks, "BLOCK_BYTES", block)
        got = row_moments(x, 4)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), block
