"""Window-local 3D RoPE of the SeedVR2 3B (``mmrope3d``).

The reference 3B RoPE: lang frequencies ``1/theta^(2k/d)`` with
``d = rope_dim // 3`` per axis, axes t|h|w, interleaved pairs
``(x0, x1) -> (x0 c - x1 s, x1 c + x0 s)``, ``3 d`` rotated channels and the
rest passed through. A video token at window-local (dt, dh, dw) sits at
(txt_len + dt, dh, dw); text token j at (j, j, j). Angles are fp32 products
``pos * freq`` and the rotation runs in fp32.

The reference materialises a (1024, 128, 128, 126) table (7.9 GiB); here only
the angles of the window shapes a layout has are computed (one small table
per distinct shape, shared by all blocks).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn


def rope_freqs(rope_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Per-axis frequencies (d/2,) in fp32 on CPU, d = rope_dim // 3."""
    d = rope_dim // 3
    return 1.0 / (theta ** (torch.arange(0, d, 2, device="cpu")[: d // 2].float() / d))


@lru_cache(maxsize=128)
def _cos_sin(rope_dim: int, theta: float, shape: tuple, txt_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (rows, 3d/2) fp32. ``shape`` (f, h, w): a video window; (L,): text."""
    f = rope_freqs(rope_dim, theta).to(device)
    ax = lambda pos: pos.float()[:, None] * f  # noqa: E731 - fp32 angles, as the reference's einsum
    if len(shape) == 1:
        ang = ax(torch.arange(shape[0], device=device)).repeat(1, 3)
    else:
        ft, fh, fw = shape
        at, ah, aw = ax(torch.arange(txt_len, txt_len + ft, device=device)), ax(torch.arange(fh, device=device)), \
            ax(torch.arange(fw, device=device))
        n = f.numel()
        ang = torch.cat([at[:, None, None].expand(ft, fh, fw, n), ah[None, :, None].expand(ft, fh, fw, n),
                         aw[None, None, :].expand(ft, fh, fw, n)], dim=-1).reshape(ft * fh * fw, 3 * n)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the first ``2*cos.shape[-1]`` channels of x (..., rows, H, D), in fp32.

    Each rotated value is ``x0 c - x1 s`` (or ``x1 c + x0 s``) with both products rounded to fp32, then
    rounded once to x's dtype. A bf16 ``x`` times the fp32 tables promotes exactly (no fp32 copy of x),
    the sums are taken in place on the fresh products and written straight into the output's
    interleaved slots, and the unrotated channels are copied as they are: the same bits as rotating a
    float copy of x, with about half the memory passes.
    """
    r = 2 * cos.shape[-1]
    x0, x1 = x[..., :r].unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x)
    pairs = out[..., :r].unflatten(-1, (-1, 2))
    pairs[..., 0].copy_((x0 * c).sub_(x1 * s))
    pairs[..., 1].copy_((x1 * c).add_(x0 * s))
    out[..., r:] = x[..., r:]
    return out


class RopeBuffer(nn.Module):
    """A block's RoPE with its checkpoint buffer ``freqs`` (port name
    ``blocks.<i>.attn.rope.freqs``; the reference nests it one level deeper).

    The angles always use the analytic fp32 frequencies, so a reduced-precision
    checkpoint cannot degrade them, and the buffer itself stays fp32 through
    ``model.to(bf16)`` (rounding the 7B's frequencies to bf16 would move its
    output by percents). The loader checks that a loaded buffer agrees with
    :meth:`analytic_freqs` and then stores the analytic values.
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", self.analytic_freqs().to(torch.get_default_device()))

    def analytic_freqs(self) -> torch.Tensor:
        """The frequencies (fp32, CPU) this RoPE rotates with."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.freqs = self.analytic_freqs().to(self.freqs.device)  # dtype casts never reach the frequencies
        return self

    def video(self, x: torch.Tensor, shape: tuple[int, int, int], txt_len: int) -> torch.Tensor:
        raise NotImplementedError

    def text(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MMRope3d(RopeBuffer):
    """The 3B's RoPE: language frequencies, video at (txt_len + dt, dh, dw), text at (j, j, j)."""

    def __init__(self, rope_dim: int, theta: float = 10000.0):
        self.rope_dim, self.theta = rope_dim, float(theta)
        super().__init__()

    def analytic_freqs(self) -> torch.Tensor:
        return rope_freqs(self.rope_dim, self.theta)

    def describe(self) -> str:
        return f"rope_dim {self.rope_dim}, theta {self.theta}"

    def video(self, x: torch.Tensor, shape: tuple[int, int, int], txt_len: int) -> torch.Tensor:
        """x (n, f*h*w, H, D): n windows of ``shape``."""
        return apply_rope(x, *_cos_sin(self.rope_dim, self.theta, tuple(shape), txt_len, str(x.device)))

    def text(self, x: torch.Tensor) -> torch.Tensor:
        """x (L, H, D): text at (j, j, j)."""
        return apply_rope(x, *_cos_sin(self.rope_dim, self.theta, (x.shape[0],), 0, str(x.device)))
