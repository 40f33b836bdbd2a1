"""Writing videos and images, atomically (PyAV and Pillow).

The file is written under a temporary name in the target folder and moved into place with
``os.replace`` only when complete; on any error the temporary file is removed. An existing file is
never replaced unless ``overwrite=True``. Videos are H.264 (libx264, falling back to MPEG-4 part 2
when the PyAV build lacks it) in yuv420p, with the quality set by ``crf``, in the container
:mod:`.formats` names for the extension; the input's audio can be copied into the output (remuxed
when the container can carry its codec, re-encoded to AAC otherwise).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from .formats import IMAGE_EXTS, WRITE_IMAGE_EXTS, WRITE_VIDEO_EXTS, audio_copy_codecs, container
from .media import _check_input, _fail, _open_container, _to_fraction


AAC_BITRATE = 160_000


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
