"""From a pixel request to a post-patch token grid, the way the SeedVR2 pipeline does it, for one model of
the table (:mod:`..presets`): its VAE's time and space factors and its DiT's patch, never constants."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.padding import padded_length
from ..pipeline.sizing import frame_geometry
from ..presets import dit_config, vae_config

RELEASED_MODEL = "seedvr2-3b"  # what a request is sized for when no model is named: the released pipeline


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
    grid: tuple[int, int, int]  # (T, H, W) after the DiT's patchify
    multiple: int  # the crop's: the VAE's space factor times the DiT's patch (16 for the released models)
    temporal_factor: int  # the VAE's: frames are padded to kn + 1 (4n + 1 for the released models)

    def notes(self) -> list[str]:
        out = []
        if (self.crop_width, self.crop_height) != (self.width, self.height):
            out.append(
                f"centre-cropped {self.width}x{self.height} -> {self.crop_width}x{self.crop_height} "
                f"(multiples of {self.multiple})"
            )
        if self.padded_frames != self.frames:
            out.append(
                f"padded {self.frames} -> {self.padded_frames} frames by repeating the last "
                f"(the causal VAE needs {self.temporal_factor}n+1)"
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


def crop_multiple(model: str) -> int:
    """What a frame is centre-cropped to multiples of: the VAE's space factor times the DiT's patch."""
    _, ph, pw = dit_config(model).patch_size
    return vae_config(model).spatial_factor * max(ph, pw)


def clip_grid(model: str, frames: int, out_hw: tuple[int, int]) -> tuple[int, tuple[int, int, int], tuple[int, int, int]]:
    """(padded frames, latent (t, h, w), DiT token grid) of ``frames`` frames cropped to ``out_hw`` (the one
    computation of both; the restoration's plan and `ditsp plan` use it)."""
    vae, (pt, ph, pw) = vae_config(model), dit_config(model).patch_size
    padded = padded_length(frames, vae.temporal_factor)
    latent = vae.latent_shape(padded, *out_hw)
    if latent[0] % pt or latent[1] % ph or latent[2] % pw:
        raise ValueError(f"latent {latent} does not divide by the DiT's patch {(pt, ph, pw)}")
    return padded, latent, (latent[0] // pt, latent[1] // ph, latent[2] // pw)


def request_grid(width: int, height: int, frames: int, model: str = RELEASED_MODEL) -> Request:
    """The grid of a ``width x height``, ``frames`` request to ``model``: centre-crop to multiples of the VAE's
    space factor times the DiT's patch, pad frames to kn + 1 (k: the VAE's time factor), the VAE's latent, the
    DiT's patchify (the released models: crop to 16, 4n + 1 frames, VAE 4x and 8x8, patch 1x2x2).

    Frames are padded to kn + 1 only; the reference also pads to a multiple of
    k*SP, which makes its output depend on the SP degree. ditsp does not.
    """
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    multiple = crop_multiple(model)
    if width < multiple or height < multiple:
        raise ValueError(f"{width}x{height} is smaller than one {multiple}x{multiple} block")
    geo = frame_geometry(width, height, multiple=multiple)
    padded, latent, grid = clip_grid(model, frames, geo.out_hw)
    return Request(width, height, frames, geo.out_width, geo.out_height, padded, latent, grid, multiple,
                   vae_config(model).temporal_factor)


def parse_grid(text: str) -> tuple[int, int, int]:
    """``"21,45,80"`` -> (21, 45, 80)."""
    try:
        parts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"grid must look like T,H,W (e.g. 21,45,80), got {text!r}") from None
    if len(parts) != 3 or min(parts) <= 0:
        raise ValueError(f"grid must be three positive integers T,H,W, got {text!r}")
    return parts  # type: ignore[return-value]
