"""The restoration request and every check on it, below every front door (CLI, HTTP, Python).

A front door turns what it was given into :class:`Options` (``from_args`` for
`ditsp upscale`'s argparse namespace, ``from_http`` for a server job's JSON
options; its flags' defaults are :class:`Options`' own, :func:`default`), then
:func:`check` makes the :class:`UpscaleRequest`, with its
:class:`~.plan.RestorationPlan` built once, or raises ``ValueError`` with one
line, and :func:`check_memory` holds the plan's per-rank memory against its
budget. The ranks read the plan; nothing downstream derives a size again. Every list of allowed values comes from the
module that owns it (formats: ``ditsp.io.formats``; VAE modes:
``vae/modes.py``; colour fixes: ``pipeline/color_fix.py``; stitches: ``pipeline/windows.py``; planners:
``ditsp.windows.planners``; dtypes: ``ditsp.dtypes``; models and the default
dtype: ``weights.py``), so a front door never offers what the job refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ....dtypes import NAMES as DTYPE_NAMES
from ....fixed_shape import DEFAULT_DETERMINISTIC
from ....io.formats import WRITE_IMAGE_EXTS, WRITE_VIDEO_EXTS, output_exts
from ....weights.fp8 import WEIGHTS_DTYPES
from ....weights.shared import READS as WEIGHTS_READS
from ....windows.planners import PLANNERS as _PLANNER_TABLE
from ..pipeline.color_fix import METHODS as COLOR_FIXES

MODEL_COLOR_FIX = "model"  # --color-fix's default: the model's own (presets.Model.color_fix)
COLOR_FIX_CHOICES = (MODEL_COLOR_FIX,) + tuple(COLOR_FIXES)
from ..pipeline.windows import STITCHES
from ..vae.modes import AUTO
from ..vae.modes import CHOICES as VAE_MODES
from ..presets import OFFERED as MODELS
from ..presets import DEFAULT_MODEL, default_dtype, model as model_of
from .sizing import parse_resolution
from ....weights import FormatError
from .budget import GiB, available_bytes, rank_suggestions, suggestions
from ....windows.capacity import Capacities, check_per_rank
from ..vae.memory import backend_of, counts_winograd
from ....memory import check_local_cores, check_local_ranks
from ....distributed.torchrun import under_torchrun
from .weight_memory import dit_weights
from . import plan as restoration_plan

__all__ = ["COLOR_FIXES", "COLOR_FIX_CHOICES", "DTYPE_NAMES", "HTTP_OPTIONS", "MODELS", "OUTPUT_FORMATS", "PLANNERS", "STITCHES", "VAE_MODES",
           "WEIGHTS_DTYPES", "WEIGHTS_READS", "Checked", "Options", "UpscaleRequest", "check", "check_memory", "default",
           "capacities", "frames_info", "from_args", "from_http", "parse_http_options", "prepare"]

if TYPE_CHECKING:
    from ..weights import WeightsSpec
    from .plan import RestorationPlan

PLANNERS = tuple(_PLANNER_TABLE)  # registered at import; a planner registered later is not offered
# what a server job may ask its result to be written as (extensions without the dot)
OUTPUT_FORMATS = tuple(e[1:] for e in WRITE_VIDEO_EXTS + WRITE_IMAGE_EXTS)


def _weights(*args, **kw):
    # .weights imports the DiT and the VAE (~0.5 s on every `ditsp` start, which lists these values): only on use
    from ..weights import WeightsSpec

    return WeightsSpec(*args, **kw)


@dataclass(frozen=True)
class UpscaleRequest:
    """One restoration as the ranks run it; identical on every rank. Every derived value (sizes, windows,
    latents, VAE modes, the degree, the kernel policy, memory) is in ``plan``."""

    input: str
    output: str
    plan: RestorationPlan
    weights: WeightsSpec = field(default_factory=_weights)
    color_fix: str = "wavelet"
    crf: int = 18
    fps: float | None = None  # output frame rate; default: the input's (24 for a folder of frames)
    overwrite: bool = False
    progress: bool = True
    sample_frames: int = 0  # keep this many (input, output) frame pairs for a picture
    handoff: bool = True  # height-sharded VAE: slabs straight to the DiT's windows (False: gather, then scatter)
    compile: bool = False  # torch.compile of the DiT blocks and the VAE (compiled.py); needs deterministic=False
    # The input in memory instead of a file (a host that holds frames, e.g. the ComfyUI nodes): uint8
    # (T, 3, H, W), the same on every rank; ``input`` is then only a label, nothing is written, and rank 0
    # returns the restored frames in its report (``output_frames``: uint8 (T, H, W, 3)).
    frames: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def sp(self) -> int:
        return self.plan.sp

    @property
    def deterministic(self) -> bool:
        return self.plan.deterministic


@dataclass
class Options:
    """What a front door was asked, before any check (the names of `ditsp upscale`'s flags)."""

    input: str
    output: str
    sp: int = 1
    model: str = DEFAULT_MODEL
    random_weights: bool = False  # seeded random weights (smoke tests, benchmarks); else checkpoints or shipped files
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
    color_fix: str = MODEL_COLOR_FIX  # a key of pipeline/color_fix.py, or the model's own
    window_frames: int = 0
    overlap: int = 4
    stitch: str = STITCHES[0]  # how consecutive windows are joined (pipeline/windows.py)
    vae_mode: str = AUTO
    vae_chunk: int = 1
    planner: str | None = None
    max_memory: float | None = None  # GiB per rank; None: free memory / local ranks
    rank_memory: tuple[float, ...] | None = None  # GiB, one per rank (ranks of unequal memory); excludes max_memory
    rank_speed: tuple[float, ...] | None = None  # relative, one per rank; None: from each rank's memory
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


def default(name: str):
    """The default of option ``name`` (a front door's flag defaults come from here)."""
    return Options.__dataclass_fields__[name].default


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
    "color_fix": (str, COLOR_FIX_CHOICES), "window_frames": (int, None), "overlap": (int, None), "stitch": (str, STITCHES),
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

    @property
    def plan(self) -> RestorationPlan:
        return self.req.plan


def _wxh(text: str, what: str) -> tuple[int, int]:
    try:
        return parse_resolution(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _output_size(o: Options, info) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(area, size) of the output as ``frame_geometry`` takes them: the flags', else the model's default."""
    if o.resolution:
        return _wxh(o.resolution, "--resolution"), None
    if o.size:
        return None, _wxh(o.size, "--size")
    scale = o.scale
    if scale is None:
        m = model_of(o.model)
        if m.scale is None:
            return m.area, None
        scale = m.scale
    if not 0 < scale <= 16:
        raise ValueError(f"--scale must be in (0, 16], got {scale}")
    return (round(info.width * scale), round(info.height * scale)), None


def budget_bytes(max_memory_gib: float | None, sp: int) -> int:
    """The per-rank memory budget: ``--max-memory``, else this machine's free memory over its local ranks."""
    if max_memory_gib:
        return int(max_memory_gib * GiB)
    return available_bytes(1 if under_torchrun() else sp)


def capacities(o: Options) -> Capacities:
    """Each rank's memory budget and speed: ``rank_memory`` (GiB), else ``max_memory`` for every rank, else
    detected (local ranks: this machine's free memory over them; a torchrun job: each rank's own free device
    memory, gathered so every rank plans with the same figures); speeds ``rank_speed``, else from memory
    (:func:`ditsp.windows.capacity.speed_from_memory`). ValueError (one line) for a count that is not
    ``sp`` or both memory options."""
    if o.rank_memory is not None and o.max_memory is not None:
        raise ValueError("give --rank-memory (one figure per rank) or --max-memory (every rank), not both")
    for flag, values in (("--rank-memory", o.rank_memory), ("--rank-speed", o.rank_speed)):
        if values is not None:
            check_per_rank(list(values), flag, None)
            if len(values) != o.sp:
                raise ValueError(f"{flag}: {len(values)} value(s) for --sp {o.sp}; give one per rank")
    if o.rank_memory is not None:
        memory = [int(m * GiB) for m in o.rank_memory]
    elif o.max_memory or not under_torchrun():
        memory = [budget_bytes(o.max_memory, o.sp)] * o.sp
    else:
        memory = _gathered_free_memory()
    return Capacities.of(o.sp, memory, o.rank_speed)


def _gathered_free_memory() -> list[int]:
    """A torchrun job's ranks: each one's free device memory (host memory on CPU), gathered in rank order."""
    from ....distributed.comm import Comm
    from ....distributed.launcher import init_from_env

    ctx = init_from_env()  # the job's group, joined once (the restoration's dispatch reuses it)
    return [int(m) for m in Comm.of(ctx.group).all_gather_object(available_bytes(1, ctx.device))]


def check(o: Options, in_memory: torch.Tensor | None = None) -> Checked:
    """Everything that can be checked before ranks start, and the plan; ValueError with a one-line message.

    ``in_memory``: the input as uint8 (T, 3, H, W) frames instead of the file ``o.input`` (a host that
    holds frames); the request then carries them and writes nothing (:attr:`UpscaleRequest.frames`)."""
    if o.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {o.sp}")
    if not under_torchrun():  # local ranks, spawned here: bounded even with --force
        check_local_ranks(o.sp)
        check_local_cores(o.sp, o.threads)
    if o.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {o.threads}")
    if not o.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {o.timeout}")
    if o.vae_chunk < 1:
        raise ValueError(f"--vae-chunk must be >= 1, got {o.vae_chunk}")
    if o.fps is not None and not 0 < o.fps <= 1000:
        raise ValueError(f"--fps must be in (0, 1000], got {o.fps}")
    if not 0 <= o.crf <= 51:
        raise ValueError(f"--crf must be in 0..51, got {o.crf}")
    if o.window_frames < 0:
        raise ValueError(f"--window-frames must be >= 0, got {o.window_frames}")
    if o.overlap < 0:
        raise ValueError(f"--overlap must be >= 0, got {o.overlap}")
    if o.max_memory is not None and not 0 < o.max_memory < float("inf"):
        raise ValueError(f"--max-memory must be a positive number of GiB, got {o.max_memory}")
    if o.compile:
        from ..compiled import check_policy  # local: .compiled loads torch's compiler stack, only for --compile

        check_policy(o.deterministic)
    _choice("--model", o.model, MODELS)
    _choice("--color-fix", o.color_fix, COLOR_FIX_CHOICES)
    _choice("--stitch", o.stitch, STITCHES)
    _choice("--vae-mode", o.vae_mode, VAE_MODES)
    if o.planner is not None:
        _choice("--planner", o.planner, PLANNERS)
    if o.dtype is not None:
        _choice("--dtype", o.dtype, DTYPE_NAMES)
    for flag, path in (("--dit", o.dit), ("--vae", o.vae), ("--text-embedding", o.text_embedding)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    dtype = o.dtype or default_dtype(o.model)
    weights_dtype = None if o.weights_dtype in (None, "stored") else o.weights_dtype
    weights = _weights(o.model, o.dit, o.vae, o.text_embedding, dtype, weights_dtype=weights_dtype, read=o.weights_read,
                       random_weights=o.random_weights)  # a model without weights is refused here
    for what, path in (("DiT", weights.dit), ("VAE", weights.vae)):
        if path and not os.path.isfile(path):  # the files shipped with the package (a broken install)
            raise ValueError(f"the model {o.model}'s {what} weights {path} are missing: reinstall ditsp")
    if in_memory is not None:  # frames a host holds: no file to probe, none to write
        info = frames_info(o.input, in_memory)
        frames = info.frames
    else:
        info, frames = _check_files(o)
    area, size = _output_size(o, info)
    try:  # the DiT's weights as the rank will keep them (a checkpoint's header, or the format asked for)
        kept = dit_weights(o.model, dtype, checkpoint=weights.dit, weights_dtype=weights_dtype)
    except FormatError as e:
        raise ValueError(f"--dit {e}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = restoration_plan.build(
        model=o.model, dtype=dtype, in_width=info.width, in_height=info.height, frames=frames, area=area, size=size,
        window_frames=o.window_frames, overlap=o.overlap, stitch=o.stitch, seed=o.seed, sp=o.sp, vae_mode=o.vae_mode,
        vae_chunk=o.vae_chunk, planner=o.planner, deterministic=o.deterministic,
        capacities=capacities(o), weights=kept,
        winograd_filters=counts_winograd(device, o.deterministic), vae_backend=backend_of(device, o.deterministic))
    req = UpscaleRequest(
        input=o.input, output=o.output, plan=plan, weights=weights,
        color_fix=model_of(o.model).color_fix if o.color_fix == MODEL_COLOR_FIX else o.color_fix, crf=o.crf, fps=o.fps,
        overwrite=o.overwrite, progress=o.progress, sample_frames=o.sample_frames, compile=o.compile,
        frames=in_memory,
    )
    return Checked(req, info)


def frames_info(label: str, frames: torch.Tensor):
    """What a restoration needs to know of frames held in memory (uint8 (T, 3, H, W)); ValueError (one
    line) for anything else."""
    from fractions import Fraction

    from ....io.media import VideoInfo

    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or frames.dim() != 4 \
            or frames.shape[1] != 3:
        what = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"{label}: frames in memory must be uint8 (T, 3, H, W), got {what}")
    t, _, h, w = frames.shape
    if t < 1 or h < 1 or w < 1:
        raise ValueError(f"{label}: has no frames" if t < 1 else f"{label}: frames of {w}x{h} pixels")
    return VideoInfo(Path(label), w, h, 0.0, Fraction(0), t, False, "frames", None, "video")


def _check_files(o: Options):
    """The input file opens and has frames, and the output can be written: (info, frames)."""
    # the input's probe opens PyAV; kept local so a front door that only lists values does not load codecs
    from ....io.media import MediaError
    from ....io.probe import count_frames, probe

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
    return info, frames


def check_memory(c: Checked, o: Options) -> str:
    """The plan's memory line; raises MemoryError naming what would fit when it does not (unless ``force``);
    ranks of unequal capacity: each rank against its own budget, the error naming the ranks that do not fit."""
    p, w = c.plan, c.req.weights
    line = p.memory_line()
    if p.uneven and p.over_budget() and not o.force:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        kept = dit_weights(w.model, w.dtype, checkpoint=w.dit, weights_dtype=w.weights_dtype)
        fits = rank_suggestions(w.model, w.dtype, p.window_frames, p.geometry.out_hw, p.capacities, o.vae_mode,
                                weights=kept, winograd_filters=counts_winograd(device, p.deterministic),
                                vae_backend=backend_of(device, p.deterministic))
        short = "; ".join(f"rank {r} needs {p.rank_memory[r].total / GiB:.2f} GiB of its {p.capacities.memory[r] / GiB:.2f}"
                          for r in p.over_budget())
        hint = ("; would fit: " + ", ".join(fits)) if fits else "; nothing smaller fits (try a smaller --resolution)"
        raise MemoryError(f"{short}: does not fit{hint} (or pass --force)")
    if not p.uneven and p.memory.total > p.budget and not o.force:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        kept = dit_weights(w.model, w.dtype, checkpoint=w.dit, weights_dtype=w.weights_dtype)
        fits = suggestions(w.model, w.dtype, p.window_frames, p.geometry.out_hw, p.sp, o.vae_mode, p.budget,
                           p.window_frames, weights=kept, winograd_filters=counts_winograd(device, p.deterministic),
                           vae_backend=backend_of(device, p.deterministic))
        hint = ("; would fit: " + ", ".join(fits)) if fits else "; nothing smaller fits (try a smaller --resolution)"
        raise MemoryError(f"{line}: does not fit{hint} (or pass --force)")
    return line


def prepare(o: Options, in_memory: torch.Tensor | None = None) -> UpscaleRequest:
    """The checked request of ``o`` with its plan, held to its memory budget (the Python API's one call)."""
    c = check(o, in_memory)
    check_memory(c, o)
    return c.req
