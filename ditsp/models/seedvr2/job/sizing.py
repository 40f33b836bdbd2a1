"""From a pixel request to a post-patch token grid, the way the SeedVR2 pipeline does it."""

from __future__ import annotations

from dataclasses import dataclass

VAE_TEMPORAL = 4
VAE_SPATIAL = 8
CROP_MULTIPLE = 16  # DivisibleCrop((16, 16))


@dataclass(frozen=True)
class Request:
    """A pixel request and the grid it becomes."""

    width: int
    height: int
    frames: int
    crop_width: int
    crop_height: int
    padded_frames: int
    latent: tuple[int, int, int]  # (T', H', W') after the VAE
    grid: tuple[int, int, int]  # (T, H, W) after the 1x2x2 patchify

    def notes(self) -> list[str]:
        out = []
        if (self.crop_width, self.crop_height) != (self.width, self.height):
            out.append(
                f"centre-cropped {self.width}x{self.height} -> {self.crop_width}x{self.crop_height} "
                f"(multiples of {CROP_MULTIPLE})"
            )
        if self.padded_frames != self.frames:
            out.append(
                f"padded {self.frames} -> {self.padded_frames} frames by repeating the last "
                f"(the causal VAE needs 4n+1)"
            )
        return out


def parse_resolution(text: str) -> tuple[int, int]:
    """``"1920x1080"`` -> (1920, 1080)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"resolution must look like WIDTHxHEIGHT (e.g. 1920x1080), got {text!r}") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"resolution must be positive, got {text!r}")
    return w, h


def request_grid(width: int, height: int, frames: int, patch: tuple[int, int, int] = (1, 2, 2)) -> Request:
    """Crop to multiples of 16, pad frames to 4n+1, VAE 4x/8x8, patchify.

    Frames are padded to 4n+1 only; the reference also pads to a multiple of
    4*SP, which makes its output depend on the SP degree. ditsp does not.
    """
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    cw, ch = width // CROP_MULTIPLE * CROP_MULTIPLE, height // CROP_MULTIPLE * CROP_MULTIPLE
    if cw == 0 or ch == 0:
        raise ValueError(f"{width}x{height} is smaller than one {CROP_MULTIPLE}x{CROP_MULTIPLE} block")
    padded = frames + (-(frames - 1)) % VAE_TEMPORAL
    latent = ((padded - 1) // VAE_TEMPORAL + 1, ch // VAE_SPATIAL, cw // VAE_SPATIAL)
    pt, ph, pw = patch
    grid = (latent[0] // pt, latent[1] // ph, latent[2] // pw)
    return Request(width, height, frames, cw, ch, padded, latent, grid)


def parse_grid(text: str) -> tuple[int, int, int]:
    """``"21,45,80"`` -> (21, 45, 80)."""
    try:
        parts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"grid must look like T,H,W (e.g. 21,45,80), got {text!r}") from None
    if len(parts) != 3 or min(parts) <= 0:
        raise ValueError(f"grid must be three positive integers T,H,W, got {text!r}")
    return parts  # type: ignore[return-value]
