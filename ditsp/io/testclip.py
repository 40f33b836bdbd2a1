"""A synthetic test clip: moving texture, a gliding disc, fine stripes and a sine tone.

The scene has what a restoration run should keep stable over time: a
checkerboard scrolling diagonally (edges that move), a disc with a radial
colour gradient sliding across the frame (smooth shading), a band of thin
text-like stripes drifting sideways (high frequencies), and a 440 Hz tone in
the audio track. Every frame is a pure function of its index, so the clip is
reproducible bit for bit before encoding.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

from .formats import WRITE_VIDEO_EXTS, container
from .media import _fail, _to_fraction
from .write import atomic_path, video_encoder
import argparse

__all__ = ["make_test_clip", "scene_frame", "scene_frames"]

AUDIO_RATE = 48_000
TONE_HZ = 440.0


def scene_frame(index: int, width: int, height: int) -> np.ndarray:
    """Frame ``index`` of the scene as uint8 ``(height, width, 3)``."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    cell = max(4, min(width, height) // 6)
    # scrolling checkerboard, two grey levels with a blue tint
    sx, sy = x + 0.5 * index, y + 0.25 * index
    checker = ((np.floor(sx / cell) + np.floor(sy / cell)) % 2).astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    img[..., 0] = 60 + 90 * checker
    img[..., 1] = 70 + 90 * checker
    img[..., 2] = 100 + 100 * checker
    # a disc with a radial gradient gliding along an ellipse
    phase = 2 * math.pi * index / 24.0
    cx = width * (0.5 + 0.3 * math.cos(phase))
    cy = height * (0.5 + 0.25 * math.sin(phase))
    r = min(width, height) * 0.28
    d = np.sqrt((x - cx) ** 2 + (y - cy) ** 2) / r
    inside = np.clip(1.0 - d, 0.0, 1.0)
    alpha = np.clip((1.0 - d) * r / 1.5, 0.0, 1.0)  # antialiased rim
    disc = np.stack([230 * (0.4 + 0.6 * inside), 120 + 100 * inside, 40 + 60 * (1 - inside)], axis=-1)
    img = img * (1 - alpha[..., None]) + disc * alpha[..., None]
    # a band of thin stripes, like a line of text, drifting right
    band = (y >= height * 0.78) & (y < height * 0.9)
    stripes = (((x - index) // 2) % 3 == 0) & (((x - index) // 7) % 4 != 3)
    img[band & stripes] = (250, 250, 240)
    img[band & ~stripes] = (20, 20, 30)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def scene_frames(frames: int, width: int, height: int) -> torch.Tensor:
    """The first ``frames`` frames as uint8 ``(frames, 3, height, width)`` (the readers' layout)."""
    return torch.from_numpy(np.stack([scene_frame(i, width, height) for i in range(frames)])).permute(0, 3, 1, 2)


def make_test_clip(
    path: str | os.PathLike,
    *,
    width: int = 64,
    height: int = 48,
    frames: int = 17,
    fps: float | Fraction = 24,
    audio: bool = True,
    audio_codec: str = "aac",
    crf: int = 12,
    overwrite: bool = False,
) -> Path:
    """Write the scene as a video file (mp4/mov/mkv) with an optional sine-tone track; returns the path.

    ``audio_codec`` may be any encoder the container takes (e.g.
    ``pcm_s16le`` in mkv/mov, to exercise re-encoding on output).
    """
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if width % 2 or height % 2 or width < 16 or height < 16:
        raise ValueError(f"width and height must be even and >= 16, got {width}x{height}")
    p = Path(path)
    rate = _to_fraction(fps)
    with atomic_path(p, WRITE_VIDEO_EXTS, overwrite) as tmp:
        try:
            with av.open(str(tmp), "w", format=container(p.suffix)) as out:
                vs = out.add_stream(video_encoder(), rate=rate)
                vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
                if vs.codec_context.name == "libx264":
                    vs.options = {"crf": str(crf), "preset": "fast"}
                vs.codec_context.time_base = 1 / rate
                aus = None
                if audio:
                    aus = out.add_stream(audio_codec, rate=AUDIO_RATE)
                    aus.layout = "mono"
                    if audio_codec == "aac":
                        aus.bit_rate = 96_000
                apts = 0
                n_audio = int(round(frames / rate * AUDIO_RATE))
                per_frame = AUDIO_RATE / float(rate)
                for i in range(frames):
                    vf = av.VideoFrame.from_ndarray(scene_frame(i, width, height), format="rgb24")
                    vf.pts, vf.time_base = i, 1 / rate
                    for pkt in vs.encode(vf):
                        out.mux(pkt)
                    if aus is not None:
                        upto = min(n_audio, int(round((i + 1) * per_frame)))
                        apts = _write_tone(out, aus, apts, upto)
                for pkt in vs.encode(None):
                    out.mux(pkt)
                if aus is not None:
                    _write_tone(out, aus, apts, n_audio)
                    for pkt in aus.encode(None):
                        out.mux(pkt)
        except av.error.FFmpegError as e:
            raise _fail(f"{p}: writing the test clip failed ({e})") from None
    return p


def _write_tone(out, stream, start: int, stop: int) -> int:
    """Encode tone samples ``[start, stop)``; returns ``stop``."""
    ctx = stream.codec_context
    fmt = ctx.format.name if ctx.format is not None else "fltp"
    s = start
    while s < stop:  # PyAV regroups samples into the encoder's frame size
        n = min(4096, stop - s)
        t = (np.arange(s, s + n) / AUDIO_RATE).astype(np.float64)
        wave = 0.3 * np.sin(2 * np.pi * TONE_HZ * t)
        if fmt.startswith("s16"):
            data = np.rint(wave * 32767).astype(np.int16)[None]
        else:
            data = wave.astype(np.float32)[None]
        af = av.AudioFrame.from_ndarray(data, format=fmt, layout="mono")
        af.sample_rate = AUDIO_RATE
        af.pts = s
        af.time_base = Fraction(1, AUDIO_RATE)
        for pkt in stream.encode(af):
            out.mux(pkt)
        s += n
    return s


def main(argv: list[str] | None = None) -> int:
    """``python -m ditsp.io.testclip OUT.mp4 [--size 64x48] [--frames 17] [--fps 24] [--no-audio]``."""
    ap = argparse.ArgumentParser(prog="python -m ditsp.io.testclip", description="write the synthetic test clip")
    ap.add_argument("out")
    ap.add_argument("--size", default="64x48", help="WIDTHxHEIGHT, even sides >= 16")
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--fps", type=float, default=24.0)
    ap.add_argument("--no-audio", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        w, h = (int(v) for v in a.size.lower().split("x"))
        p = make_test_clip(a.out, width=w, height=h, frames=a.frames, fps=a.fps, audio=not a.no_audio,
                           overwrite=a.overwrite)
    except ValueError as e:  # MediaError included
        ap.exit(2, f"error: {e}\n")
    print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
