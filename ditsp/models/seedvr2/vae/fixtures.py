"""Seeded weights for tests and benchmarks, following the recipe of the tiny reference vectors.

From a generator seeded with ``seed`` (the global RNG is left alone), parameters are drawn in
registration order: 5-D conv weights
``randn / sqrt(fan_in)``; attention linear weights ``randn / sqrt(in)`` (doubled for q and k, so the
softmax is peaked); biases ``0.1 randn``; GroupNorm weights ``1 + 0.2 randn``. Then the first
GroupNorm group's rows of both ``conv_in`` are scaled by 1e-3, so the GroupNorm eps matters.
With the tiny preset and seed 1234 this reproduces the vectors' weights bit for bit.
"""

from __future__ import annotations

import math

import torch

from .config import VaeConfig
from .model import VideoVAE


@torch.no_grad()
def seeded_init(vae: VideoVAE, seed: int = 1234) -> VideoVAE:
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g)

    for name, p in vae.named_parameters():
        if name.endswith("bias"):
            p.copy_(0.1 * randn(p.shape))
        elif p.dim() == 5:
            p.copy_(randn(p.shape) / math.sqrt(p[0].numel()))
        elif p.dim() == 2:
            gain = 2.0 if (".to_q." in name or ".to_k." in name) else 1.0
            p.copy_(randn(p.shape) / math.sqrt(p.shape[1]) * gain)
        else:
            p.copy_(1 + 0.2 * randn(p.shape))
    for conv in (vae.encoder.conv_in, vae.decoder.conv_in):
        n = conv.cout // vae.cfg.groups
        conv.weight[:n] *= 1e-3
        conv.bias[:n] *= 1e-3
    return vae


def seeded_vae(cfg: VaeConfig, seed: int = 1234) -> VideoVAE:
    return seeded_init(VideoVAE(cfg), seed).eval()
