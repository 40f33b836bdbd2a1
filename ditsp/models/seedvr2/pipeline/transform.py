"""Pixel-side transforms of the SeedVR2 restoration pipeline.

Input frames arrive as uint8 ``(T, 3, H, W)``. The reference pipeline turns
them into the VAE input in four steps, reproduced here with the same
arithmetic:

1. resize to a target *area* (aspect ratio kept, orientation irrelevant) with
   antialiased bicubic (Keys a = -0.5, support widened when downscaling,
   weights renormalised at the borders: the Pillow BICUBIC filter);
2. clamp to [0, 1] (bicubic overshoots survive the resize);
3. centre crop to multiples of 16 (offsets rounded half to even);
4. ``2x - 1`` and the layout change ``(T, C, H, W) -> (C, T, H, W)``.

The inverse direction, ``to_uint8``, maps the decoded [-1, 1] frames back to
uint8 ``(T, H, W, 3)`` with round-half-to-even in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CROP_MULTIPLE = 16  # the reference's DivisibleCrop((16, 16)): the released VAE's 8x space times the DiT's 2x2 patch


def area_size(height: int, width: int, res_h: int, res_w: int) -> tuple[int, int]:
    """Size ``(h, w)`` of an ``height x width`` frame resized to the area ``res_h * res_w``.

    The arithmetic is done in doubles in the same order as the reference
    (square root of the area, squared again, then the scale), followed by
    Python's round-half-to-even. The detour through the square root decides
    ties: 9x16 at area 38*38 gives height 29, not the exact-arithmetic 28.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"frame size must be positive, got {height}x{width}")
    if res_h <= 0 or res_w <= 0:
        raise ValueError(f"target resolution must be positive, got {res_h}x{res_w}")
    resolution = (res_h * res_w) ** 0.5
    max_area = resolution**2
    scale = math.sqrt(max_area / (height * width))
    return round(height * scale), round(width * scale)


def crop_box(height: int, width: int, multiple: int = CROP_MULTIPLE) -> tuple[int, int, int, int]:
    """``(top, left, crop_h, crop_w)`` of the centre crop to multiples of ``multiple``.

    Border pixels are discarded; offsets use round-half-to-even on the
    half margin (margin 5 -> 2, 13 -> 6, 15 -> 8).
    """
    ch, cw = height - height % multiple, width - width % multiple
    if ch == 0 or cw == 0:
        raise ValueError(
            f"a {width}x{height} frame is smaller than {multiple} px on one side; "
            f"nothing is left after cropping to multiples of {multiple}"
        )
    top = int(round((height - ch) / 2.0))
    left = int(round((width - cw) / 2.0))
    return top, left, ch, cw


def resize_bicubic(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bicubic resize of float ``(..., C, H, W)`` frames to ``size = (h, w)``.

    Returns the input unchanged when the size already matches. No clamping.
    Each frame and channel is filtered independently.
    """
    if not frames.is_floating_point():
        raise TypeError(f"resize_bicubic needs float frames, got {frames.dtype}")
    h, w = int(size[0]), int(size[1])
    if (h, w) == tuple(frames.shape[-2:]):
        return frames
    lead = frames.shape[:-2]
    flat = frames.reshape(-1, 1, *frames.shape[-2:])
    out = F.interpolate(flat, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(*lead, h, w)


def area_resize(frames: torch.Tensor, res_h: int, res_w: int) -> torch.Tensor:
    """Resize float ``(T, C, H, W)`` frames to the area ``res_h * res_w`` (see ``area_size``)."""
    h, w = area_size(frames.shape[-2], frames.shape[-1], res_h, res_w)
    return resize_bicubic(frames, (h, w))


def center_crop(frames: torch.Tensor, multiple: int = CROP_MULTIPLE) -> torch.Tensor:
    """Centre crop ``(..., H, W)`` to multiples of ``multiple`` (see ``crop_box``)."""
    top, left, ch, cw = crop_box(frames.shape[-2], frames.shape[-1], multiple)
    return frames[..., top : top + ch, left : left + cw]


def u8_to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [0, 1] (division by 255.0, as the reference reader)."""
    if frames.dtype != torch.uint8:
        raise TypeError(f"expected uint8 frames, got {frames.dtype}")
    return frames.float() / 255.0


def transform_frames(
    frames: torch.Tensor,
    res_h: int | None = None,
    res_w: int | None = None,
    *,
    size: tuple[int, int] | None = None,
    multiple: int = CROP_MULTIPLE,
) -> torch.Tensor:
    """uint8 or [0,1]-float ``(T, 3, H, W)`` -> float32 ``(3, T, h16, w16)`` in [-1, 1] (multiples of ``multiple``).

    Give either the target area as ``res_h, res_w`` (the reference behaviour)
    or ``size=(h, w)`` to resize to that exact size instead (then the crop to
    multiples of 16 only removes what ``size`` leaves over). With neither, no
    resize happens.
    """
    if frames.ndim != 4:
        raise ValueError(f"expected (T, C, H, W) frames, got shape {tuple(frames.shape)}")
    x = u8_to_unit(frames) if frames.dtype == torch.uint8 else frames.float()
    if size is not None:
        if res_h is not None or res_w is not None:
            raise ValueError("give either res_h/res_w (area) or size, not both")
        x = resize_bicubic(x, size)
    elif res_h is not None or res_w is not None:
        if res_h is None or res_w is None:
            raise ValueError("res_h and res_w go together")
        x = area_resize(x, res_h, res_w)
    x = x.clamp(0.0, 1.0)
    x = center_crop(x, multiple)
    x = (x - 0.5) / 0.5
    return x.permute(1, 0, 2, 3).contiguous()


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """[-1, 1] ``(T, 3, H, W)`` -> uint8 ``(T, H, W, 3)``.

    Clip, ``*0.5 + 0.5``, ``*255``, round half to even, in the input's float
    dtype (fp32 after the colour fix; the order of operations matters on
    near-ties).
    """
    if video.ndim != 4:
        raise ValueError(f"expected (T, C, H, W), got shape {tuple(video.shape)}")
    x = video.clip(-1, 1).mul(0.5).add(0.5).mul(255).round()
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def to_uint8_values(x: torch.Tensor) -> torch.Tensor:
    """Element-wise version of ``to_uint8`` without any layout change."""
    return x.clip(-1, 1).mul(0.5).add(0.5).mul(255).round().to(torch.uint8)
