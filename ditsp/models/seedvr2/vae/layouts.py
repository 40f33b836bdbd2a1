"""Which rows (height slabs) or latent frames (time split) each rank of a sharded VAE holds.

Pure arithmetic, shared by the execution (:mod:`.sharded`) and the memory model (:mod:`.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....windows.capacity import proportional_split, ranges


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items into ``parts`` consecutive ranges, sizes differing by at most one; ranges past
    ``n`` (more parts than items) are empty and come last."""
    used = min(parts, n)
    out, a = [], 0
    for r in range(parts):
        size = n // used + (1 if r < n % used else 0) if r < used else 0
        out.append((a, a + size))
        a += size
    return out


@dataclass(frozen=True)
class SlabLayout:
    """Which latent rows each rank of a height-sharded clip holds (all frames, all columns).

    ``t, h, w``: the latent grid; ``H, W``: the pixel frame. Rank r holds latent rows
    ``rows[r] = (h0, h1)``, i.e. pixel rows ``[8 h0, 8 h1)`` (the last non-empty slab also takes
    the rows past ``8 h`` that an H not divisible by 8 leaves). Ranks past the last slab hold none.
    """

    t: int
    h: int
    w: int
    H: int
    W: int
    world: int
    speeds: tuple[float, ...] | None = None  # per rank, unequal ranks: slabs in proportion (None: even)

    def __post_init__(self):
        if self.speeds is not None:
            if len(self.speeds) != self.world:
                raise ValueError(f"{len(self.speeds)} rank speeds for {self.world} ranks")
            object.__setattr__(self, "speeds", None if len(set(self.speeds)) == 1 else tuple(self.speeds))

    @classmethod
    def for_latent(cls, t: int, h: int, w: int, world: int, spatial: int = 8,
                   speeds: tuple[float, ...] | None = None) -> "SlabLayout":
        return cls(t, h, w, h * spatial, w * spatial, world, speeds)

    @property
    def rows(self) -> list[tuple[int, int]]:
        """Each rank's latent rows: near-even, or in proportion to ``speeds`` (whole latent rows, every rank
        at least one where there are as many rows as ranks: a conv's halo comes from the neighbouring slab,
        so only trailing ranks may hold none)."""
        if self.speeds is None:
            return even_split(self.h, self.world)
        return ranges(proportional_split(self.h, self.speeds, minimum=1))

    def rank_rows(self, rank: int) -> tuple[int, int, int, int]:
        """(t0, t1, h0, h1): the canonical latent range rank ``rank`` holds (columns: all of ``[0, w)``)."""
        h0, h1 = self.rows[rank]
        return 0, self.t, h0, h1

    def pixel_rows(self, spatial: int = 8) -> list[tuple[int, int]]:
        rows = [(spatial * a, spatial * b) for a, b in self.rows]
        last = max(r for r, (a, b) in enumerate(rows) if b > a)
        rows[last] = (rows[last][0], self.H)
        return [(a, b) if r <= last else (self.H, self.H) for r, (a, b) in enumerate(rows)]

    @property
    def active(self) -> int:
        return min(self.world, self.h)


@dataclass(frozen=True)
class TimeLayout:
    """Which latent frames each rank of a time-sharded clip holds, and the input frames behind them.

    Latent frame 0 comes from input frame 0, latent frame j >= 1 from input frames 4j-3 .. 4j, so
    latent range [p, q) maps to input frames [max(0, 4p - 3), 4q - 3) (p = 0 gives [0, 4q - 3)).
    """

    t: int
    world: int
    factor: int = 4

    @property
    def latents(self) -> list[tuple[int, int]]:
        return even_split(self.t, self.world)

    def frames(self, p: int, q: int) -> tuple[int, int]:
        f = lambda j: 0 if j == 0 else self.factor * j - (self.factor - 1)  # noqa: E731
        return (f(p), f(q)) if q > p else (f(p), f(p))
