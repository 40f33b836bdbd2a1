"""Reading and writing videos, images and folders of frames (PyAV and Pillow).

Reading streams: a video is decoded in chunks of ``chunk`` frames, each a
uint8 tensor ``(n, 3, H, W)``, so a long clip is never held in memory whole.
Images always come out as 3-channel RGB (grayscale, palette and RGBA files
are converted).

Writing is atomic: the file is written under a temporary name in the target
folder and moved into place with ``os.replace`` only when complete; on any
error the temporary file is removed. An existing file is never replaced
unless ``overwrite=True``. Videos are H.264 (libx264, falling back to MPEG-4
part 2 when the PyAV build lacks it) in yuv420p, with the quality set by
``crf``, in the container :mod:`.formats` names for the extension; the input's
audio can be copied into the output (remuxed when the container can carry its
codec, re-encoded to AAC otherwise).

Every problem with a file the user named raises ``MediaError`` with a one-line
message.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .formats import (  # noqa: F401 - the lists live in .formats; re-exported for old imports
    IMAGE_EXTS,
    MP4_AUDIO_CODECS,
    VIDEO_EXTS,
    WRITE_IMAGE_EXTS,
    WRITE_VIDEO_EXTS,
    audio_copy_codecs,
    container,
)

MIN_SIDE = 16
AAC_BITRATE = 160_000


class MediaError(ValueError):
    """A media file cannot be read or written; the message is one line meant for the user."""


def _fail(msg: str) -> MediaError:
    return MediaError(" ".join(str(msg).split()))


# ---------------------------------------------------------------- codecs


def _has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
        return True
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def video_encoder() -> str:
    """The H.264 encoder when PyAV has one, else ``mpeg4``."""
    return "libx264" if _has_encoder("libx264") else "mpeg4"


def available_encoders() -> dict[str, bool]:
    """Which of the encoders this module may use are present in the PyAV build."""
    return {n: _has_encoder(n) for n in ("libx264", "mpeg4", "aac", "libopus", "libmp3lame")}


# ---------------------------------------------------------------- paths


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


# ---------------------------------------------------------------- reading videos


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


def _quarter_turns(degrees: float) -> int:
    """A display rotation as counter-clockwise quarter turns (0..3); angles between are rounded."""
    return int(round(float(degrees) / 90.0)) % 4


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


def read_video(path: str | os.PathLike, chunk: int = 16) -> Iterator[torch.Tensor]:
    """Generator of uint8 ``(n, 3, H, W)`` chunks of a video file."""
    with VideoReader(path, chunk) as r:
        yield from r


# ---------------------------------------------------------------- images and folders


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


# ---------------------------------------------------------------- atomic writes


def _check_output(path: str | os.PathLike, exts: tuple[str, ...], overwrite: bool) -> Path:
    p = Path(path)
    if p.suffix.lower() not in exts:
        raise _fail(f"{p}: unknown output extension {p.suffix or '(none)'!r}; use one of {' '.join(exts)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise _fail(f"{p}: output folder {parent} does not exist")
    if not parent.is_dir():
        raise _fail(f"{p}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _fail(f"{p}: output folder {parent} is not writable")
    if p.is_dir():
        raise _fail(f"{p}: is a folder")
    if p.exists() and not overwrite:
        raise _fail(f"{p}: already exists (pass overwrite=True to replace it)")
    return p


def _temp_name(p: Path) -> Path:
    return p.with_name(f".{p.stem}.tmp-{os.getpid()}-{secrets.token_hex(4)}{p.suffix}")


# our temporary files only: ".<stem>.tmp-<pid>-<8 hex><ext>" (what _temp_name makes)
_TEMP_RE = re.compile(r"^\.(?P<stem>.*)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}(?P<ext>\.[A-Za-z0-9]{1,5})$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, but another user's
        return True
    return True


def sweep_temps(folder: str | os.PathLike, target: str | os.PathLike | None = None) -> list[Path]:
    """Delete our stale temporary files in ``folder`` (their writer's pid is gone); the paths deleted.

    Only names of our own pattern are touched; with ``target``, only those of
    that output. A writer killed with SIGKILL cannot remove its own: the next
    writer into the folder, and the launcher after its ranks are gone, do.
    """
    folder = Path(folder)
    want = Path(target) if target is not None else None
    gone = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return gone
    for e in entries:
        m = _TEMP_RE.match(e.name)
        if m is None or (want is not None and (m["stem"], m["ext"]) != (want.stem, want.suffix)):
            continue
        if int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            gone.append(Path(e.path))
    return gone


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, exts: tuple[str, ...], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it into place on success, delete it on error."""
    p = _check_output(path, exts, overwrite)
    sweep_temps(p.parent if str(p.parent) else ".", p)  # what a killed earlier writer of this output left
    tmp = _temp_name(p)
    try:
        try:
            tmp.touch(exist_ok=False)
        except OSError as e:
            raise _fail(f"{p}: cannot write in {p.parent} ({e.strerror or e})") from None
        yield tmp
        if p.exists() and not overwrite:  # appeared while we were writing
            raise _fail(f"{p}: already exists (pass overwrite=True to replace it)")
        os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


# ---------------------------------------------------------------- writing images


def _hwc(frame: torch.Tensor | np.ndarray) -> np.ndarray:
    x = frame.detach().cpu().numpy() if isinstance(frame, torch.Tensor) else np.asarray(frame)
    if x.ndim == 4 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 3:
        raise ValueError(f"expected one (H, W, 3) or (3, H, W) frame, got shape {x.shape}")
    if x.shape[-1] != 3 and x.shape[0] == 3:
        x = x.transpose(1, 2, 0)
    if x.shape[-1] != 3:
        raise ValueError(f"expected 3 colour channels, got shape {x.shape}")
    if x.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames, got {x.dtype}")
    return np.ascontiguousarray(x)


def write_image(path: str | os.PathLike, frame: torch.Tensor | np.ndarray, *, overwrite: bool = False) -> Path:
    """Write one uint8 frame (``(H, W, 3)`` or ``(3, H, W)``) as png/jpg/webp, atomically."""
    arr = _hwc(frame)
    p = Path(path)
    with atomic_path(p, WRITE_IMAGE_EXTS, overwrite) as tmp:
        fmt = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}[p.suffix.lower()]
        kw = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
        try:
            Image.fromarray(arr, "RGB").save(tmp, format=fmt, **kw)
        except OSError as e:
            raise _fail(f"{p}: writing failed ({e})") from None
    return p


# ---------------------------------------------------------------- writing videos


def _thwc_chunk(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    x = frames.detach().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise ValueError(f"expected (n, H, W, 3) or (n, 3, H, W) frames, got shape {x.shape}")
    if x.shape[-1] != 3 and x.shape[1] == 3:
        x = x.transpose(0, 2, 3, 1)
    if x.shape[-1] != 3:
        raise ValueError(f"expected 3 colour channels, got shape {x.shape}")
    if x.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames, got {x.dtype}")
    return x


_VFR_TICKS = 90000  # the time base of frames written at their own times (the MPEG clock)


class VideoWriter:
    """Write uint8 frames to an MP4 (M4V, MOV or MKV) file, atomically, optionally with another file's audio.

    ``write(frames)`` takes ``(n, H, W, 3)`` (or ``(n, 3, H, W)``) uint8
    chunks; ``close()`` finishes the file and moves it into place. Used as a
    context manager, an exception inside the block discards everything.

    ``audio_from`` names a media file whose first audio stream goes into the
    output: copied packet by packet when the container can carry the codec, otherwise
    decoded and re-encoded to AAC. Audio is interleaved as the video is
    written and cut to the video's duration at ``close()``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fps: float | Fraction,
        *,
        crf: int = 18,
        codec: str | None = None,
        preset: str = "medium",
        audio_from: str | os.PathLike | None = None,
        overwrite: bool = False,
        times: list[float] | None = None,
    ):
        if not 0 <= crf <= 51:
            raise ValueError(f"crf must be in [0, 51], got {crf}")
        self.path = Path(path)
        self.rate = _to_fraction(fps)
        # each frame's time (seconds from the first; a variable frame rate kept as it was), else i / fps
        self.times = [float(t) for t in times] if times else None
        self.crf = crf
        self.codec = codec or video_encoder()
        self.preset = preset
        self.frames_written = 0
        self.audio_mode: str | None = None  # "copy", "aac" or None
        self._closed = False
        self._stream = None
        self._audio_in = None
        self._audio_src = None
        self._audio_out = None
        self._audio_packets: Iterator | None = None
        self._audio_pending = None
        self._resampler = None
        self._audio_offset = 0.0
        self._ctx = atomic_path(self.path, WRITE_VIDEO_EXTS, overwrite)
        self._tmp = self._ctx.__enter__()
        try:
            self._out = av.open(str(self._tmp), "w", format=container(self.path.suffix))
            if audio_from is not None:
                self._open_audio(Path(audio_from))
        except BaseException as e:
            self._abort(e)
            raise

    # -- audio

    def _open_audio(self, src: Path) -> None:
        _check_input(src)
        if src.is_dir() or src.suffix.lower() in IMAGE_EXTS:
            return  # images and folders carry no audio
        self._audio_in = _open_container(src)
        if not self._audio_in.streams.audio:
            self._audio_in.close()
            self._audio_in = None
            return
        a = self._audio_src = self._audio_in.streams.audio[0]
        vs = self._audio_in.streams.video
        # keep A/V sync relative to the first video timestamp of the source
        if vs and vs[0].start_time is not None and vs[0].time_base:
            self._audio_offset = float(vs[0].start_time * vs[0].time_base)
        if a.codec_context.name in audio_copy_codecs(self.path.suffix):
            self.audio_mode = "copy"
            self._audio_out = self._out.add_stream_from_template(a)
        else:
            self.audio_mode = "aac"
            rate = a.codec_context.sample_rate or 48000
            if rate not in (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000):
                rate = 48000
            self._audio_out = self._out.add_stream("aac", rate=rate)
            self._audio_out.bit_rate = AAC_BITRATE
            layout = "mono" if a.codec_context.channels == 1 else "stereo"  # AAC here: mono or stereo
            self._audio_out.layout = layout
            self._resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
        self._audio_packets = self._audio_in.demux(a)

    def _mux_audio_until(self, seconds: float | None) -> None:
        """Copy or transcode the source audio that starts before ``seconds`` of output time (all when None)."""
        if self._audio_packets is None:
            return
        tb = self._audio_src.time_base
        while True:
            pkt = self._audio_pending
            self._audio_pending = None
            if pkt is None:
                pkt = next(self._audio_packets, None)
            if pkt is None:  # source exhausted
                self._audio_packets = None
                return
            if pkt.dts is None and pkt.pts is None:  # the demuxer's final empty packet
                continue
            t = float((pkt.pts if pkt.pts is not None else pkt.dts) * tb) - self._audio_offset
            if seconds is not None and t >= seconds:
                self._audio_pending = pkt  # not yet (or past the end of the video)
                return
            if self.audio_mode == "copy":
                if t >= 0:
                    shift = int(round(self._audio_offset / float(tb)))
                    if pkt.pts is not None:
                        pkt.pts -= shift
                    if pkt.dts is not None:
                        pkt.dts -= shift
                    pkt.stream = self._audio_out
                    self._out.mux(pkt)
            else:
                for frame in pkt.decode():
                    ft = float(frame.pts * frame.time_base) - self._audio_offset if frame.pts is not None else t
                    if ft >= 0:
                        self._encode_audio(frame)

    def _encode_audio(self, frame) -> None:
        """Resample and encode one decoded frame; ``None`` flushes (once)."""
        if self._resampler is None:
            return
        frames = self._resampler.resample(frame)
        for f in frames:
            f.pts = None
            for pkt in self._audio_out.encode(f):
                self._out.mux(pkt)
        if frame is None:
            for pkt in self._audio_out.encode(None):
                self._out.mux(pkt)
            self._resampler = None

    # -- video

    def _open_video(self, width: int, height: int) -> None:
        if width % 2 or height % 2:
            raise _fail(f"{self.path}: {width}x{height} frames cannot be stored as yuv420p (sides must be even)")
        s = self._out.add_stream(self.codec, rate=self.rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        # One encoder thread, set explicitly: the same frames give the same file bytes on any machine and
        # load (the encoder's automatic thread count follows the CPUs, and its threaded rate control is
        # where runs could differ). Encoding is a small part of a restore's time.
        if self.codec in ("libx264", "h264", "libx265"):
            s.options = {"crf": str(self.crf), "preset": self.preset, "threads": "1"}
        else:  # mpeg4 and others: a fixed quantiser roughly matching the crf scale
            q = str(max(2, min(31, round(2 + self.crf * 29 / 51))))
            s.options = {"qmin": q, "qmax": q}
        s.codec_context.thread_count = 1
        s.codec_context.thread_type = "NONE"
        s.codec_context.time_base = 1 / self.rate if self.times is None else Fraction(1, _VFR_TICKS)
        self._stream = s

    def write(self, frames: torch.Tensor | np.ndarray) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")
        try:
            x = _thwc_chunk(frames)
            if self._stream is None:
                self._open_video(x.shape[2], x.shape[1])
            elif (x.shape[2], x.shape[1]) != (self._stream.width, self._stream.height):
                raise ValueError(
                    f"frame size changed from {self._stream.width}x{self._stream.height} to {x.shape[2]}x{x.shape[1]}"
                )
            for arr in x:
                vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")
                if self.times is None:
                    vf.pts = self.frames_written
                    vf.time_base = 1 / self.rate
                else:
                    vf.pts = round(self._time_of(self.frames_written) * _VFR_TICKS)
                    vf.time_base = Fraction(1, _VFR_TICKS)
                for pkt in self._stream.encode(vf):
                    self._out.mux(pkt)
                self.frames_written += 1
            self._mux_audio_until(self.duration)
        except BaseException as e:
            self._abort(e)
            raise

    def _time_of(self, i: int) -> float:
        """Frame ``i``'s time; past the given times, the last gap repeats (the mean frame time for one)."""
        t = self.times
        if i < len(t):
            return t[i]
        gap = t[-1] - t[-2] if len(t) > 1 else float(1 / self.rate)
        return t[-1] + (i - len(t) + 1) * gap

    @property
    def duration(self) -> float:
        if self.times is not None:
            return self._time_of(self.frames_written)  # the next frame's start: where this one ends
        return float(self.frames_written / self.rate)

    def close(self) -> Path:
        """Finish the file and move it into place; returns the final path."""
        if self._closed:
            return self.path
        try:
            if self.frames_written == 0:
                raise _fail(f"{self.path}: no frames were written")
            for pkt in self._stream.encode(None):
                self._out.mux(pkt)
            self._mux_audio_until(self.duration)
            if self.audio_mode == "aac":
                self._encode_audio(None)
            self._out.close()
            if self._audio_in is not None:
                self._audio_in.close()
            self._closed = True
            self._ctx.__exit__(None, None, None)
        except BaseException as e:
            self._abort(e)
            raise
        return self.path

    def _abort(self, exc: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for c in (getattr(self, "_out", None), self._audio_in):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
        err = exc or RuntimeError("aborted")
        with contextlib.suppress(BaseException):
            self._ctx.__exit__(type(err), err, err.__traceback__)

    def abort(self) -> None:
        """Discard the output (the temporary file is removed)."""
        self._abort(None)

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort(exc)


def write_video(
    path: str | os.PathLike,
    frames: torch.Tensor | np.ndarray | Iterable[torch.Tensor | np.ndarray],
    fps: float | Fraction,
    *,
    crf: int = 18,
    codec: str | None = None,
    audio_from: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a clip (one tensor or an iterable of chunks of uint8 frames) atomically; see ``VideoWriter``."""
    with VideoWriter(path, fps, crf=crf, codec=codec, audio_from=audio_from, overwrite=overwrite) as w:
        if isinstance(frames, (torch.Tensor, np.ndarray)):
            w.write(frames)
        else:
            for chunk in frames:
                w.write(chunk)
    return w.path
