"""sRGB <-> CIE L*a*b* (D65 white, 2-degree observer) in torch, for the colour transfer and the colour drift.

Frames are ``(..., 3, H, W)`` (channels on dim -3) in sRGB ``[0, 1]``; L* is in
``[0, 100]``, a* and b* roughly ``[-100, 100]``. The steps are the standard ones:
the sRGB transfer curve to linear light, the sRGB primaries' matrix to XYZ, XYZ
over the D65 white, and the CIE cube-root curve with its linear toe (scikit-image's
``rgb2lab`` gives the same values within 1e-3). Computed in float32 or float64
(whichever the input is, 16-bit inputs in float32). The way back clamps linear
light to ``[0, 1]``: a colour outside the sRGB gamut comes back at its edge.
"""

from __future__ import annotations

import torch

_RGB_TO_XYZ = ((0.412453, 0.357580, 0.180423),
               (0.212671, 0.715160, 0.072169),
               (0.019334, 0.119193, 0.950227))
_WHITE = (0.95047, 1.0, 1.08883)  # D65, Y = 1
_DELTA = 6.0 / 29.0  # where the cube root meets its linear toe


def _work(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _mix(m, x: torch.Tensor) -> torch.Tensor:
    """``m @ x`` over the channel dim (-3) of ``x``."""
    m = torch.as_tensor(m, dtype=x.dtype, device=x.device)
    return torch.einsum("ij,...jhw->...ihw", m, x)


def srgb_to_linear(x: torch.Tensor) -> torch.Tensor:
    x = _work(x).clamp(0, 1)
    return torch.where(x <= 0.04045, x / 12.92, ((x + 0.055) / 1.055) ** 2.4)


def linear_to_srgb(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.where(x <= 0.0031308, x * 12.92, 1.055 * x ** (1 / 2.4) - 0.055)


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB ``[0, 1]`` (values outside are clamped) -> L*a*b*, channels on dim -3."""
    xyz = _mix(_RGB_TO_XYZ, srgb_to_linear(rgb))
    white = torch.as_tensor(_WHITE, dtype=xyz.dtype, device=xyz.device).reshape(3, 1, 1)
    t = xyz / white
    f = torch.where(t > _DELTA ** 3, t.clamp_min(0) ** (1 / 3), t / (3 * _DELTA ** 2) + 4 / 29)
    fx, fy, fz = f.unbind(-3)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=-3)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """L*a*b* -> sRGB ``[0, 1]`` (out-of-gamut colours clamped to the gamut's edge), channels on dim -3."""
    lab = _work(lab)
    L, a, b = lab.unbind(-3)
    fy = (L + 16) / 116
    f = torch.stack([fy + a / 500, fy, fy - b / 200], dim=-3)
    t = torch.where(f > _DELTA, f ** 3, 3 * _DELTA ** 2 * (f - 4 / 29))
    white = torch.as_tensor(_WHITE, dtype=t.dtype, device=t.device).reshape(3, 1, 1)
    inverse = torch.linalg.inv(torch.tensor(_RGB_TO_XYZ, dtype=torch.float64)).to(t.dtype)
    return linear_to_srgb(_mix(inverse, t * white))
