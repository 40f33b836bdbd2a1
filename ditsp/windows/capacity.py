"""What each rank of an SP group can hold and how fast it runs, and how work is cut in proportion to it.

A group of unequal devices (a 32 GiB card beside a 24 GiB one, a fast card beside a slow one) finishes a
step when its slowest rank does, and fails when any rank runs out of memory. Two values say what the
ranks have and what a planner balances to:

- :class:`Capacities`: per rank, the memory it may use (bytes) and its relative speed;
- :class:`Shares`: what a window planner balances to: each rank's relative speed (a rank's modelled time
  is its tokens / its speed) and the most tokens its memory holds (the job converts bytes to tokens
  with its own memory model).

Equal capacities mean today's even split, exactly: every planner and every slab cut takes its old path
when the speeds are equal and no token cap binds. Unequal capacities move work, never arithmetic, so the
output is the same; they need only agree on every rank (they are part of what the ranks agree on).

Everything here is pure arithmetic; the same values give the same cuts on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

GiB = 2**30
SPEED_DECIMALS = 2  # speeds taken from memory are rounded to this (so a few MiB of free memory change nothing)


def check_per_rank(values, what: str, n: int | None) -> None:
    """ValueError (one line) unless ``values`` are finite numbers > 0, ``n`` of them where ``n`` is given."""
    if n is not None and len(values) != n:
        raise ValueError(f"{what}: {len(values)} value(s) for SP degree {n}; give one per rank")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{what}: every value must be a finite number > 0, got {v!r}")


def parse_list(text: str, what: str) -> tuple[float, ...]:
    """``"32,24"`` -> (32.0, 24.0); ValueError (one line) for anything but comma-separated finite numbers > 0."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise ValueError(f"{what}: expected comma-separated numbers, one per rank, got {text!r}")
    out = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise ValueError(f"{what}: {p!r} is not a number (expected e.g. 32,24)") from None
        out.append(v)
    check_per_rank(out, what, None)
    return tuple(out)


def speed_from_memory(memory: Sequence[int]) -> tuple[float, ...]:
    """Speeds when none are given: each rank's memory over the largest, to :data:`SPEED_DECIMALS` decimals
    (a larger card is taken as a proportionally faster one; equal memory gives equal speed)."""
    top = max(memory)
    return tuple(max(10.0 ** -SPEED_DECIMALS, round(m / top, SPEED_DECIMALS)) for m in memory)


@dataclass(frozen=True)
class Capacities:
    """Per rank, in rank order: ``speed`` (relative: only ratios count) and ``memory`` (bytes it may use;
    None where not known, then no rank is held to a memory cap)."""

    speed: tuple[float, ...]
    memory: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "speed", tuple(float(s) if not isinstance(s, bool) else s for s in self.speed))
        if not self.speed:
            raise ValueError("capacities: at least one rank")
        check_per_rank(self.speed, "rank speed", None)
        if self.memory is not None:
            object.__setattr__(self, "memory", tuple(self.memory))
            check_per_rank(self.memory, "rank memory", len(self.speed))
            object.__setattr__(self, "memory", tuple(int(m) for m in self.memory))

    @classmethod
    def uniform(cls, n: int, memory: int | None = None) -> "Capacities":
        """``n`` equal ranks (each with ``memory`` bytes, or none known)."""
        return cls((1.0,) * int(n), None if memory is None else (int(memory),) * int(n))

    @classmethod
    def of(cls, n: int, memory: Sequence[int] | None = None, speed: Sequence[float] | None = None) -> "Capacities":
        """The capacities of ``n`` ranks from what is known: ``speed`` given, else from ``memory``
        (:func:`speed_from_memory`), else equal. ValueError (one line) when a count is not ``n``."""
        if memory is not None:
            check_per_rank(list(memory), "rank memory", n)
        if speed is not None:
            check_per_rank(list(speed), "rank speed", n)
            return cls(tuple(speed), None if memory is None else tuple(memory))
        if memory is not None:
            return cls(speed_from_memory(memory), tuple(memory))
        return cls.uniform(n)

    @property
    def world_size(self) -> int:
        return len(self.speed)

    @property
    def even(self) -> bool:
        """Equal speeds: work splits evenly (memory may still differ, as caps)."""
        return len(set(self.speed)) == 1

    @property
    def uniform_memory(self) -> bool:
        return self.memory is None or len(set(self.memory)) == 1

    def fractions(self) -> tuple[float, ...]:
        """Each rank's share of the work, summing to 1."""
        total = math.fsum(self.speed)
        return tuple(s / total for s in self.speed)

    def shares(self, max_tokens: Sequence[int] | None = None) -> "Shares":
        return Shares(self.speed, None if max_tokens is None else tuple(int(m) for m in max_tokens))

    def as_dict(self) -> dict:
        return {"speed": list(self.speed), "memory_gib": None if self.memory is None else
                [round(m / GiB, 3) for m in self.memory]}

    def describe(self) -> str:
        mem = self.memory or (None,) * self.world_size
        return ", ".join(f"rank {r}: {'' if m is None else f'{m / GiB:.1f} GiB, '}speed {s:g}"
                         for r, (m, s) in enumerate(zip(mem, self.speed)))


@dataclass(frozen=True)
class Shares:
    """What a window planner balances to: each rank's ``speed`` (its modelled time is tokens / speed) and
    ``max_tokens``, the most tokens its memory holds at any layer (None: no cap)."""

    speed: tuple[float, ...]
    max_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "speed", tuple(float(s) for s in self.speed))
        check_per_rank(self.speed, "rank speed", None)
        if self.max_tokens is not None:
            caps = tuple(self.max_tokens)
            if len(caps) != len(self.speed) or any(isinstance(c, bool) or int(c) != c or c < 0 for c in caps):
                raise ValueError(f"max_tokens: one integer >= 0 per rank, got {caps!r}")
            object.__setattr__(self, "max_tokens", tuple(int(c) for c in caps))

    @classmethod
    def evenly(cls, n: int) -> "Shares":
        return cls((1.0,) * int(n))

    @property
    def world_size(self) -> int:
        return len(self.speed)

    @property
    def even(self) -> bool:
        """Equal speeds and no token cap: the planners' plain (even) path."""
        return len(set(self.speed)) == 1 and self.max_tokens is None

    @property
    def even_speed(self) -> bool:
        return len(set(self.speed)) == 1

    def fractions(self) -> tuple[float, ...]:
        total = math.fsum(self.speed)
        return tuple(s / total for s in self.speed)

    def cap(self, rank: int) -> int | None:
        return None if self.max_tokens is None else self.max_tokens[rank]

    def targets(self, total: int) -> tuple[float, ...]:
        """Each rank's ideal token count: in proportion to speed, no rank above its cap, the rest shared by
        the others in proportion to speed (water filling). ValueError when the caps hold fewer than ``total``."""
        caps = self.max_tokens
        if caps is not None and sum(caps) < total:
            raise ValueError(f"the ranks' memory holds {sum(caps):,} tokens in all (per rank {list(caps)}), "
                             f"fewer than the {total:,} of the request")
        fixed: dict[int, float] = {}
        while True:
            free = [r for r in range(self.world_size) if r not in fixed]
            rest = total - sum(fixed.values())
            speed = math.fsum(self.speed[r] for r in free)
            out = {r: rest * self.speed[r] / speed for r in free}
            over = [r for r in free if caps is not None and out[r] > caps[r]]
            if not over:
                break
            for r in over:
                fixed[r] = float(caps[r])
        out.update(fixed)
        return tuple(out[r] for r in range(self.world_size))

    def times(self, tokens: Sequence[int]) -> tuple[float, ...]:
        """Modelled time of each rank holding ``tokens``: tokens / speed, in units of one token on a
        speed-1 rank."""
        return tuple(t / s for t, s in zip(tokens, self.speed))

    def as_key(self) -> tuple:
        return (self.speed, self.max_tokens)


def proportional_split(n: int, weights: Sequence[float] | None, parts: int | None = None,
                       minimum: int = 0) -> list[int]:
    """``n`` whole items into consecutive parts in proportion to ``weights`` (None: equal), each part at
    least ``minimum`` items where ``n`` allows every part that many (else the equal split: the first
    ``n`` parts one item each, the rest empty, last).

    Largest remainders, ties to the lower part: equal weights give exactly the even split (sizes differing
    by at most one, the larger first). Deterministic."""
    parts = len(weights) if weights is not None else int(parts)
    if weights is None or len(set(weights)) == 1 or n < parts * max(1, minimum):
        used = min(parts, n)
        return [n // used + (1 if r < n % used else 0) if r < used else 0 for r in range(parts)] if used else \
            [0] * parts
    ws = [Fraction(w) for w in weights]
    total = sum(ws)
    quota = [n * w / total for w in ws]
    sizes = [math.floor(q) for q in quota]
    left = n - sum(sizes)
    for r in sorted(range(parts), key=lambda r: (-(quota[r] - sizes[r]), r))[:left]:
        sizes[r] += 1
    while minimum and min(sizes) < minimum:  # lift a small part by one from the most over-served one
        low = min(range(parts), key=lambda r: (sizes[r], r))
        donor = max((r for r in range(parts) if sizes[r] > minimum), key=lambda r: (sizes[r] - quota[r], -r))
        sizes[donor] -= 1
        sizes[low] += 1
    return sizes


def ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` of parts of ``sizes``."""
    out, a = [], 0
    for s in sizes:
        out.append((a, a + int(s)))
        a += int(s)
    return out
