"""Reading videos, images and folders of frames (PyAV and Pillow), streamed.

A video is decoded in chunks of ``chunk`` frames, each a uint8 tensor ``(n, 3, H, W)``, so a long
clip is never held in memory whole. Images always come out as 3-channel RGB (grayscale, palette
and RGBA files are converted). Every problem raises :class:`~.media.MediaError` (one line).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .formats import IMAGE_EXTS
from .media import VideoInfo, _check_input, _check_size, _fail, _open_container, _quarter_turns, natural_key


class VideoReader:
    """Stream a video's frames as uint8 ``(n, 3, H, W)`` chunks.

    Opening decodes the first frame, so a corrupt, empty or too-small file
    fails here with ``MediaError`` rather than half-way through. Use as a
    context manager or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, chunk: int = 16):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        p = _check_input(path)
        if p.is_dir():
            raise _fail(f"{p}: is a folder, not a video")
        self.chunk = chunk
        self._container = _open_container(p)
        try:
            vs = self._container.streams.video
            if not vs:
                raise _fail(f"{p}: has no video stream")
            stream = vs[0]
            stream.thread_type = "AUTO"
            audio = self._container.streams.audio
            self._frames_iter = self._container.decode(stream)
            self._rot = None  # quarter turns, from the first frame's display matrix
            self._first = self._decode_next(p)
            if self._first is None:
                raise _fail(f"{p}: has no frames")
            h, w = self._first.shape[-2:]  # after the rotation: the frames as they are meant to be shown
            _check_size(p, w, h)
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            rate = Fraction(rate) if rate else Fraction(0)
            n = stream.frames or None
            if n is None and stream.duration and stream.time_base and rate:
                n = int(round(float(stream.duration * stream.time_base * rate)))
            self.info = VideoInfo(
                path=p,
                width=int(w),
                height=int(h),
                fps=float(rate),
                rate=rate,
                frames=n,
                has_audio=bool(audio),
                video_codec=stream.codec_context.name,
                audio_codec=audio[0].codec_context.name if audio else None,
                rotation=(self._rot or 0) * 90,
            )
        except BaseException:
            self._container.close()
            raise

    def _decode_next(self, p: Path) -> torch.Tensor | None:
        try:
            frame = next(self._frames_iter)
        except (StopIteration, av.error.EOFError):
            return None
        except av.error.FFmpegError as e:
            raise _fail(f"{p}: decoding failed ({type(e).__name__}: {e})") from None
        if self._rot is None:  # the first frame: its display matrix
            self._rot = _quarter_turns(getattr(frame, "rotation", 0) or 0)
        arr = frame.to_ndarray(format="rgb24")
        t = torch.from_numpy(arr).permute(2, 0, 1)
        if self._rot:  # apply the display rotation (counter-clockwise), so the output plays upright
            t = torch.rot90(t, self._rot, dims=(1, 2)).contiguous()
        return t

    def __iter__(self) -> Iterator[torch.Tensor]:
        p = self.info.path
        buf: list[torch.Tensor] = []
        if self._first is not None:
            buf.append(self._first)
            self._first = None
        while True:
            f = self._decode_next(p)
            if f is None:
                break
            if f.shape[-2:] != (self.info.height, self.info.width):
                raise _fail(f"{p}: frame size changes mid-stream ({self.info.width}x{self.info.height} -> "
                            f"{f.shape[-1]}x{f.shape[-2]})")
            buf.append(f)
            if len(buf) == self.chunk:
                yield torch.stack(buf)
                buf = []
        if buf:
            yield torch.stack(buf)

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_video(path: str | os.PathLike, chunk: int = 16) -> Iterator[torch.Tensor]:
    """Generator of uint8 ``(n, 3, H, W)`` chunks of a video file."""
    with VideoReader(path, chunk) as r:
        yield from r


def read_image(path: str | os.PathLike) -> torch.Tensor:
    """An image file as uint8 ``(1, 3, H, W)`` RGB."""
    p = _check_input(path)
    if p.is_dir():
        raise _fail(f"{p}: is a folder, not an image")
    if p.suffix.lower() not in IMAGE_EXTS:
        raise _fail(f"{p}: unknown image extension {p.suffix or '(none)'!r}; images: {' '.join(IMAGE_EXTS)}")
    try:
        with Image.open(p) as im:
            im.load()
            if im.mode.startswith("I"):  # 16-bit (or 32-bit int) greyscale: scale by its range, not clip at 255
                arr = _grey_to_u8(np.asarray(im), im.mode)
                _check_size(p, arr.shape[1], arr.shape[0])
                return torch.from_numpy(np.repeat(arr[None], 3, axis=0).copy()).unsqueeze(0)
            rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise _fail(f"{p}: not a readable image ({type(e).__name__}: {e})") from None
    _check_size(p, rgb.width, rgb.height)
    arr = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).unsqueeze(0)


def _grey_to_u8(arr: np.ndarray, mode: str) -> np.ndarray:
    """Integer greyscale to uint8 by the format's range: 16 bits (PNG's ``I;16``/``I``) unless values exceed it."""
    a = arr.astype(np.float64)
    top = 65535.0 if a.max(initial=0) <= 65535 else float(a.max())
    return np.clip(np.round(a * (255.0 / top)), 0, 255).astype(np.uint8)


def list_frames(folder: str | os.PathLike) -> list[Path]:
    """The image files of a folder in natural order (``2.png`` before ``10.png``); hidden files skipped."""
    p = _check_input(folder)
    if not p.is_dir():
        raise _fail(f"{p}: is not a folder")
    files = [f for f in p.iterdir() if not f.name.startswith(".") and f.suffix.lower() in IMAGE_EXTS]
    for f in files:
        _check_input(f)  # a pipe named like a frame is refused, not read (f.is_file() would skip a folder)
    files = [f for f in files if f.is_file()]
    if not files:
        raise _fail(f"{p}: no image files ({' '.join(IMAGE_EXTS)}) in the folder")
    return sorted(files, key=lambda f: natural_key(f.name))


def read_frame_folder(folder: str | os.PathLike, chunk: int = 16) -> Iterator[torch.Tensor]:
    """Generator of uint8 ``(n, 3, H, W)`` chunks of a folder of same-size images."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    files = list_frames(folder)
    size = None
    buf: list[torch.Tensor] = []
    for f in files:
        img = read_image(f)[0]
        if size is None:
            size = img.shape
        elif img.shape != size:
            raise _fail(f"{f}: is {img.shape[2]}x{img.shape[1]} but the first frame is {size[2]}x{size[1]}")
        buf.append(img)
        if len(buf) == chunk:
            yield torch.stack(buf)
            buf = []
    if buf:
        yield torch.stack(buf)
