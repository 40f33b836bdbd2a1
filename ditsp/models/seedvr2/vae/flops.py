"""Counted work of one VAE encode or decode: floating-point operations and the bytes its layers read and write.

Walks the network from :class:`.config.VaeConfig` the way :mod:`.memory` walks it for live bytes: every conv
(causal 3x3x3, the 1x1 shortcuts and upsampler projections, the stride-2 downsamplers) counts
``2 * cin * cout * taps`` per output element; the mid attention (one head over each frame's H x W tokens)
counts its four projections and ``4 * N * N * c`` for the scores and their product with V; GroupNorm+SiLU,
residual adds and the depth-to-space copy count no FLOPs but their bytes. Bytes are each layer's input read
once and its output written once, in the compute dtype (a lower bound: kernels may read more). A height slab
(``full_rows`` above the piece's rows) still runs the mid attention on the whole frame, as the sharded VAE does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import VaeConfig


@dataclass
class Work:
    flops: float = 0.0
    bytes: float = 0.0

    def add(self, flops: float, nbytes: float) -> None:
        self.flops += flops
        self.bytes += nbytes


class _Count:
    def __init__(self, elem_bytes: int, full_rows: int | None):
        self.b, self.full_rows, self.work = elem_bytes, full_rows, Work()

    def conv(self, cin, cout, shape, kt=3, ks=3, st=1, ss=1):
        t, h, w = shape
        out = (t if st == 1 else (t - 1) // 2 + 1, h // ss, w // ss)
        n_out = out[0] * out[1] * out[2]
        self.work.add(2.0 * cin * cout * kt * ks * ks * n_out, (cin * t * h * w + cout * n_out) * self.b)
        return out

    def elementwise(self, c, shape, reads=1):
        """GroupNorm+SiLU (two reads: statistics, then the normalised write), a residual add (two reads)."""
        t, h, w = shape
        self.work.add(0.0, (reads + 1) * c * t * h * w * self.b)

    def resnet(self, cin, cout, shape):
        self.elementwise(cin, shape, 2)
        self.conv(cin, cout, shape)
        self.elementwise(cout, shape, 2)
        self.conv(cout, cout, shape)
        if cin != cout:
            self.conv(cin, cout, shape, 1, 1)
        self.elementwise(cout, shape, 2)

    def attention(self, c, shape):
        t, h, w = shape
        rows = self.full_rows or h  # a slab attends (and projects) the whole frame
        n = rows * w
        self.elementwise(c, (t, rows, w), 2)
        self.work.add(t * (2.0 * 4 * c * c * n + 4.0 * n * n * c), t * 6 * n * c * self.b)
        self.elementwise(c, shape, 2)

    def upsample(self, c, shape, temporal):
        t, h, w = shape
        r = 8 if temporal else 4
        self.conv(c, c * r, shape, 1, 1)
        new = (2 * t - 1 if temporal else t, 2 * h, 2 * w)
        self.elementwise(c, new)  # depth-to-space (and the first frame's drop) copy
        self.conv(c, c, new)
        return new


def encoder_work(cfg: VaeConfig, shape, elem_bytes: int = 2, full_rows: int | None = None) -> Work:
    """Work of the encoder on a (T, H, W) pixel piece; ``full_rows``: the frame's latent rows when the piece is a
    height slab (the mid attention runs on the whole frame)."""
    k, w = _Count(elem_bytes, full_rows), cfg.widths
    shape = k.conv(cfg.in_channels, w[0], shape)
    cin = w[0]
    for i, c in enumerate(w):
        for j in range(cfg.layers_per_block):
            k.resnet(cin if j == 0 else c, c, shape)
        cin = c
        if i < len(w) - 1:
            temporal = i in cfg.temporal_down_blocks
            shape = k.conv(c, c, shape, 3 if temporal else 1, 3, 2 if temporal else 1, 2)
    k.resnet(w[-1], w[-1], shape)
    k.attention(w[-1], shape)
    k.resnet(w[-1], w[-1], shape)
    k.elementwise(w[-1], shape, 2)
    k.conv(w[-1], 2 * cfg.latent_channels, shape)
    return k.work


def decoder_work(cfg: VaeConfig, shape, elem_bytes: int = 2, full_rows: int | None = None) -> Work:
    """Work of the decoder on a (t, h, w) latent piece (``full_rows`` as for :func:`encoder_work`)."""
    k, w = _Count(elem_bytes, full_rows), tuple(reversed(cfg.widths))
    shape = k.conv(cfg.latent_channels, w[0], shape)
    k.resnet(w[0], w[0], shape)
    k.attention(w[0], shape)
    k.resnet(w[0], w[0], shape)
    cin = w[0]
    for i, c in enumerate(w):
        for j in range(cfg.layers_per_block + 1):
            k.resnet(cin if j == 0 else c, c, shape)
        cin = c
        if i < len(w) - 1:
            shape = k.upsample(c, shape, i in cfg.temporal_up_blocks)
    k.elementwise(w[-1], shape, 2)
    k.conv(w[-1], cfg.out_channels, shape)
    return k.work
