"""Window planners: assign whole windows to ranks, by name, cached.

Built-in planners are listed explicitly in :data:`PLANNERS`:

- ``lpt`` (:mod:`.lpt`): each layout balanced on its own (longest processing
  time first, the seed's tie-breaking);
- ``locality`` (:mod:`.locality`): all layouts of a schedule partitioned
  together so few tokens change rank at a layout change.

A new planner is a module here with ``plan(layouts, world_size)`` returning
each layout's per-rank window ids, plus one line in :data:`PLANNERS` (or a
:func:`register_planner` call for planners outside the package).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

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


def plan_cache_key(layouts: Sequence[WindowLayout], world_size: int, planner: str) -> tuple:
    """Everything a plan depends on: grid, geometry, world size, planner."""
    _, version = _planner(planner)
    grids = {lay.grid for lay in layouts}
    if len(grids) != 1:
        raise ValueError(f"layouts planned together must share one grid, got {sorted(grids)}")
    return (
        grids.pop(),
        tuple(lay.fingerprint for lay in layouts),
        GEOMETRY_VERSION,
        int(world_size),
        planner,
        version,
    )


def _planner(name: str) -> tuple[PlannerFn, int]:
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; choose from {planner_names()}") from None


def plan_layouts(layouts: Sequence[WindowLayout], world_size: int, planner: str = "lpt") -> tuple[Plan, ...]:
    """Plans for the distinct layouts of one schedule, planned together (cached)."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    layouts = tuple(layouts)
    fn, _ = _planner(planner)

    def make() -> tuple[Plan, ...]:
        assigned = fn(layouts, int(world_size))
        plans = []
        for lay, rank_windows in zip(layouts, assigned):
            rw = tuple(tuple(sorted(int(i) for i in ws)) for ws in rank_windows)
            flat = sorted(i for ws in rw for i in ws)
            if len(rw) != world_size or flat != list(range(len(lay))):
                raise AssertionError(f"planner {planner!r} did not assign every window exactly once")
            plans.append(Plan(layout=lay, world_size=int(world_size), planner=planner, rank_windows=rw))
        return tuple(plans)

    return PLAN_CACHE.get_or_make(plan_cache_key(layouts, world_size, planner), make)


def plan_layout(layout: WindowLayout, world_size: int, planner: str = "lpt") -> Plan:
    return plan_layouts((layout,), world_size, planner)[0]
