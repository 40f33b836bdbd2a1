"""ComfyUI's IMAGE batches and the restoration's frames, both ways.

An IMAGE is float ``[frames, H, W, C]`` in 0..1. A restoration reads uint8 RGB
``(T, 3, H, W)`` (what ditsp's reader gives for a video, an image or a folder
of frames) and its report gives uint8 ``(T, H, W, 3)``. Going in, values are
rounded to the nearest of the 256 levels, so frames ComfyUI decoded from an
8-bit file come back to exactly the bytes of that file; going out, level k
becomes k/255, which ComfyUI's image and video savers turn back into k.
"""

from __future__ import annotations

import torch


def to_frames(images) -> torch.Tensor:
    """An IMAGE batch as uint8 (T, 3, H, W); ValueError (one line) for anything that is not one."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images: expected an IMAGE batch (a tensor), got {type(images).__name__}")
    if images.dim() != 4 or images.shape[-1] != 3:
        raise ValueError(f"images: expected an IMAGE batch [frames, height, width, 3], got shape "
                         f"{list(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images: expected float values in 0..1, got {images.dtype}")
    if images.shape[0] < 1 or images.shape[1] < 1 or images.shape[2] < 1:
        raise ValueError(f"images: the batch is empty (shape {list(images.shape)})")
    x = images.detach().to("cpu", torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("images: has NaN or infinite values")
    return x.mul(255).round_().clamp_(0, 255).to(torch.uint8).permute(0, 3, 1, 2).contiguous()


def to_images(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (T, H, W, 3) frames as an IMAGE batch: float32 [T, H, W, 3] in 0..1."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 (T, H, W, 3) frames, got {frames.dtype} {list(frames.shape)}")
    return frames.to(torch.float32).div_(255.0)
