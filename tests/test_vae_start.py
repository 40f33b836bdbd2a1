"""The lossless VAE start (ditsp/train/vae_start.py) and the quality baseline delivered like the output."""

import math

import numpy as np
import pytest
import torch

from ditsp.io import quality
from ditsp.models.seedvr2.presets import vae_config
from ditsp.models.seedvr2.vae.checkpoint import load_checkpoint
from ditsp.models.seedvr2.vae.config import TINY_2X
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.model import VideoVAE
from ditsp.train import vae_start


def _clip(seed: int, smooth: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not smooth:
        return torch.rand(1, 3, 5, 24, 32, generator=g) * 2 - 1
    low = torch.rand(1, 3, 5, 6, 8, generator=g)
    return torch.nn.functional.interpolate(low, size=(5, 24, 32), mode="trilinear") * 2 - 1


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return 10 * math.log10(4 / (a - b).pow(2).mean().item())  # range [-1, 1]


@pytest.mark.parametrize("smooth", [False, True])
def test_reconstructs_far_above_any_restorer(smooth):
    vae = vae_start.init_vae_lossless(VideoVAE(TINY_2X)).float().eval()
    x = _clip(0, smooth)
    post = vae.encode(x)
    assert _psnr(vae.decode(post.mean), x) > 80
    # the latent is the scaled space-to-depth of the clip: channel c * 4 + (2 i + j) holds pixel (2y + i, 2x + j)
    s2d = x.reshape(1, 3, 5, 12, 2, 16, 2).permute(0, 1, 4, 6, 2, 3, 5).reshape(1, 12, 5, 12, 16)
    assert torch.allclose(post.mean[:, :12], vae_start.LATENT_SCALE * s2d, atol=1e-3)
    assert post.mean[:, 12:].abs().max() == 0
    assert post.std.max() < 1e-6  # pinned: a sample is the mean


def test_chunked_and_image_paths_reconstruct_too():
    vae = vae_start.init_vae_lossless(VideoVAE(TINY_2X)).float().eval()
    x = _clip(1, True)
    whole = vae.encode(x).mean
    assert torch.allclose(vae.encode(x, chunk=2).mean, whole, atol=1e-5)
    image = x[:, :, 0]
    assert _psnr(vae.decode(vae.encode(image).mean)[:, :, 0], image) > 80  # encode keeps the time axis


def test_a_clip_s_statistics_do_not_leak_into_the_code():
    """A frame's latent does not depend on the rest of the clip (the output norms' statistics are fixed by
    the constants): a dark and a bright clip sharing one frame encode it alike."""
    vae = vae_start.init_vae_lossless(VideoVAE(TINY_2X)).float().eval()
    x = _clip(2, True)
    dark, bright = x.clone(), x.clone()
    dark[:, :, 1:] = -0.9
    bright[:, :, 1:] = 0.9
    assert torch.allclose(vae.encode(dark).mean[:, :, 0], vae.encode(bright).mean[:, :, 0], atol=2e-4)


def test_released_structure_is_refused_in_one_line():
    with pytest.raises(ValueError, match="one 2x spatial stage"):
        vae_start.init_vae_lossless(VideoVAE(vae_config("seedvr2-3b")))


def test_main_writes_weights_the_loader_takes(tmp_path, capsys):
    out = tmp_path / "v" / "vae.safetensors"
    assert vae_start.main([str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    vae = seeded_vae(TINY_2X, 7).float()
    load_checkpoint(vae, str(out))
    x = _clip(3, True)
    assert _psnr(vae.decode(vae.encode(x).mean), x) > 80
    assert vae_start.main([str(tmp_path / "x.safetensors"), "--model", "seedvr2-3b"]) == 2
    assert "error: a lossless start" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_baseline_through_the_output_s_encoder():
    g = np.random.default_rng(0)
    ref = (g.random((3, 32, 48, 3)) * 255).astype(np.uint8)
    ref = np.repeat(np.repeat(ref[:, ::4, ::4], 4, 1), 4, 2)  # blocky: an encoder keeps most of it
    delivered = quality.through_video(ref, 12.0, 18)
    assert delivered.shape == ref.shape and delivered.dtype == np.uint8
    p = quality.psnr(delivered, ref)
    assert 25 < p < 60  # yuv420p and crf 18 lose something, not everything
    r = quality.report(delivered, ref[:, ::2, ::2], ref, baseline=delivered)
    assert r["bicubic"]["overall"]["psnr"] == pytest.approx(np.mean([quality.psnr(d, x) for d, x in zip(delivered, ref)]))
