"""Window-normalised 3D RoPE of the SeedVR2 7B ("pixel" frequencies, video only).

How it differs from the 3B's :class:`~.rope.MMRope3d`:

- frequencies ``pi * linspace(1, max_freq / 2, n)`` in fp32, ``n = (rope_dim // 3) // 2``
  per axis, with ``rope_dim = head_dim // 2`` (two floors: the 7B's 128-wide
  heads get 10 frequencies per axis, so 60 channels are rotated);
- axes t|h|w take channel blocks ``[0, 2n)``, ``[2n, 4n)``, ``[4n, 6n)``, rotated
  in interleaved pairs; the remaining channels pass through;
- a token at window-local index (i, j, k) of a window with extent (f, h, w)
  sits at ``(linspace(-1, 1, f)[i], linspace(-1, 1, h)[j], linspace(-1, 1, w)[k])``:
  positions depend on each window's own extent (ragged edge windows get a
  coarser spacing), an axis of length 1 sits at -1, and there is no text
  offset;
- text is never rotated.

Angles are fp32 ``position * frequency`` (they reach ~400 rad), and the
rotation runs in fp32. One small cos/sin table per window shape is cached.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .rope import RopeBuffer, apply_rope


def pixel_freqs(rope_dim: int, max_freq: float = 256.0) -> torch.Tensor:
    """Per-axis frequencies (n,) fp32 on CPU, n = (rope_dim // 3) // 2."""
    n = (rope_dim // 3) // 2
    return torch.linspace(1.0, max_freq / 2, n, device="cpu") * math.pi


def window_positions(n: int, device="cpu") -> torch.Tensor:
    """Positions of an axis with ``n`` tokens: fp32 linspace(-1, 1, n); one token sits at -1."""
    return torch.linspace(-1.0, 1.0, n, device=device)


@lru_cache(maxsize=128)
def _cos_sin(rope_dim: int, max_freq: float, shape: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (f*h*w, 3n) fp32 of one window shape (f, h, w), rows row-major (t, h, w)."""
    f = pixel_freqs(rope_dim, max_freq).to(device)
    ft, fh, fw = shape
    n = f.numel()
    at, ah, aw = (window_positions(m, device)[:, None] * f for m in shape)
    ang = torch.cat([at[:, None, None].expand(ft, fh, fw, n), ah[None, :, None].expand(ft, fh, fw, n),
                     aw[None, None, :].expand(ft, fh, fw, n)], dim=-1).reshape(ft * fh * fw, 3 * n)
    return ang.cos(), ang.sin()


class PixelRope3d(RopeBuffer):
    """The 7B's RoPE of one block (reference ``NaRotaryEmbedding3d`` with pixel frequencies)."""

    def __init__(self, rope_dim: int, max_freq: float = 256.0):
        self.rope_dim, self.max_freq = rope_dim, float(max_freq)
        super().__init__()

    def analytic_freqs(self) -> torch.Tensor:
        return pixel_freqs(self.rope_dim, self.max_freq)

    def describe(self) -> str:
        return f"pixel rope_dim {self.rope_dim}, max_freq {self.max_freq}"

    def video(self, x: torch.Tensor, shape: tuple[int, int, int], txt_len: int = 0) -> torch.Tensor:
        """x (n, f*h*w, H, D): n windows of ``shape``; ``txt_len`` is ignored (no text offset)."""
        return apply_rope(x, *_cos_sin(self.rope_dim, self.max_freq, tuple(shape), str(x.device)))

    def text(self, x: torch.Tensor) -> torch.Tensor:
        """The 7B leaves text unrotated."""
        return x
