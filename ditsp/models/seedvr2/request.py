"""The restoration request and every check on it, below every front door (CLI, HTTP, Python).

A front door turns what it was given into :class:`Options` (``from_args`` for
`ditsp upscale`'s argparse namespace, ``from_http`` for a server job's JSON
options), then :func:`check` makes the :class:`UpscaleRequest` or raises
``ValueError`` with one line, and :func:`check_memory` compares the modelled
per-rank memory with the budget. Every list of allowed values comes from the
module that owns it (formats: ``ditsp.io.formats``; VAE modes:
``vae/modes.py``; colour fixes: ``pipeline/color_fix.py``; planners:
``ditsp.windows.planners``; dtypes: ``ditsp.dtypes``; models and the default
dtype: ``weights.py``), so a front door never offers what the job refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...dtypes import NAMES as DTYPE_NAMES
from ...fixed_shape import DEFAULT_DETERMINISTIC
from ...io.formats import WRITE_IMAGE_EXTS, WRITE_VIDEO_EXTS, output_exts
from ...weights.fp8 import WEIGHTS_DTYPES
from ...weights.shared import READS as WEIGHTS_READS
from ...windows.planners import PLANNERS as _PLANNER_TABLE
from .pipeline.color_fix import METHODS as COLOR_FIXES
from .vae.modes import AUTO
from .vae.modes import CHOICES as VAE_MODES
from .presets import OFFERED as MODELS
from .presets import default_dtype
from .sizing import parse_resolution
from ...weights import FormatError
from .budget import GiB, available_bytes, estimate, suggestions
from .vae.memory import backend_of, counts_winograd
from ...memory import check_local_ranks
from .weight_memory import dit_weights

__all__ = ["COLOR_FIXES", "DTYPE_NAMES", "HTTP_OPTIONS", "MODELS", "OUTPUT_FORMATS", "PLANNERS", "VAE_MODES",
           "WEIGHTS_DTYPES", "WEIGHTS_READS", "Checked", "Options", "UpscaleRequest", "check", "check_memory", "from_args",
           "from_http", "parse_http_options"]

if TYPE_CHECKING:
    from .weights import WeightsSpec

PLANNERS = tuple(_PLANNER_TABLE)  # registered at import; a planner registered later is not offered
# what a server job may ask its result to be written as (extensions without the dot)
OUTPUT_FORMATS = tuple(e[1:] for e in WRITE_VIDEO_EXTS + WRITE_IMAGE_EXTS)
DEFAULT_AREA = (1280, 720)  # the reference's default target area


def _weights(*args, **kw):
    # .weights imports the DiT and the VAE (~0.5 s on every `ditsp` start, which lists these values): only on use
    from .weights import WeightsSpec

    return WeightsSpec(*args, **kw)


@dataclass(frozen=True)
class UpscaleRequest:
    """One restoration; identical on every rank."""

    input: str
    output: str
    weights: WeightsSpec = field(default_factory=_weights)
    area: tuple[int, int] | None = None  # target area (w, h), aspect kept; None: the input's size
    size: tuple[int, int] | None = None  # exact output size (w, h) before the crop to 16
    seed: int = 666
    color_fix: str = "wavelet"
    window_frames: int = 0  # 0: the whole clip in one window
    overlap: int = 4
    vae_mode: str = "auto"
    vae_chunk: int = 1
    budget_gib: float | None = None  # per-rank memory budget for the VAE's auto mode and the estimate
    planner: str | None = None  # None: the DiT's SP path by the cost model (path auto); a name: Plan A with it
    sp: int = 1
    crf: int = 18
    fps: float | None = None  # output frame rate; default: the input's (24 for a folder of frames)
    overwrite: bool = False
    progress: bool = True
    sample_frames: int = 0  # keep this many (input, output) frame pairs for a picture
    handoff: bool = True  # height-sharded VAE: slabs straight to the DiT's windows (False: gather, then scatter)
    deterministic: bool = DEFAULT_DETERMINISTIC  # fixed-shape kernel calls in the DiT and the VAE: the same frames at every SP degree
    compile: bool = False  # torch.compile of the DiT blocks and the VAE (compiled.py); needs deterministic=False


@dataclass
class Options:
    """What a front door was asked, before any check (the names of `ditsp upscale`'s flags)."""

    input: str
    output: str
    sp: int = 1
    model: str = "tiny"
    dit: str | None = None
    vae: str | None = None
    text_embedding: str | None = None
    dtype: str | None = None  # None: default_dtype(model)
    weights_dtype: str | None = "stored"
    weights_read: str | None = None  # None: ditsp/weights/shared.py's default
    resolution: str | None = None
    scale: float | None = None
    size: str | None = None
    seed: int = 666
    color_fix: str = "wavelet"
    window_frames: int = 0
    overlap: int = 4
    vae_mode: str = AUTO
    vae_chunk: int = 1
    planner: str | None = None
    max_memory: float | None = None  # GiB per rank; None: free memory / local ranks
    force: bool = False
    fps: float | None = None
    crf: int = 18
    overwrite: bool = False
    threads: int = 1
    timeout: float = 3600.0
    sample_frames: int = 0
    progress: bool = True
    deterministic: bool = DEFAULT_DETERMINISTIC
    compile: bool = False


def from_args(args) -> Options:
    """`ditsp upscale`'s argparse namespace as options (a namespace may lack the newer flags)."""
    names = Options.__dataclass_fields__
    o = Options(**{k: getattr(args, k) for k in names if hasattr(args, k)
                   and k not in ("sample_frames", "progress")})
    o.sample_frames = 4 if getattr(args, "plot", None) else 0
    o.progress = not getattr(args, "no_progress", False) and not getattr(args, "json", False)
    return o


# HTTP option -> (type, allowed values or None); everything else is refused
HTTP_OPTIONS = {
    "resolution": (str, None), "scale": (float, None), "size": (str, None), "seed": (int, None),
    "color_fix": (str, COLOR_FIXES), "window_frames": (int, None), "overlap": (int, None),
    "vae_mode": (str, VAE_MODES), "vae_chunk": (int, None), "planner": (str, PLANNERS), "crf": (int, None),
    "fps": (float, None), "format": (str, OUTPUT_FORMATS),
}


def parse_http_options(opts) -> dict:
    """A job's JSON options, type-checked against :data:`HTTP_OPTIONS`; ValueError (one line) otherwise."""
    if not isinstance(opts, dict):
        raise ValueError("options: must be a JSON object")
    out = {}
    for k, v in opts.items():
        if k not in HTTP_OPTIONS:
            raise ValueError(f"options: unknown option {k!r}; known: {', '.join(sorted(HTTP_OPTIONS))}")
        typ, choices = HTTP_OPTIONS[k]
        if v is None:
            continue
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ValueError(f"options: {k} must be {typ.__name__}")
        if choices and v not in choices:
            raise ValueError(f"options: {k} must be one of {', '.join(choices)}")
        out[k] = v
    if sum(k in out for k in ("resolution", "scale", "size")) > 1:
        raise ValueError("options: give at most one of resolution, scale, size")
    return out


def from_http(opts: dict, *, input: str, output: str, **server) -> Options:
    """A server job: its checked HTTP options (``format`` already chosen the output's name) and the server's
    own settings (``sp``, ``model``, checkpoints, ``dtype``, ``threads``, ``timeout``, ``deterministic``,
    ``compile``)."""
    job = {k: v for k, v in opts.items() if k != "format"}
    return Options(input=input, output=output, **server, **job, progress=False)


@dataclass(frozen=True)
class Checked:
    """A request that passed every check, with what the checks learnt about its input."""

    req: UpscaleRequest
    info: object  # ditsp.io.media.VideoInfo
    frames: int
    geo: object  # pipeline.sizing.FrameGeometry
    window: int  # frames of the largest temporal window


def _wxh(text: str, what: str) -> tuple[int, int]:
    try:
        return parse_resolution(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def check(o: Options) -> Checked:
    """Everything that can be checked before ranks start; ValueError with a one-line message."""
    # the input's probe opens PyAV; kept local so a front door that only lists values does not load codecs
    from ...io.media import MediaError
    from ...io.probe import count_frames, probe
    from .pipeline.padding import padded_length
    from .pipeline.sizing import frame_geometry
    from .pipeline.windows import check_window

    if o.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {o.sp}")
    if "WORLD_SIZE" not in os.environ:  # local ranks, spawned here: bounded even with --force
        check_local_ranks(o.sp)
    if o.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {o.threads}")
    if o.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {o.timeout}")
    if o.vae_chunk < 1:
        raise ValueError(f"--vae-chunk must be >= 1, got {o.vae_chunk}")
    if o.fps is not None and not 0 < o.fps <= 1000:
        raise ValueError(f"--fps must be in (0, 1000], got {o.fps}")
    if not 0 <= o.crf <= 51:
        raise ValueError(f"--crf must be in 0..51, got {o.crf}")
    if o.compile:
        from .compiled import check_policy  # local: .compiled loads torch's compiler stack, only for --compile

        check_policy(o.deterministic)
    _choice("--color-fix", o.color_fix, COLOR_FIXES)
    _choice("--vae-mode", o.vae_mode, VAE_MODES)
    if o.planner is not None:
        _choice("--planner", o.planner, PLANNERS)
    if o.dtype is not None:
        _choice("--dtype", o.dtype, DTYPE_NAMES)
    for flag, path in (("--dit", o.dit), ("--vae", o.vae), ("--text-embedding", o.text_embedding)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    try:
        info = probe(o.input)
        frames = info.frames if info.frames is not None else count_frames(o.input)
    except MediaError as e:
        raise ValueError(str(e)) from None
    if frames < 1:
        raise ValueError(f"{o.input}: has no frames")
    out = Path(o.output)
    allowed = output_exts(info.kind)
    if out.suffix.lower() not in allowed:
        kind = "an image" if info.kind == "image" else "a video"
        raise ValueError(f"{o.output}: {kind} input needs an output ending in {', '.join(allowed)}")
    if out.exists() and not o.overwrite:
        raise ValueError(f"{o.output} exists; pass --overwrite to replace it")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{o.output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{o.output}: folder {folder} is not writable")
    if os.path.abspath(o.output) == os.path.abspath(o.input):
        raise ValueError("the output would overwrite the input")
    area = size = None
    if o.resolution:
        area = _wxh(o.resolution, "--resolution")
    elif o.size:
        size = _wxh(o.size, "--size")
    elif o.scale:
        if not 0 < o.scale <= 16:
            raise ValueError(f"--scale must be in (0, 16], got {o.scale}")
        area = (round(info.width * o.scale), round(info.height * o.scale))
    else:
        area = DEFAULT_AREA
    geo = frame_geometry(info.width, info.height, area=area, size=size)
    if geo.out_width < 16 or geo.out_height < 16:
        raise ValueError(f"{geo.describe()}: the output must be at least 16x16 after the crop to multiples of 16")
    if o.window_frames:
        check_window(o.window_frames, o.overlap)
    elif o.overlap < 0:
        raise ValueError(f"--overlap must be >= 0, got {o.overlap}")
    dtype = o.dtype or default_dtype(o.model)
    weights_dtype = None if o.weights_dtype in (None, "stored") else o.weights_dtype
    weights = _weights(o.model, o.dit, o.vae, o.text_embedding, dtype, weights_dtype=weights_dtype, read=o.weights_read)
    req = UpscaleRequest(
        input=o.input, output=o.output, weights=weights, area=area, size=size, seed=o.seed,
        color_fix=o.color_fix, window_frames=o.window_frames, overlap=o.overlap, vae_mode=o.vae_mode,
        vae_chunk=o.vae_chunk, budget_gib=o.max_memory, planner=o.planner, sp=o.sp, crf=o.crf, fps=o.fps,
        overwrite=o.overwrite, progress=o.progress, sample_frames=o.sample_frames, deterministic=o.deterministic,
        compile=o.compile,
    )
    window = min(o.window_frames or padded_length(frames), padded_length(frames))
    return Checked(req, info, frames, geo, window)


def check_memory(c: Checked, o: Options) -> str:
    """The estimate's line; raises MemoryError naming what would fit when it does not."""

    req, geo, window = c.req, c.geo, c.window
    local = 1 if "WORLD_SIZE" in os.environ else req.sp
    budget = int(o.max_memory * GiB) if o.max_memory else available_bytes(local)
    w = req.weights
    try:  # the DiT's weights as the rank will keep them (a checkpoint's header, or the format asked for)
        kept = dit_weights(w.model, w.dtype, checkpoint=w.dit, weights_dtype=w.weights_dtype)
    except FormatError as e:
        raise ValueError(f"--dit {e}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    filters, backend = counts_winograd(device, req.deterministic), backend_of(device, req.deterministic)
    est = estimate(w.model, w.dtype, window, geo.out_hw, req.sp, req.vae_mode,
                   budget if req.vae_mode == AUTO else None, req.vae_chunk, weights=kept, winograd_filters=filters,
                   vae_backend=backend)
    line = f"memory estimate: {est.describe()}; budget {budget / GiB:.2f} GiB per rank"
    if est.total > budget and not o.force:
        fits = suggestions(w.model, w.dtype, window, geo.out_hw, req.sp, req.vae_mode, budget, window, weights=kept,
                           winograd_filters=filters, vae_backend=backend)
        hint = ("; would fit: " + ", ".join(fits)) if fits else "; nothing smaller fits (try a smaller --resolution)"
        raise MemoryError(f"{line}: does not fit{hint} (or pass --force)")
    return line
