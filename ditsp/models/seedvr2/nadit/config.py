"""NaDiT hyper-parameters and presets for both SeedVR2 families.

One config class describes both: ``variant="3b"`` is the reference's
``models/dit_v2`` (shared ``all`` weights above ``mm_layers``, SwiGLU,
language RoPE over ``rope_dim`` channels, RMSNorm+modulation output head),
``variant="7b"`` is ``models/dit`` (separate vid/txt weights in every block,
GELU-tanh MLP with biases, window-normalised "pixel" RoPE, no output head
norm). ``rope_dim`` is, for both, the dim the reference hands its RoPE class:
the head dim for the 3B, half of it for the 7B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ....windows.geometry import NUM_WINDOWS, REGULAR, SHIFTED, canonical_method


def swiglu_hidden(dim: int, expand_ratio: int = 4) -> int:
    """The reference's SwiGLU width: 256 * ceil(int(2 * dim * ratio / 3) / 256)."""
    return 256 * math.ceil(int(2 * dim * expand_ratio / 3) / 256)


VARIANTS = ("3b", "7b")


@dataclass(frozen=True)
class NaDiTConfig:
    """Structure of a NaDiT of either family. ``window_methods`` is the layer schedule."""

    name: str = "seedvr2-3b"
    variant: str = "3b"
    vid_in_channels: int = 33
    vid_out_channels: int = 16
    vid_dim: int = 2560
    txt_in_dim: int = 5120
    heads: int = 20
    head_dim: int = 128
    num_layers: int = 32
    mm_layers: int = 10
    mlp_hidden: int = 6912
    rope_dim: int = 128
    rope_theta: float = 10000.0  # 3B language frequencies
    rope_max_freq: float = 256.0  # 7B pixel frequencies: pi * linspace(1, max_freq / 2, n)
    norm_eps: float = 1e-5
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_windows: tuple[int, int, int] = NUM_WINDOWS
    window_methods: tuple[str, ...] = field(default=())
    txt_len: int = 58  # pos_emb.pt: the released positive text embedding

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if not self.window_methods:
            methods = tuple(REGULAR if i % 2 == 0 else SHIFTED for i in range(self.num_layers))
            object.__setattr__(self, "window_methods", methods)
        else:
            object.__setattr__(self, "window_methods", tuple(canonical_method(m) for m in self.window_methods))
        if len(self.window_methods) != self.num_layers:
            raise ValueError(
                f"window_methods has {len(self.window_methods)} entries for {self.num_layers} layers"
            )
        if self.heads * self.head_dim != self.vid_dim:
            raise ValueError(f"heads*head_dim = {self.heads * self.head_dim} must equal vid_dim {self.vid_dim}")
        if self.variant == "3b" and (self.rope_dim // 3) % 2:
            raise ValueError(f"rope_dim//3 = {self.rope_dim // 3} must be even (interleaved pairs)")
        if self.rope_channels > self.head_dim:
            raise ValueError(f"RoPE rotates {self.rope_channels} channels but a head has {self.head_dim}")

    @property
    def rope_channels(self) -> int:
        """Head channels RoPE rotates (the rest pass through): 3B 3*(rope_dim//3), 7B 6*(rope_dim//3//2)."""
        per_axis = self.rope_dim // 3
        return 3 * per_axis if self.variant == "3b" else 6 * (per_axis // 2)

    def separate_weights(self, index: int) -> bool:
        """Whether block ``index`` has its own ``vid``/``txt`` modules (else one shared ``all`` set)."""
        return self.variant == "7b" or index < self.mm_layers

    def param_count(self) -> int:
        """Number of parameters of the model (buffers excluded), from the dims alone."""
        d, hd, inner, hid = self.vid_dim, self.head_dim, self.heads * self.head_dim, self.mlp_hidden
        top = (self.patch_channels + 1) * d + (self.txt_in_dim + 1) * d \
            + (256 + 1) * d + (d + 1) * d + (d + 1) * self.emb_dim + (d + 1) * self.out_patch_channels
        attn = d * 3 * inner + (inner + 1) * d + 2 * hd
        if self.variant == "7b":
            mlp = (d + 1) * hid + (hid + 1) * d
            return top + self.num_layers * 2 * (attn + mlp + 6 * d)
        top += 3 * d  # vid_out_norm.weight, vid_out_ada.out_shift/out_scale
        mlp = 3 * d * hid
        total = 0
        for i in range(self.num_layers):
            last = i == self.num_layers - 1
            if self.separate_weights(i):
                total += 2 * attn + (1 if last else 2) * (mlp + 6 * d)
            else:
                total += attn + mlp + 6 * d
        return top + total

    @property
    def emb_dim(self) -> int:
        return 6 * self.vid_dim

    @property
    def patch_channels(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw * self.vid_in_channels

    @property
    def out_patch_channels(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw * self.vid_out_channels

    def with_layers(self, num_layers: int) -> "NaDiTConfig":
        """The same structure with ``num_layers`` alternating layers."""
        mm = num_layers if self.variant == "7b" else min(self.mm_layers, num_layers)
        return replace(self, num_layers=num_layers, window_methods=(), mm_layers=mm)


SEEDVR2_3B = NaDiTConfig()
# The structure of the reference vectors in tests/data/nadit-3b-tiny.
TINY = NaDiTConfig(
    name="tiny", vid_dim=96, heads=3, head_dim=32, num_layers=4, mm_layers=2, mlp_hidden=256, rope_dim=32, txt_len=11
)
# A reduced-width model for benchmarks and demos: 3B structure, dim 256.
SMALL = NaDiTConfig(
    name="small", vid_dim=256, heads=8, head_dim=32, num_layers=8, mm_layers=2, mlp_hidden=swiglu_hidden(256), rope_dim=32
)

# The 7B (reference ``models/dit``): every block has separate vid/txt weights (``mm_layers`` is
# informational: all of them), GELU-tanh MLP 4x with biases, pixel RoPE over head_dim // 2.
SEEDVR2_7B = NaDiTConfig(
    name="seedvr2-7b", variant="7b", vid_dim=3072, heads=24, head_dim=128, num_layers=36, mm_layers=36,
    mlp_hidden=4 * 3072, rope_dim=64,
)
# The structure of the reference vectors in tests/data/nadit-7b-tiny (12 of 32 channels rotated).
TINY_7B = NaDiTConfig(
    name="tiny-7b", variant="7b", vid_dim=96, heads=3, head_dim=32, num_layers=4, mm_layers=4, mlp_hidden=384,
    rope_dim=16, txt_len=11,
)

# The community SeedVR2-1.4B: a six-block distillation of the 7B (its widths, 24 heads, blocks 0-5's shapes).
SEEDVR2_1_4B = replace(SEEDVR2_7B.with_layers(6), name="seedvr2-1.4b")

PRESETS = {c.name: c for c in (SEEDVR2_3B, TINY, SMALL, SEEDVR2_7B, TINY_7B, SEEDVR2_1_4B)}


def get_config(name: str, num_layers: int | None = None) -> NaDiTConfig:
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(PRESETS)}") from None
    return cfg.with_layers(num_layers) if num_layers else cfg
