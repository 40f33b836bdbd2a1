"""A model's layer schedule planned for one grid and world size (pure).

The schedule is the per-layer window method. Layouts that recur share one
plan; a transition exists wherever consecutive layers use different layouts,
so an alternating 32-layer model has 31 and an A, A, B, B, A schedule has 2.

Before anything is allocated, :func:`plan_schedule` estimates the planner's
own memory and time from the grid, the layouts and the world size
(:func:`estimate_plan`) and raises :class:`PlanTooLargeError` past a limit:
``max_bytes`` / ``max_seconds``, else the environment variables
``DITSP_MAX_PLAN_GIB`` / ``DITSP_MAX_PLAN_SECONDS`` (so spawned ranks inherit a
limit the command line raised, see :func:`plan_limits`), else
:data:`MAX_PLAN_BYTES` / :data:`MAX_PLAN_SECONDS`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..scoped_env import scoped_env
from .geometry import NUM_WINDOWS, WindowLayout, canonical_method, check_grid, short_name, window_counts, window_layout
from .capacity import Shares
from .plan import Plan, Transition, transition
from .planners import plan_layouts


@dataclass(frozen=True, eq=False)
class SchedulePlan:
    """Per-layer plans of a schedule and the transitions between them."""

    grid: tuple[int, int, int]
    world_size: int
    planner: str
    layer_methods: tuple[str, ...]
    plans: dict  # canonical method -> Plan
    shares: Shares | None = None  # the ranks' speeds and token caps it was planned for (None: equal ranks)

    @property
    def layouts(self) -> dict[str, WindowLayout]:
        return {m: p.layout for m, p in self.plans.items()}

    def layer_plan(self, layer: int) -> Plan:
        return self.plans[self.layer_methods[layer]]

    def transitions(self) -> list[tuple[int, Transition]]:
        """(layer entered, transition) for every change of layout in the schedule."""
        out = []
        for i in range(1, len(self.layer_methods)):
            a, b = self.layer_methods[i - 1], self.layer_methods[i]
            if a != b:
                out.append((i, transition(self.plans[a], self.plans[b])))
        return out

    def transition_between(self, src: str, dst: str) -> Transition:
        return transition(self.plans[canonical_method(src)], self.plans[canonical_method(dst)])

    def distinct_transitions(self) -> dict[str, Transition]:
        """``"regular->shifted"``-style name -> transition, each pair once."""
        out: dict[str, Transition] = {}
        for _, t in self.transitions():
            out.setdefault(f"{t.src.layout.name}->{t.dst.layout.name}", t)
        return out

    @property
    def num_tokens(self) -> int:
        return int(np.prod(self.grid))


GiB = 2**30
MAX_PLAN_BYTES = 4 * GiB  # default limit on the planner's own memory (one process)
MAX_PLAN_SECONDS = 600.0  # default limit on its estimated time
ENV_MAX_GIB = "DITSP_MAX_PLAN_GIB"
ENV_MAX_SECONDS = "DITSP_MAX_PLAN_SECONDS"

# Cost model, calibrated on CPU (numpy int64 arrays, Python lists per window and rank) with a margin.
_B_TOKEN_LAYOUT = 48  # token ids, window of token, owner and position per layout, temporaries
_B_TOKEN_TRANSITION = 16  # send / receive orders per transition
_B_WINDOW = 400  # a window's slices, counts, offsets, Python objects
_B_RANK_LAYOUT = 200  # a rank's window lists and tuples, per layout
_B_MATRIX = 16  # count matrix and its off-diagonal copy, per rank pair and transition
_S_TOKEN_LAYOUT = 4e-7
_S_WINDOW_RANK = 1e-7  # LPT: every window scans every rank
_S_RANK_LAYOUT = 2e-6
_S_LOC_WINDOW_RANK = 1e-5  # locality: connectivity and refinement per window and rank
_S_LOC_RANK_RANK = 1e-6  # locality: the packing fallback's rank-pair matching


class PlanTooLargeError(ValueError):
    """Planning this request would take more memory or time than the limit allows."""


@dataclass(frozen=True)
class PlanEstimate:
    """The planner's own modelled peak memory and time for one request (not the model's)."""

    tokens: int
    windows: int  # over all distinct layouts
    world_size: int
    layouts: int
    transitions: int  # distinct transitions
    bytes: int
    seconds: float

    def describe(self) -> str:
        return (f"planning {self.tokens:,} tokens in {self.windows:,} windows ({self.layouts} layouts, "
                f"{self.transitions} distinct transitions) on {self.world_size:,} ranks needs about "
                f"{self.bytes / GiB:,.2f} GiB and {_fmt_seconds(self.seconds)}")


def _fmt_seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 10 else f"{s:.1f} s"


def estimate_plan(
    grid: Sequence[int],
    layer_methods: Sequence[str],
    world_size: int,
    planner: str = "lpt",
    num_windows: Sequence[int] = NUM_WINDOWS,
) -> PlanEstimate:
    """Model the memory and time of :func:`plan_schedule` and of the schedule's transitions,
    by arithmetic only (no layout is built): tokens x bytes per token of the layout and plan
    arrays, windows x ranks for the planner, rank pairs for the count matrices and, for the
    ``locality`` planner, its window-overlap graph."""
    grid = check_grid(grid)
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    methods = tuple(canonical_method(m) for m in layer_methods)
    distinct = list(dict.fromkeys(methods))
    pairs = {(a, b) for a, b in zip(methods, methods[1:]) if a != b}
    p, n, L, T = int(world_size), math.prod(grid), len(distinct), len(pairs)
    per_layout = [math.prod(window_counts(grid, m, num_windows)) for m in distinct]
    nw = sum(per_layout)
    nbytes = (n * (_B_TOKEN_LAYOUT * L + _B_TOKEN_TRANSITION * T) + nw * _B_WINDOW
              + p * L * _B_RANK_LAYOUT + T * p * p * _B_MATRIX)
    seconds = n * L * _S_TOKEN_LAYOUT + nw * p * _S_WINDOW_RANK + p * L * _S_RANK_LAYOUT
    if planner == "locality":
        first = per_layout[0]
        nbytes += sum(16 * first * k for k in per_layout[1:])  # dense overlaps with layout 0
        nbytes += nw * p * 32 + p * p * 150  # per-window rank scores; rank-pair matching tuples
        seconds += nw * p * _S_LOC_WINDOW_RANK + p * p * _S_LOC_RANK_RANK
    return PlanEstimate(n, nw, p, L, T, int(nbytes), float(seconds))


def _env_limit(name: str, scale: float, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value * scale


def current_limits() -> tuple[int, float]:
    """(bytes, seconds): the planning limits in force (environment, else the module defaults)."""
    return (int(_env_limit(ENV_MAX_GIB, GiB, MAX_PLAN_BYTES)),
            _env_limit(ENV_MAX_SECONDS, 1.0, MAX_PLAN_SECONDS))


def plan_limits(max_gib: float | None = None, max_seconds: float | None = None):
    """Raise (or lower) the planning limits for the duration of the block, through the
    environment, so local ranks spawned inside it plan under the same limits."""
    values = {}
    if max_gib is not None:
        values[ENV_MAX_GIB] = repr(float(max_gib))
    if max_seconds is not None:
        values[ENV_MAX_SECONDS] = repr(float(max_seconds))
    return scoped_env(values)


def check_plan_size(
    grid: Sequence[int],
    layer_methods: Sequence[str],
    world_size: int,
    planner: str = "lpt",
    num_windows: Sequence[int] = NUM_WINDOWS,
    max_bytes: int | None = None,
    max_seconds: float | None = None,
    extra_bytes: int = 0,
) -> PlanEstimate:
    """:func:`estimate_plan`, raising :class:`PlanTooLargeError` past the limits.

    ``extra_bytes``: memory a caller adds on top of planning (e.g. a report of the count matrices).
    """
    est = estimate_plan(grid, layer_methods, world_size, planner, num_windows)
    if extra_bytes:
        est = replace(est, bytes=est.bytes + int(extra_bytes))
    lim_bytes, lim_seconds = current_limits()
    lim_bytes = lim_bytes if max_bytes is None else int(max_bytes)
    lim_seconds = lim_seconds if max_seconds is None else float(max_seconds)
    if est.bytes > lim_bytes:
        raise PlanTooLargeError(
            f"request too large to plan: {est.describe()}; the limit is {lim_bytes / GiB:,.2f} GiB "
            f"(raise it with --max-plan-memory GiB or {ENV_MAX_GIB})")
    if est.seconds > lim_seconds:
        raise PlanTooLargeError(
            f"request too large to plan: {est.describe()}; the limit is {_fmt_seconds(lim_seconds)} "
            f"(raise it with --max-plan-seconds or {ENV_MAX_SECONDS})")
    return est


def plan_schedule(
    grid: Sequence[int],
    layer_methods: Sequence[str],
    world_size: int,
    planner: str = "lpt",
    num_windows: Sequence[int] = NUM_WINDOWS,
    max_bytes: int | None = None,
    max_seconds: float | None = None,
    shares: Shares | None = None,
) -> SchedulePlan:
    """Plan every distinct layout of ``layer_methods`` together (``shares``: ranks of unequal speed or
    memory, :func:`~ditsp.windows.planners.plan_layouts`).

    Refuses with :class:`PlanTooLargeError` before allocating when the estimate
    (:func:`estimate_plan`) exceeds ``max_bytes`` / ``max_seconds`` (default:
    :func:`current_limits`).
    """
    if not layer_methods:
        raise ValueError("a schedule needs at least one layer")
    check_plan_size(grid, layer_methods, world_size, planner, num_windows, max_bytes, max_seconds)
    methods = tuple(canonical_method(m) for m in layer_methods)
    distinct = list(dict.fromkeys(methods))
    layouts = [window_layout(grid, m, num_windows) for m in distinct]
    shares = None if shares is None or shares.even else shares
    plans = plan_layouts(layouts, world_size, planner, shares)
    return SchedulePlan(
        grid=layouts[0].grid,
        world_size=int(world_size),
        planner=planner,
        layer_methods=methods,
        plans=dict(zip(distinct, plans)),
        shares=shares,
    )


def layout_names(schedule: SchedulePlan) -> list[str]:
    return [short_name(m) for m in schedule.plans]
