"""NaDiT (SeedVR2 ``dit_v2``) hyper-parameters and presets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ....windows.geometry import REGULAR, SHIFTED, canonical_method


def swiglu_hidden(dim: int, expand_ratio: int = 4) -> int:
    """The reference's SwiGLU width: 256 * ceil(int(2 * dim * ratio / 3) / 256)."""
    return 256 * math.ceil(int(2 * dim * expand_ratio / 3) / 256)


@dataclass(frozen=True)
class NaDiTConfig:
    """Structure of a 3B-style NaDiT. ``window_methods`` is the layer schedule."""

    name: str = "seedvr2-3b"
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
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_windows: tuple[int, int, int] = (4, 3, 3)
    window_methods: tuple[str, ...] = field(default=())
    txt_len: int = 58  # pos_emb.pt: the released positive text embedding

    def __post_init__(self):
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
        if (self.rope_dim // 3) % 2:
            raise ValueError(f"rope_dim//3 = {self.rope_dim // 3} must be even (interleaved pairs)")

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
        return replace(self, num_layers=num_layers, window_methods=(), mm_layers=min(self.mm_layers, num_layers))


SEEDVR2_3B = NaDiTConfig()
# The structure of the reference vectors in shared/vectors/nadit-3b-tiny.
TINY = NaDiTConfig(
    name="tiny", vid_dim=96, heads=3, head_dim=32, num_layers=4, mm_layers=2, mlp_hidden=256, rope_dim=32, txt_len=11
)
# A reduced-width model for benchmarks and demos: 3B structure, dim 256.
SMALL = NaDiTConfig(
    name="small", vid_dim=256, heads=8, head_dim=32, num_layers=8, mm_layers=2, mlp_hidden=swiglu_hidden(256), rope_dim=32
)

PRESETS = {c.name: c for c in (SEEDVR2_3B, TINY, SMALL)}


def get_config(name: str, num_layers: int | None = None) -> NaDiTConfig:
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(PRESETS)}") from None
    return cfg.with_layers(num_layers) if num_layers else cfg
