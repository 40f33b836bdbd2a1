"""Tiled execution on one device: APPROXIMATE, for when no exact mode fits the memory.

The latent grid is cut into overlapping tiles (``tile`` latent rows/columns, neighbours sharing
``overlap``). Encode: each tile's pixel crop is encoded on its own (in causal time chunks) and
the latent tiles are blended; decode: each latent tile is decoded on its own and the pixel tiles
blended. The blend weight ramps as a raised cosine, 0.5 - 0.5 cos(pi s), across the overlap on
interior edges only; overlapping contributions are summed with their weights and divided by the
weight sum. Each tile has its own GroupNorm statistics, attention and zero borders, so the result
differs from the exact one near and inside tiles; the overlap hides the seams but does not remove
the difference (the benchmark reports the error).
"""

from __future__ import annotations

import math

import torch

from .execution import Exec
from .model import decoder_pieces, encoder_pieces


def tiles(n: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """Overlapping ranges covering [0, n); the last one is shifted back to end at n."""
    if n <= tile:
        return [(0, n)]
    overlap = min(overlap, tile - 1)
    stride = tile - overlap
    out = []
    a = 0
    while True:
        b = min(a + tile, n)
        out.append((max(0, b - tile), b))
        if b == n:
            return out
        a += stride


def ramp(n: int, lead: int, trail: int) -> torch.Tensor:
    """Weights of a tile of n samples: raised-cosine rise over the first ``lead``, fall over the last ``trail``."""
    w = torch.ones(n, dtype=torch.float64)
    if lead:
        s = torch.arange(1, lead + 1, dtype=torch.float64) / (lead + 1)
        w[:lead] *= 0.5 - 0.5 * torch.cos(math.pi * s)
    if trail:
        s = torch.arange(trail, 0, -1, dtype=torch.float64) / (trail + 1)
        w[n - trail:] *= 0.5 - 0.5 * torch.cos(math.pi * s)
    return w


def _weights(ranges, i, scale):
    a, b = ranges[i]
    lead = (ranges[i - 1][1] - a) * scale if i > 0 else 0
    trail = (b - ranges[i + 1][0]) * scale if i + 1 < len(ranges) else 0
    return ramp((b - a) * scale, lead, trail)


def _blend(run, h: int, w: int, tile: int, overlap: int, scale: int, out_shape, crop_rows, crop_cols, dtype):
    acc = torch.zeros(out_shape, dtype=torch.float32)
    wsum = torch.zeros(out_shape[-2:], dtype=torch.float32)
    rr, cc = tiles(h, tile, overlap), tiles(w, tile, overlap)
    for i, (r0, r1) in enumerate(rr):
        wr = _weights(rr, i, scale)
        for j, (c0, c1) in enumerate(cc):
            wc = _weights(cc, j, scale)
            y = run(r0, r1, c0, c1).float()
            ys, ye = crop_rows(r0, r1)
            xs, xe = crop_cols(c0, c1)
            wt = (wr[:, None] * wc[None, :]).float()
            acc[..., ys:ye, xs:xe] += y * wt
            wsum[ys:ye, xs:xe] += wt
    return (acc / wsum.clamp_min(1e-6)).to(dtype)


def tiled_encode(vae, x: torch.Tensor, tile: int, overlap: int, chunk: int | None) -> torch.Tensor:
    """Approximate encoder moments of ``x`` (B, 3, T, H, W) from overlapping spatial tiles."""
    cfg = vae.cfg
    s = cfg.spatial_factor
    T, H, W = x.shape[2:]
    t, h, w = cfg.latent_shape(T, H, W)
    pieces = encoder_pieces(T, chunk, cfg.temporal_factor)

    def run(r0, r1, c0, c1):
        crop = x[:, :, :, s * r0:(H if r1 == h else s * r1), s * c0:(W if c1 == w else s * c1)]
        return vae.run_encoder(crop, Exec(carry={} if len(pieces) > 1 else None), pieces)

    shape = (x.shape[0], 2 * cfg.latent_channels, t, h, w)
    return _blend(run, h, w, tile, overlap, 1, shape, lambda a, b: (a, b), lambda a, b: (a, b), x.dtype)


def tiled_decode(vae, z: torch.Tensor, tile: int, overlap: int, chunk: int | None) -> torch.Tensor:
    """Approximate decode of ``z`` (B, 16, t, h, w) from overlapping latent tiles, blended in pixels."""
    cfg = vae.cfg
    s = cfg.spatial_factor
    t, h, w = z.shape[2:]
    T, H, W = cfg.decoded_shape(t, h, w)
    pieces = decoder_pieces(t, chunk)

    def run(r0, r1, c0, c1):
        return vae.run_decoder(z[:, :, :, r0:r1, c0:c1], Exec(carry={} if len(pieces) > 1 else None), pieces)

    shape = (z.shape[0], cfg.out_channels, T, H, W)
    return _blend(run, h, w, tile, overlap, s, shape, lambda a, b: (s * a, s * b), lambda a, b: (s * a, s * b), z.dtype)
