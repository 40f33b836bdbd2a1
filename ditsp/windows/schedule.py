"""A model's layer schedule planned for one grid and world size (pure).

The schedule is the per-layer window method. Layouts that recur share one
plan; a transition exists wherever consecutive layers use different layouts,
so an alternating 32-layer model has 31 and an A, A, B, B, A schedule has 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .geometry import WindowLayout, canonical_method, short_name, window_layout
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


def plan_schedule(
    grid: Sequence[int],
    layer_methods: Sequence[str],
    world_size: int,
    planner: str = "lpt",
    num_windows: Sequence[int] = (4, 3, 3),
) -> SchedulePlan:
    """Plan every distinct layout of ``layer_methods`` together."""
    if not layer_methods:
        raise ValueError("a schedule needs at least one layer")
    methods = tuple(canonical_method(m) for m in layer_methods)
    distinct = list(dict.fromkeys(methods))
    layouts = [window_layout(grid, m, num_windows) for m in distinct]
    plans = plan_layouts(layouts, world_size, planner)
    return SchedulePlan(
        grid=layouts[0].grid,
        world_size=int(world_size),
        planner=planner,
        layer_methods=methods,
        plans=dict(zip(distinct, plans)),
    )


def layout_names(schedule: SchedulePlan) -> list[str]:
    return [short_name(m) for m in schedule.plans]
