"""Window planners: assign whole windows to ranks, by name, cached.

Built-in planners are listed explicitly in :data:`PLANNERS`:

- ``lpt`` (:mod:`.lpt`): each layout balanced on its own (longest processing
  time first, the seed's tie-breaking);
- ``locality`` (:mod:`.locality`): all layouts of a schedule partitioned
  together so few tokens change rank at a layout change.

A new planner is a module here with ``plan(layouts, world_size)`` returning
each layout's per-rank window ids, plus one line in :data:`PLANNERS` (or a
:func:`register_planner` call for planners outside the package). A planner that
also takes ``shares`` (:class:`~ditsp.windows.capacity.Shares`: unequal speeds,
token caps) plans for ranks of unequal capacity; with equal shares every planner
is called as before and its plan is today's, exactly.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np

from ..capacity import Shares
from ..geometry import GEOMETRY_VERSION, WindowLayout
from ..plan import PLAN_CACHE, Plan
from . import lpt
from .locality import VERSION as LOCALITY_VERSION
from .locality import locality_assign

PlannerFn = Callable[[Sequence[WindowLayout], int], Sequence[Sequence[Sequence[int]]]]
PLANNERS: dict[str, tuple[PlannerFn, int]] = {
    "lpt": (lpt.plan_lpt, lpt.VERSION),
    "locality": (locality_assign, LOCALITY_VERSION),
}


def register_planner(name: str, fn: PlannerFn, version: int) -> None:
    """Make a planner available by name; ``version`` goes into every cache key."""
    PLANNERS[name] = (fn, version)


def planner_names() -> list[str]:
    return sorted(PLANNERS)


def plan_cache_key(layouts: Sequence[WindowLayout], world_size: int, planner: str,
                   shares: Shares | None = None) -> tuple:
    """Everything a plan depends on: grid, geometry, world size, planner (and unequal shares)."""
    _, version = _planner(planner)
    grids = {lay.grid for lay in layouts}
    if len(grids) != 1:
        raise ValueError(f"layouts planned together must share one grid, got {sorted(grids)}")
    key = (
        grids.pop(),
        tuple(lay.fingerprint for lay in layouts),
        GEOMETRY_VERSION,
        int(world_size),
        planner,
        version,
    )
    return key if shares is None else key + (shares.as_key(),)


def _planner(name: str) -> tuple[PlannerFn, int]:
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; choose from {planner_names()}") from None


def _assigned(layouts, world_size: int, planner: str, assigned) -> tuple[Plan, ...]:
    plans = []
    for lay, rank_windows in zip(layouts, assigned):
        rw = tuple(tuple(sorted(int(i) for i in ws)) for ws in rank_windows)
        flat = sorted(i for ws in rw for i in ws)
        if len(rw) != world_size or flat != list(range(len(lay))):
            raise AssertionError(f"planner {planner!r} did not assign every window exactly once")
        plans.append(Plan(layout=lay, world_size=int(world_size), planner=planner, rank_windows=rw))
    return tuple(plans)


def within_caps(plans: Sequence[Plan], shares: Shares | None) -> bool:
    """Whether no rank holds more tokens than its cap in any of ``plans``."""
    if shares is None or shares.max_tokens is None:
        return True
    return all(int(t) <= c for plan in plans for t, c in zip(plan.rank_tokens, shares.max_tokens))


def plan_layouts(layouts: Sequence[WindowLayout], world_size: int, planner: str = "lpt",
                 shares: Shares | None = None) -> tuple[Plan, ...]:
    """Plans for the distinct layouts of one schedule, planned together (cached).

    ``shares``: the ranks' speeds and token caps. Equal speeds take the even plan (today's) whenever it
    keeps every rank within its cap; otherwise the planner balances modelled time under the caps.
    ValueError (one line) when no plan of whole windows keeps every rank within its cap."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    layouts = tuple(layouts)
    fn, _ = _planner(planner)
    if shares is not None and shares.world_size != world_size:
        raise ValueError(f"capacities for {shares.world_size} ranks, planning for {world_size}")
    if shares is not None:
        for lay in layouts:
            shares.targets(lay.num_tokens)  # ValueError (one line) when the caps hold fewer tokens than there are

    def even() -> tuple[Plan, ...]:
        return _assigned(layouts, world_size, planner, fn(layouts, int(world_size)))

    plans = None
    if shares is None or shares.even_speed:
        plans = PLAN_CACHE.get_or_make(plan_cache_key(layouts, world_size, planner), even)
        if within_caps(plans, shares):
            return plans
    if "shares" not in inspect.signature(fn).parameters:
        raise ValueError(f"planner {planner!r} plans equal ranks only; ranks of unequal capacity need one of "
                         f"{', '.join(n for n, (f, _) in PLANNERS.items() if 'shares' in inspect.signature(f).parameters)}")

    def weighted() -> tuple[Plan, ...]:
        return _assigned(layouts, world_size, planner, fn(layouts, int(world_size), shares=shares))

    plans = PLAN_CACHE.get_or_make(plan_cache_key(layouts, world_size, planner, shares), weighted)
    if not within_caps(plans, shares):
        worst = max(range(world_size), key=lambda r: max(int(p.rank_tokens[r]) - shares.max_tokens[r] for p in plans))
        held = max(int(p.rank_tokens[worst]) for p in plans)
        raise ValueError(f"planner {planner!r}: no plan of whole windows keeps every rank within its memory "
                         f"(rank {worst} would hold {held:,} tokens, its memory holds {shares.max_tokens[worst]:,})")
    return plans


def plan_layout(layout: WindowLayout, world_size: int, planner: str = "lpt", shares: Shares | None = None) -> Plan:
    return plan_layouts((layout,), world_size, planner, shares)[0]
