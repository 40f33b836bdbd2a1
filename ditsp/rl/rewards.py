"""Rewards computed from decoded frames (uint8 ``[F, H, W, 3]``), none needing a downloaded model.

One registry, :data:`REWARDS`, name -> :class:`Reward`; ``ditsp rl --reward``
offers its names. Higher is better for every reward. A new reward is a
function of the frames returning a finite float, added to the table.

- ``jpeg-compressibility`` / ``jpeg-incompressibility``: minus / plus the
  mean size in kB (1000 bytes) of each frame encoded as a JPEG by Pillow at
  quality :data:`JPEG_QUALITY` (4:2:0 chroma subsampling, Pillow's default),
  the aesthetic-free rewards of the first diffusion RL work;
- ``smoothness``: minus the mean absolute difference between consecutive
  frames, in [0, 1] units of the 8-bit range (0 for a still clip; a one-frame
  clip scores 0);
- ``brightness``: the mean pixel value in [0, 1] units (a target statistic:
  it rewards lighter frames).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import torch

JPEG_QUALITY = 95  # Pillow's JPEG quality for the compressibility rewards


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable[[torch.Tensor], float]
    doc: str


def _check(frames: torch.Tensor) -> torch.Tensor:
    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or frames.dim() != 4 \
            or frames.shape[-1] != 3 or 0 in frames.shape:
        got = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"a reward takes uint8 frames [F, H, W, 3], got {got}")
    return frames


def jpeg_kb(frames: torch.Tensor, quality: int = JPEG_QUALITY) -> float:
    """Mean JPEG size of the frames in kB (1000 bytes), Pillow at ``quality``."""
    from PIL import Image  # local: only the JPEG rewards need Pillow

    sizes = []
    for f in _check(frames):
        buf = io.BytesIO()
        Image.fromarray(f.numpy()).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell())
    return sum(sizes) / len(sizes) / 1000.0


def jpeg_compressibility(frames: torch.Tensor) -> float:
    return -jpeg_kb(frames)


def jpeg_incompressibility(frames: torch.Tensor) -> float:
    return jpeg_kb(frames)


def smoothness(frames: torch.Tensor) -> float:
    f = _check(frames).to(torch.float64) / 255.0
    if f.shape[0] < 2:
        return 0.0
    return -float((f[1:] - f[:-1]).abs().mean())


def brightness(frames: torch.Tensor) -> float:
    return float(_check(frames).to(torch.float64).mean() / 255.0)


REWARDS: dict[str, Reward] = {r.name: r for r in (
    Reward("jpeg-compressibility", jpeg_compressibility, f"minus the mean JPEG size in kB (quality {JPEG_QUALITY})"),
    Reward("jpeg-incompressibility", jpeg_incompressibility, f"the mean JPEG size in kB (quality {JPEG_QUALITY})"),
    Reward("smoothness", smoothness, "minus the mean absolute change between consecutive frames (0..1)"),
    Reward("brightness", brightness, "the mean pixel value (0..1)"),
)}


def reward(name_or_fn) -> Callable[[torch.Tensor], float]:
    """The reward function of a name of :data:`REWARDS` (one-line error otherwise), or a callable as given."""
    if callable(name_or_fn):
        return name_or_fn
    if name_or_fn not in REWARDS:
        raise ValueError(f"unknown reward {name_or_fn!r}; choose from {', '.join(REWARDS)}")
    return REWARDS[name_or_fn].fn
