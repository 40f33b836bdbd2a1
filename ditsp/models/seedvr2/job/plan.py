"""The restoration plan: every value a restoration derives from its request, computed once.

:func:`build` turns what the request's check learnt (the input's size and frame
count) and the request's settings into a :class:`RestorationPlan`: the output
geometry, the temporal windows, each window's padded length, latent shape and
DiT token grid (from the model's own VAE and DiT configs, never from constants),
the VAE mode each window runs (``auto`` resolved here, once, with the reason),
the DiT's SP path, the kernel policy, how the windows are stitched, and the per-rank memory estimate with the
budget it was held against (each rank's own, where the ranks' capacities differ: the VAE's slabs and the
DiT's tokens are then cut in proportion to speed, no rank above what its memory holds). The ranks, the estimate's line, ``ditsp upscale``'s
summary and the server's warm-up all read it; none recomputes it.

The plan is a pure function of its inputs (no collective, no device), so the
ranks of a torchrun job that each build it agree; the restoration checks that
they did (:meth:`RestorationPlan.fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from ..pipeline.padding import padded_length
from ..pipeline.sizing import FrameGeometry, frame_geometry
from ..pipeline.windows import STITCHES, WindowPlan, plan_windows
from ..presets import vae_config
from ..vae.modes import AUTO, BY_NAME
from ....windows.capacity import Capacities, Shares, proportional_split
from .budget import Estimate, GiB, choose_vae_mode, estimate, rank_estimates  # noqa: F401 - estimate re-exported
from .sizing import clip_grid, crop_multiple


@dataclass(frozen=True)
class WindowStep:
    """One temporal window as the ranks run it."""

    index: int
    start: int  # clip frames [start, stop)
    stop: int
    seed: int
    padded: int  # frames after padding to kn + 1 (k: the VAE's time factor)
    latent: tuple[int, int, int]  # (t, h, w) of the VAE latent
    grid: tuple[int, int, int]  # the DiT's post-patch token grid
    vae_mode: str  # resolved: never "auto"
    vae_reason: str  # why this mode (requested, or what auto compared)


@dataclass(frozen=True)
class RestorationPlan:
    model: str
    sp: int  # the degree the plan was made for: per-rank memory depends on it; the ranks check it
    frames: int  # input frames
    geometry: FrameGeometry
    windows: WindowPlan  # the blender's windows (start, stop, seed, overlap)
    steps: tuple[WindowStep, ...]
    planner: str | None  # None: the DiT's SP path chosen by the cost model; a name: Plan A with that planner
    deterministic: bool  # fixed-shape kernel calls in the DiT and the VAE: the same frames at every SP degree
    vae_chunk: int
    memory: Estimate  # modelled peak of the largest window on the rank with the least room left
    budget: int  # bytes that rank's memory was held against
    # The ranks' memory budgets and speeds (windows/capacity.py); unequal ones cut the VAE's slabs and the
    # DiT's tokens in proportion to speed, each rank held to its own budget. None: equal ranks of ``budget``.
    capacities: Capacities | None = None
    rank_memory: tuple[Estimate, ...] = ()  # per rank, the modelled peak of the largest window
    token_caps: tuple[int, ...] | None = None  # per rank, the most DiT tokens its budget holds (unequal ranks)
    # What :func:`build` was given: a recovery builds the same plan with shorter windows (:func:`rebuild`).
    inputs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def window_frames(self) -> int:
        """Frames of the largest window (before padding)."""
        return max(s.stop - s.start for s in self.steps)

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        """The DiT token grids the windows use (what a server warms its plan cache with)."""
        return sorted({s.grid for s in self.steps})

    @property
    def dit_path(self) -> str:
        return "auto (the cost model's choice)" if self.planner is None else f"window, planner {self.planner}"

    @property
    def uneven(self) -> bool:
        """Ranks of unequal speed or memory: work is cut in proportion, each rank held to its own budget."""
        c = self.capacities
        return c is not None and self.sp > 1 and c.world_size == self.sp and not (c.even and c.uniform_memory)

    @property
    def vae_speeds(self) -> tuple[float, ...] | None:
        """The speeds the VAE's height slabs are cut by (None: even slabs)."""
        return self.capacities.speed if self.uneven and not self.capacities.even else None

    @property
    def dit_shares(self) -> Shares | None:
        """What the DiT's window planners balance to (None: equal ranks)."""
        return self.capacities.shares(self.token_caps) if self.uneven else None

    def fingerprint(self) -> str:
        """A digest of everything the ranks must agree on."""
        d = asdict(self)
        d["memory"] = d["rank_memory"] = None  # the estimate is advice; the modes it chose are in the steps
        d["inputs"] = None  # what it was made from: its values are what the ranks run
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def describe(self) -> str:
        modes = sorted({s.vae_mode for s in self.steps})
        stitched = f" stitched {self.windows.stitch}" if len(self.steps) > 1 else ""
        return (f"{self.frames} frame(s), {self.geometry.describe()}, {len(self.steps)} window(s) of up to "
                f"{self.window_frames} frames{stitched}, latent {self.steps[0].latent}, VAE {'/'.join(modes)}, "
                f"SP={self.sp}")

    def memory_line(self) -> str:
        if not self.uneven:
            return f"memory estimate: {self.memory.describe()}; budget {self.budget / GiB:.2f} GiB per rank"
        return "memory estimate per rank: " + "; ".join(
            f"rank {r} (speed {s:g}): {e.describe().replace(' per rank', '')} of {b / GiB:.2f} GiB"
            for r, (e, b, s) in enumerate(zip(self.rank_memory, self.capacities.memory, self.capacities.speed)))

    def over_budget(self) -> list[int]:
        """The ranks whose modelled peak exceeds their budget."""
        if not self.uneven:
            return [] if self.memory.total <= self.budget else list(range(self.sp))
        return [r for r, (e, b) in enumerate(zip(self.rank_memory, self.capacities.memory)) if e.total > b]


def build(*, model: str, dtype: str, in_width: int, in_height: int, frames: int, area, size, window_frames: int,
          overlap: int, seed: int, sp: int, vae_mode: str, vae_chunk: int, planner: str | None, deterministic: bool,
          budget: int | None = None, weights=None, winograd_filters: bool = False, vae_backend: str = "cuda",
          stitch: str = STITCHES[0], capacities: Capacities | None = None) -> RestorationPlan:
    """The plan of one restoration (``area``/``size``: the output as ``frame_geometry`` takes them; ``weights``:
    the DiT's weights as kept, :func:`.weight_memory.dit_weights`). ValueError (one line) for what cannot
    run; the memory estimate is advice, held against ``budget`` (every rank) or each rank's memory of
    ``capacities`` (ranks of unequal capacity: :func:`.budget.rank_estimates`) by the request's check."""
    inputs = dict(locals())  # the arguments, kept by the plan (rebuild)
    if capacities is None:
        capacities = Capacities.uniform(sp, budget)
    if capacities.world_size != sp or capacities.memory is None:
        raise ValueError(f"capacities of {capacities.world_size} ranks for SP={sp}, each with a memory budget")
    vae, multiple = vae_config(model), crop_multiple(model)
    geo = frame_geometry(in_width, in_height, area=area, size=size, multiple=multiple)
    if geo.out_width < multiple or geo.out_height < multiple:
        raise ValueError(f"{geo.describe()}: the output is smaller than one {multiple}x{multiple} block after the crop")
    k = vae.temporal_factor
    window = min(window_frames or padded_length(frames, k), padded_length(frames, k))
    windows = plan_windows(frames, window, min(overlap, window - 1), seed, temporal_factor=k, stitch=stitch)
    ranks, caps = rank_estimates(model, dtype, window, geo.out_hw, capacities, vae_mode, vae_chunk, weights=weights,
                                 winograd_filters=winograd_filters, vae_backend=vae_backend)
    budgets = capacities.memory
    left = [b - (e.total - e.vae) for b, e in zip(budgets, ranks)]  # what the VAE may use after the rest, per rank
    tight = min(range(sp), key=lambda r: (left[r] - ranks[r].vae, r))
    rows = None
    if not (capacities.even and capacities.uniform_memory):  # unequal ranks: each VAE slab against its own budget
        rows = proportional_split(clip_grid(model, window, geo.out_hw)[1][1], capacities.speed, minimum=1)
    steps = []
    for w in windows:
        padded, latent, grid = clip_grid(model, w.length, geo.out_hw)
        mode, why = choose_vae_mode(model, dtype, (padded, *geo.out_hw), sp, vae_mode,
                                    left[0] if rows is None else left, vae_chunk, winograd_filters=winograd_filters,
                                    vae_backend=vae_backend, rows=rows)
        if stitch == "latent" and not BY_NAME[mode].exact:
            raise ValueError(f"the latent stitch decodes the clip as one stream, which needs an exact VAE mode: "
                             f"window {w.index + 1} would run {mode} ({why}); use --stitch cosine or more memory")
        steps.append(WindowStep(w.index, w.start, w.stop, w.seed, padded, latent, grid, mode, why))
    return RestorationPlan(model, sp, frames, geo, windows, tuple(steps), planner, deterministic, vae_chunk,
                           ranks[tight], budgets[tight], capacities, ranks, caps, inputs)


def rebuild(plan: RestorationPlan, **changes) -> RestorationPlan:
    """The plan :func:`build` makes from ``plan``'s own arguments with ``changes`` (a recovery's shorter
    windows, :mod:`.recovery`)."""
    return build(**{**plan.inputs, **changes})


__all__ = ["AUTO", "RestorationPlan", "WindowStep", "build", "rebuild"]
