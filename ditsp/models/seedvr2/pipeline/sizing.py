"""Frame geometry of a restoration request: input size -> resized -> cropped -> latent grid.

Sizes are given as ``(width, height)`` at this user-facing level (the way a
``--resolution 1280x720`` reads); the tensors underneath are ``(..., H, W)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .transform import CROP_MULTIPLE, area_size, crop_box


@dataclass(frozen=True)
class FrameGeometry:
    """How one ``in_width x in_height`` frame becomes the VAE input."""

    in_width: int
    in_height: int
    resized_width: int
    resized_height: int
    crop_top: int
    crop_left: int
    out_width: int
    out_height: int
    multiple: int = CROP_MULTIPLE  # the crop's multiple (the VAE's space factor times the DiT's patch)

    @property
    def resized_hw(self) -> tuple[int, int]:
        return self.resized_height, self.resized_width

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.out_height, self.out_width

    def describe(self) -> str:
        s = f"{self.in_width}x{self.in_height}"
        if (self.resized_width, self.resized_height) != (self.in_width, self.in_height):
            s += f" -> resize {self.resized_width}x{self.resized_height}"
        if (self.out_width, self.out_height) != (self.resized_width, self.resized_height):
            s += f" -> crop {self.out_width}x{self.out_height}"
        return s


def frame_geometry(
    in_width: int,
    in_height: int,
    *,
    area: tuple[int, int] | None = None,
    size: tuple[int, int] | None = None,
    multiple: int = CROP_MULTIPLE,
) -> FrameGeometry:
    """Geometry for an input frame.

    ``area=(w, h)``: resize to the area ``w*h`` keeping the aspect ratio (the
    reference behaviour; ``(1280, 720)`` and ``(720, 1280)`` are the same).
    ``size=(w, h)``: resize to exactly that size. Neither: keep the size.
    Then centre-crop to multiples of ``multiple`` (the VAE's space factor times the DiT's patch: 16 for
    the released models).
    """
    if in_width <= 0 or in_height <= 0:
        raise ValueError(f"input size must be positive, got {in_width}x{in_height}")
    if area is not None and size is not None:
        raise ValueError("give either area or size, not both")
    if area is not None:
        rh, rw = area_size(in_height, in_width, area[1], area[0])
    elif size is not None:
        rw, rh = int(size[0]), int(size[1])
        if rw <= 0 or rh <= 0:
            raise ValueError(f"size must be positive, got {rw}x{rh}")
    else:
        rw, rh = in_width, in_height
    top, left, ch, cw = crop_box(rh, rw, multiple)
    return FrameGeometry(in_width, in_height, rw, rh, top, left, cw, ch, multiple)
