"""ParallelConfig: one SP configuration shared by every model family.

``ulysses_degree * ring_degree`` ranks form an SP group; inside it, Ulysses
sub-groups are contiguous ranks and Ring sub-groups stride across them (the
USP 2D mesh). SeedVR2 (window attention) takes only ``ulysses_degree`` and
runs window-aligned SP on the whole SP group instead of head-sharded Ulysses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

WINDOW_FAMILIES = {"seedvr2", "nadit"}


class ParallelConfigError(ValueError):
    """An SP configuration that cannot run on this model or world."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to parallelise one request.

    - ``ulysses_degree``: ranks that shard heads (global attention) or, for
      SeedVR2, the window-aligned SP degree.
    - ``ring_degree``: ranks that pass K/V blocks around a ring (global only).
    - ``use_allgather``: AllGather-KV instead of the ring on the outer axis.
    - ``advanced_uaa``: uneven Ulysses all-to-all, i.e. head counts that do not
      divide by ``ulysses_degree`` (uneven head shards). Off is the strict mode.
    - ``ulysses_a2a_permute``: Ulysses transport variant: Q, K and V are each permuted
      to head-major and exchanged in their own all-to-all (3 calls, no stacked pack
      buffer) instead of one stacked Q/K/V all-to-all; same results, same bytes
      (see ditsp.attention.ulysses).
    - ``window_planner``: window planner for window-aligned SP.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    use_allgather: bool = False
    advanced_uaa: bool = False
    ulysses_a2a_permute: bool = False
    window_planner: str = "lpt"

    def __post_init__(self):
        for name in ("ulysses_degree", "ring_degree"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {v!r}")

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def validate(self, family: str, world_size: int, heads: int | None = None) -> None:
        """Raise :class:`ParallelConfigError` with the valid choices, or return."""
        if world_size % self.sp_degree:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ParallelConfigError(
                f"SP degree {self.sp_degree} (ulysses {self.ulysses_degree} x ring {self.ring_degree}) "
                f"does not divide the world size {world_size}; valid SP degrees: {divisors}"
            )
        if family.lower() in WINDOW_FAMILIES:
            self._validate_window(family)
        elif heads is not None and not self.advanced_uaa and heads % self.ulysses_degree:
            valid = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ParallelConfigError(
                f"{heads} heads do not divide by ulysses_degree {self.ulysses_degree} in strict mode "
                f"(advanced_uaa=False); valid degrees: {valid}, or set advanced_uaa=True for uneven head shards"
            )

    def _validate_window(self, family: str) -> None:
        fix = f"use ParallelConfig(ulysses_degree={self.sp_degree}) for window-aligned SP"
        rejected = {
            "ring_degree > 1": self.ring_degree > 1,
            "use_allgather": self.use_allgather,
            "advanced_uaa": self.advanced_uaa,
            "ulysses_a2a_permute": self.ulysses_a2a_permute,
        }
        for what, bad in rejected.items():
            if bad:
                raise ParallelConfigError(
                    f"{family} has window attention only and runs window-aligned SP with all heads on "
                    f"every rank; {what} applies to global-attention SP only: {fix}"
                )


@dataclass(frozen=True)
class SPGroups:
    """The groups of this rank: SP group plus its Ulysses (inner) and Ring (outer) sub-groups."""

    sp: Any
    ulysses: Any
    ring: Any
    sp_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]


def build_sp_groups(config: ParallelConfig, parent: Any = None) -> SPGroups:
    """Create the SP, Ulysses and Ring groups of ``parent`` (default: WORLD, passed on explicitly).

    Every rank of ``parent`` must call this (``new_group`` is collective).
    Parent ranks split into consecutive SP groups of ``sp_degree`` ranks; in
    each, Ulysses groups are ``ulysses_degree`` consecutive ranks and Ring
    groups take one rank from each Ulysses group.
    """
    parent = parent if parent is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    world = len(ranks)
    config.validate("global", world)
    me = dist.get_rank()
    u, s = config.ulysses_degree, config.sp_degree
    mine = {}
    for start in range(0, world, s):
        sp_ranks = tuple(ranks[start : start + s])
        _make(mine, "sp", sp_ranks, me)
        for i in range(0, s, u):
            _make(mine, "ulysses", sp_ranks[i : i + u], me)
        for j in range(u):
            _make(mine, "ring", sp_ranks[j::u], me)
    return SPGroups(
        sp=mine["sp"][0], ulysses=mine["ulysses"][0], ring=mine["ring"][0],
        sp_ranks=mine["sp"][1], ulysses_ranks=mine["ulysses"][1], ring_ranks=mine["ring"][1],
    )


def _make(mine: dict, name: str, ranks: tuple[int, ...], me: int) -> None:
    group = dist.new_group(list(ranks))
    if me in ranks:
        mine[name] = (group, ranks)
