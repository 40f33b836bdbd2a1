"""Process groups with named axes: the SP group and its Ulysses (inner) and Ring (outer) axes.

A parent set of ranks splits into consecutive SP groups of
``ulysses_degree * ring_degree`` ranks. Inside one SP group, the ``ulysses``
axis is ``ulysses_degree`` consecutive ranks and the ``ring`` axis takes one
rank from each Ulysses group (the USP 2D mesh)::

    SP group ranks 0..5, ulysses 3 x ring 2:
      ulysses axes: (0, 1, 2), (3, 4, 5)
      ring axes:    (0, 3), (1, 4), (2, 5)

Groups are values: :func:`build_sp_groups` can be called again for another
set of ranks (after a rank is lost or added) and returns a fresh
:class:`SPGroups`; nothing global is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config import ParallelConfig

AXES = ("sp", "ulysses", "ring")


@dataclass(frozen=True)
class SPGroups:
    """This rank's groups on every named axis, with their global ranks."""

    sp: ProcessGroup
    ulysses: ProcessGroup
    ring: ProcessGroup
    sp_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]

    def group(self, axis: str) -> ProcessGroup:
        """The group of a named axis (``sp``, ``ulysses`` or ``ring``)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)}")
        return getattr(self, axis)

    def ranks(self, axis: str) -> tuple[int, ...]:
        self.group(axis)
        return getattr(self, f"{axis}_ranks")


def axis_ranks(config: ParallelConfig, ranks: Sequence[int]) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every axis over ``ranks`` (pure: no process groups are made)."""
    world, u, s = len(ranks), config.ulysses_degree, config.sp_degree
    config.validate("global", world)
    out: dict[str, list[tuple[int, ...]]] = {axis: [] for axis in AXES}
    for start in range(0, world, s):
        sp = tuple(ranks[start : start + s])
        out["sp"].append(sp)
        out["ulysses"] += [sp[i : i + u] for i in range(0, s, u)]
        out["ring"] += [sp[j::u] for j in range(u)]
    return out


def build_sp_groups(config: ParallelConfig, parent: ProcessGroup | None = None,
                    ranks: Sequence[int] | None = None) -> SPGroups | None:
    """Create the SP, Ulysses and Ring groups over ``ranks`` (default: every rank of ``parent``, WORLD).

    Every rank of the default group must call this (``new_group`` is
    collective), also ranks outside ``ranks``; those get ``None`` back.
    """
    parent = parent if parent is not None else dist.group.WORLD
    ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(parent)
    me = dist.get_rank()
    mine: dict[str, tuple] = {}
    for axis, groups in axis_ranks(config, ranks).items():
        for members in groups:
            group = dist.new_group(list(members))
            if me in members:
                mine[axis] = (group, members)
    if "sp" not in mine:
        return None
    return SPGroups(sp=mine["sp"][0], ulysses=mine["ulysses"][0], ring=mine["ring"][0],
                    sp_ranks=mine["sp"][1], ulysses_ranks=mine["ulysses"][1], ring_ranks=mine["ring"][1])
