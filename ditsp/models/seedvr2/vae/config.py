"""Hyperparameters of SeedVR2's causal video VAE (released preset and the tiny test preset)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class VaeConfig:
    """Structure of the VAE. Only widths and the GroupNorm group count vary between presets.

    Encoder block ``i`` halves H and W when ``i < len(widths) - 1``; it also halves time
    (``T -> (T - 1) // 2 + 1``) when ``i`` is in ``temporal_down_blocks``. The decoder mirrors
    this with ``temporal_up_blocks`` (``t -> 2t - 1``). Encoder blocks hold
    ``layers_per_block`` resnets, decoder blocks one more.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    widths: tuple[int, ...] = (128, 256, 512, 512)
    groups: int = 32
    eps: float = 1e-6
    layers_per_block: int = 2
    temporal_down_blocks: tuple[int, ...] = (1, 2)
    temporal_up_blocks: tuple[int, ...] = (0, 1)
    scaling_factor: float = 0.9152
    shifting_factor: float = 0.0
    logvar_range: tuple[float, float] = (-30.0, 20.0)

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.widths) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** len(self.temporal_down_blocks)

    def latent_shape(self, t: int, h: int, w: int) -> tuple[int, int, int]:
        """(t, h, w) of the latent of a (t, h, w) clip."""
        for _ in self.temporal_down_blocks:
            t = (t - 1) // 2 + 1
        for _ in range(len(self.widths) - 1):
            h, w = h // 2, w // 2
        return t, h, w

    def decoded_shape(self, t: int, h: int, w: int) -> tuple[int, int, int]:
        for _ in self.temporal_up_blocks:
            t = 2 * t - 1
        return t, h * self.spatial_factor, w * self.spatial_factor

    def with_widths(self, widths, groups: int | None = None) -> "VaeConfig":
        return replace(self, widths=tuple(widths), groups=groups or self.groups)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "VaeConfig":
        """Read a config written in the test vectors' plain names (``block_out_channels``...)."""
        with open(path) as f:
            d = json.load(f)
        return cls(
            in_channels=d.get("in_channels", 3),
            out_channels=d.get("out_channels", 3),
            latent_channels=d.get("latent_channels", 16),
            widths=tuple(d["block_out_channels"]),
            groups=d["norm_num_groups"],
            eps=d.get("groupnorm_eps", 1e-6),
            layers_per_block=d.get("layers_per_block_encoder", 2),
            temporal_down_blocks=tuple(d.get("encoder_temporal_down_blocks", (1, 2))),
            temporal_up_blocks=tuple(d.get("decoder_temporal_up_blocks", (0, 1))),
            scaling_factor=d.get("scaling_factor", 0.9152),
            shifting_factor=d.get("shifting_factor", 0.0),
        )


RELEASED = VaeConfig()
# The test vectors' VAE: released structure, widths 16/32/40/40 and 8 groups.
TINY = VaeConfig(widths=(16, 32, 40, 40), groups=8)
# The small restorer's VAE (``--model tiny``): the released structure at 2x space and no time compression, so
# its 16 latent channels hold 12 pixel values: a network of about a million parameters trained for an hour on
# one CPU core can reconstruct far better than at the released 8x8x4 (4x space with 16 channels for 48 values
# stayed near 16 dB over the same steps).
TINY_2X = VaeConfig(widths=(32, 64), groups=8, temporal_down_blocks=(), temporal_up_blocks=())
PRESETS = {"released": RELEASED, "tiny": TINY, "tiny-2x": TINY_2X}
