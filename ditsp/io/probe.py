"""Probing an input before (and as) it is read: :func:`probe` (size, rate, frames, audio; one frame
decoded), :func:`frame_times` and :func:`count_frames` (packets only, no decoding), and
:func:`open_media`, the info and the chunk stream of any input together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from fractions import Fraction

import av
import numpy as np
import torch

from .media import VideoInfo, _check_folder_sizes, _check_input, _fail, _open_container, media_kind
from .read import VideoReader, list_frames, read_frame_folder, read_image


def frame_times(path: str | os.PathLike, rate: Fraction | float | None = None) -> list[float] | None:
    """Each frame's presentation time in seconds from the first, when the video's frame rate varies
    (variable frame rate, a GIF's per-frame delays); None when every frame lasts ``1/rate``.

    Read from the packets (no decoding). A writer given these times keeps them, so frames stay in step
    with the copied audio instead of being re-timed to a constant rate.
    """
    p = _check_input(path)
    with _open_container(p) as c:
        stream = c.streams.video[0]
        tb = stream.time_base
        pts = sorted(pkt.pts for pkt in c.demux(stream) if pkt.pts is not None)
    if len(pts) < 2 or tb is None:
        return None
    times = [float((x - pts[0]) * tb) for x in pts]
    gaps = np.diff(times)
    if rate:
        step = 1.0 / float(rate)
        if np.all(np.abs(gaps - step) <= 0.01 * step + 1e-4):
            return None
    elif np.ptp(gaps) <= 1e-4:
        return None
    return times


def probe(path: str | os.PathLike) -> VideoInfo:
    """Info about a video, an image or a folder of frames (decodes one frame)."""
    p = _check_input(path)
    kind = media_kind(p)
    if kind == "video":
        with VideoReader(p, chunk=1) as r:
            return r.info
    if kind == "image":
        img = read_image(p)
        return VideoInfo(p, img.shape[-1], img.shape[-2], 0.0, Fraction(0), 1, False, p.suffix[1:].lower(), None,
                         "image")
    files = list_frames(p)
    first = read_image(files[0])
    _check_folder_sizes(files, (first.shape[-1], first.shape[-2]))
    return VideoInfo(p, first.shape[-1], first.shape[-2], 0.0, Fraction(0), len(files), False, "images", None,
                     "folder")


def count_frames(path: str | os.PathLike) -> int:
    """Exact number of video frames, by reading the packets without decoding them.

    For containers that do not store a frame count (mkv, webm, some mov).
    """
    p = _check_input(path)
    with contextlib.closing(_open_container(p)) as c:
        if not c.streams.video:
            raise _fail(f"{p}: has no video stream")
        try:
            return sum(1 for pkt in c.demux(c.streams.video[0]) if pkt.size)
        except av.error.FFmpegError as e:
            raise _fail(f"{p}: reading failed ({type(e).__name__}: {e})") from None


def open_media(path: str | os.PathLike, chunk: int = 16) -> tuple[VideoInfo, Iterator[torch.Tensor]]:
    """``(info, chunks)`` for a video file, an image or a folder of frames.

    The video is opened (and checked) before this returns; the chunk iterator
    closes it when exhausted.
    """
    p = _check_input(path)
    kind = media_kind(p)
    if kind == "video":
        r = VideoReader(p, chunk)

        def gen() -> Iterator[torch.Tensor]:
            with r:
                yield from r

        return r.info, gen()
    info = probe(p)
    if kind == "image":
        return info, iter([read_image(p)])
    return info, read_frame_folder(p, chunk)
