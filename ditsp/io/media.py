"""What a media file is: its kind, the checks every input passes, :class:`VideoInfo`, and
``MediaError``, the one-line error for a file the user named (shared by :mod:`.read`,
:mod:`.probe` and :mod:`.write`).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from .formats import IMAGE_EXTS, VIDEO_EXTS


MIN_SIDE = 16


class MediaError(ValueError):
    """A media file cannot be read or written; the message is one line meant for the user."""


def _fail(msg: str) -> MediaError:
    return MediaError(" ".join(str(msg).split()))


def media_kind(path: str | os.PathLike) -> str:
    """``"image"``, ``"video"`` or ``"folder"`` by extension (or being a directory)."""
    p = Path(path)
    if p.is_dir():
        return "folder"
    ext = p.suffix.lower()
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    raise _fail(
        f"{p}: unknown extension {ext or '(none)'!r}; videos: {' '.join(VIDEO_EXTS)}; images: {' '.join(IMAGE_EXTS)}"
    )


def _check_input(path: str | os.PathLike) -> Path:
    """An existing regular file or folder; a pipe, socket or device would block or never end when read."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise _fail(f"{p}: no such file or folder") from None
    except OSError as e:
        raise _fail(f"{p}: cannot be read ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise _fail(f"{p}: not a regular file or a folder (pipes, sockets and devices are refused)")
    return p


def _check_size(p: Path, width: int, height: int) -> None:
    if width < MIN_SIDE or height < MIN_SIDE:
        raise _fail(f"{p}: frames are {width}x{height}; both sides must be at least {MIN_SIDE} px")


def natural_key(name: str) -> list:
    """Sort key that orders ``frame2`` before ``frame10``."""
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", name)]


def _to_fraction(fps: float | Fraction | int) -> Fraction:
    if isinstance(fps, Fraction):
        rate = fps
    else:
        if not np.isfinite(fps):
            raise _fail(f"fps must be a finite number, got {fps}")
        rate = Fraction(float(fps)).limit_denominator(1001 * 1000)
    if rate <= 0:
        raise _fail(f"fps must be positive, got {fps}")
    return rate


@dataclass(frozen=True)
class VideoInfo:
    """What is known about an input before decoding it."""

    path: Path
    width: int
    height: int
    fps: float
    rate: Fraction  # exact frame rate when the container knows it
    frames: int | None  # None when the container does not say
    has_audio: bool
    video_codec: str
    audio_codec: str | None
    kind: str = "video"  # "video", "image" or "folder"
    rotation: int = 0  # degrees counter-clockwise the display matrix asked for; applied to the frames read

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)``."""
        return self.width, self.height


def _open_container(p: Path):
    try:
        return av.open(str(p), "r")
    except av.error.FileNotFoundError:
        raise _fail(f"{p}: no such file") from None
    except av.error.EOFError:
        raise _fail(f"{p}: has no frames (the file ends before any video data)") from None
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as e:
        raise _fail(f"{p}: not a readable video ({type(e).__name__}: {e})") from None


def _quarter_turns(degrees: float) -> int:
    """A display rotation as counter-clockwise quarter turns (0..3); angles between are rounded."""
    return int(round(float(degrees) / 90.0)) % 4


def _check_folder_sizes(files: list[Path], size: tuple[int, int]) -> None:
    """Every frame of a folder has the first one's size: read from the file headers (no decoding), so a
    frame of another size is refused before any work, not after earlier windows were computed."""
    for f in files[1:]:
        try:
            with Image.open(f) as im:
                got = im.size
        except (OSError, ValueError) as e:
            raise _fail(f"{f}: not a readable image ({e})") from None
        if got != size:
            raise _fail(f"{f}: is {got[0]}x{got[1]} but the first frame is {size[0]}x{size[1]}")
