"""Halo-slab SP ("Plan B"): fixed slabs of the token grid, halo rows lent to attention only.

Plan A (:mod:`.window_aligned`) re-shards the whole activation at every
window-layout change. Plan B never moves the residual stream: every rank owns
one fixed ``t x h`` block of the post-patch grid (all columns) from the patch
embedding to the output projection, so everything tokenwise (norms,
modulation, Q/K/V and output projections, MLP) runs on owned rows only.

Only attention needs whole windows. For each layout every window gets one
*computing* rank: the slab owner holding most of its rows (ties: the less
loaded, then the lower rank). A window inside one slab is computed where it
lies. A window that straddles slabs is computed by that owner, which fetches
the other owners' Q/K/V rows of the window (the *halo*), attends the whole
window and sends each halo row's attention output back to its owner. Per
layer that is two variable-split all-to-alls on the attention path (Q/K/V
halo in, outputs back; either skipped on every rank when no window of the
layout straddles), plus the text all-reduce every window path has.

How this fits the unchanged model (design choice): ``enter_layer`` is the
identity (rows never move), ``window_pack(i)`` describes the windows this
rank *computes* (its whole windows, halo rows included, in ascending window
id, row-major inside), and ``attend`` does fetch -> window attention -> return
on the model's owned-row q/k/v. Both moves are :class:`~ditsp.windows.plan.Transition`
objects between two :class:`~ditsp.windows.ownership.RowOwnership` values
(slabs and compute windows), carried by the one row codec
:func:`ditsp.windows.exchange.exchange`.

Bytes: a halo row costs ``3 * inner`` (Q/K/V) on the way in and ``inner`` on
the way out per layer, against ``dim`` per moved row and layout change for
Plan A, so Plan B wins where the halo is a small share of the rows: high
resolutions at low SP degrees (see :func:`ditsp.windows.traffic.halo_traffic`).
A cheaper variant would lend the attention *input* (``dim`` wide) and project
the halo's Q/K/V twice; that needs the model to split its attention call and
is left out so the model stays unchanged.

Slabs: ``a`` time blocks x ``b`` height blocks (near-even splits; in proportion
to the ranks' speeds where they differ, :func:`slab_ranges`) with
``a * b = min(P, T * H)`` slabs, the factorisation with the fewest halo rows
over the schedule's layouts (then the smallest compute maximum). Ranks beyond
the slab count (more ranks than slabs: tiny grids) hold no rows, compute no
window and still join every collective. With one rank the same code runs
with local permutations: the single-device path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..attention.common import even_splits
from ..attention.window import WindowPack, window_attention
from ..distributed.agree import agree
from ..distributed.autograd import all_reduce_sum, connect_empty, replicated_gather
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from ..fixed_shape import DEFAULT
from ..windows.capacity import Shares, proportional_split
from ..windows.capacity import ranges as split_ranges
from ..windows.exchange import exchange
from ..windows.geometry import NUM_WINDOWS, WindowLayout, canonical_method, check_grid, short_name, window_layout
from ..windows.ownership import RowOwnership, ownership_transition
from ..windows.plan import LRUCache, Transition
from .handoff import rows_to_tokens, tokens_to_rows
from .protocol import RopeFn

PLAN_VERSION = 1
_PLANS = LRUCache(16)


# -- the pure plan (numpy, no torch.distributed) -------------------------------------------------------


def slab_ranges(grid: Sequence[int], a: int, b: int,
                speeds: Sequence[float] | None = None) -> list[tuple[int, int, int, int]]:
    """``(t0, t1, h0, h1)`` of the ``a x b`` blocks, time-major (rank r = it * b + ih).

    ``speeds`` (per rank, unequal ranks): time blocks cut in proportion to the summed speed of their
    ``b`` ranks, each time block's rows in proportion to its ranks' speeds (whole rows, every slab at
    least one where the grid allows); None: near-even splits."""
    T, H, _ = grid
    if speeds is None or len(set(speeds[:a * b])) <= 1:
        ts, hs = even_splits(T, a), even_splits(H, b)
        t_start, h_start = np.concatenate([[0], np.cumsum(ts)]), np.concatenate([[0], np.cumsum(hs)])
        return [(int(t_start[i]), int(t_start[i + 1]), int(h_start[j]), int(h_start[j + 1]))
                for i in range(a) for j in range(b)]
    rows = [list(speeds[i * b:(i + 1) * b]) for i in range(a)]
    out = []
    for i, (t0, t1) in enumerate(split_ranges(proportional_split(T, [sum(r) for r in rows], minimum=1))):
        out += [(t0, t1, h0, h1) for h0, h1 in split_ranges(proportional_split(H, rows[i], minimum=1))]
    return out


@dataclass(frozen=True, eq=False)
class LayoutCompute:
    """Which rank computes each window of one layout, and the rows it borrows for that."""

    layout: WindowLayout
    window_rank: np.ndarray  # computing rank of every window
    compute: RowOwnership  # rows of the windows each rank computes, window order
    halo_rows: int  # rows attended away from their owner (fetched, and returned)
    rank_compute_rows: np.ndarray  # rows each rank attends
    rank_halo_in: np.ndarray  # halo rows each rank fetches

    def rank_windows(self, rank: int) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.window_rank == rank)]


def _assign(layout: WindowLayout, slabs: RowOwnership) -> LayoutCompute:
    p, nw = slabs.world_size, len(layout)
    win = layout.window_of_token()
    rows = np.bincount(win * p + slabs.owner, minlength=nw * p).reshape(nw, p)  # rows[w, r]
    load = np.zeros(p, dtype=np.int64)
    window_rank = np.empty(nw, dtype=np.int64)
    for w in range(nw):  # most rows first, then the less loaded rank, then the lower rank
        r = min(range(p), key=lambda r: (-rows[w, r], load[r], r))
        window_rank[w] = r
        load[r] += layout.token_counts[w]
    ids = [np.concatenate([layout.window_token_ids(i) for i in np.flatnonzero(window_rank == r)])
           if (window_rank == r).any() else np.zeros(0, dtype=np.int64) for r in range(p)]
    compute = RowOwnership.from_rank_ids(layout.grid, ids, f"{layout.name}/halo")
    own = rows[np.arange(nw), window_rank]
    halo_in = np.bincount(window_rank, weights=layout.token_counts - own, minlength=p).astype(np.int64)
    return LayoutCompute(layout, window_rank, compute, int(halo_in.sum()), load, halo_in)


@dataclass(frozen=True, eq=False)
class HaloPlan:
    """Slabs of one grid and the compute assignment of each layout of a schedule."""

    grid: tuple[int, int, int]
    world_size: int
    blocks: tuple[int, int]  # (time blocks, height blocks)
    speeds: tuple[float, ...] | None  # the ranks' speeds the slabs were cut by (None: near-even)
    ranges: tuple[tuple[int, int, int, int], ...]  # per slab; ranks >= len(ranges) hold nothing
    slabs: RowOwnership
    layer_methods: tuple[str, ...]
    layouts: dict  # method -> LayoutCompute
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(np.prod(self.grid))

    @property
    def num_slabs(self) -> int:
        return len(self.ranges)

    def layer(self, layer: int) -> LayoutCompute:
        return self.layouts[self.layer_methods[layer]]

    def fetch(self, method: str) -> Transition:
        """Slab rows -> the windows their computing ranks attend."""
        return ownership_transition(self.slabs, self.layouts[method].compute)

    def give_back(self, method: str) -> Transition:
        """Attended rows -> their slab owners."""
        return ownership_transition(self.layouts[method].compute, self.slabs)

    def halo_rows_per_layer(self) -> list[int]:
        return [self.layouts[m].halo_rows for m in self.layer_methods]

    def compute_imbalance(self) -> float:
        """max / mean attended rows, averaged over layers (1.0 is perfect)."""
        vals = [float(c.rank_compute_rows.max() / c.rank_compute_rows.mean())
                for c in (self.layouts[m] for m in self.layer_methods)]
        return float(np.mean(vals))

    def describe(self) -> str:
        halo = self.halo_rows_per_layer()
        by = "" if self.speeds is None else f" by speed {':'.join(f'{v:g}' for v in self.speeds)}"
        return (f"{self.blocks[0]}x{self.blocks[1]} (time x height) slabs{by} on {self.num_slabs} of {self.world_size} "
                f"ranks, halo {max(halo) / self.num_tokens:.1%} of rows per layer")


def _build(grid, methods, world, num_windows, a, b, speeds=None) -> HaloPlan:
    ranges = slab_ranges(grid, a, b, speeds)
    T, H, W = grid
    ids = [(((np.arange(t0, t1)[:, None, None] * H + np.arange(h0, h1)[None, :, None]) * W
             + np.arange(W)[None, None, :]).reshape(-1)) for t0, t1, h0, h1 in ranges]
    ids += [np.zeros(0, dtype=np.int64)] * (world - len(ranges))
    slabs = RowOwnership.from_rank_ids(grid, ids, f"slabs{a}x{b}")
    distinct = list(dict.fromkeys(methods))
    layouts = {m: _assign(window_layout(grid, m, num_windows), slabs) for m in distinct}
    return HaloPlan(tuple(grid), world, (a, b), None if speeds is None else tuple(speeds), tuple(ranges), slabs,
                    tuple(methods), layouts)


def plan_halo(grid: Sequence[int], layer_methods: Sequence[str], world_size: int,
              num_windows: Sequence[int] = NUM_WINDOWS, blocks: tuple[int, int] | None = None,
              speeds: Sequence[float] | None = None) -> HaloPlan:
    """The (cached) halo-slab plan; ``blocks`` forces the ``(time, height)`` block counts; ``speeds`` (one
    per rank) cut the slabs in proportion to them (:func:`slab_ranges`), equal speeds as None."""
    grid = check_grid(grid)
    methods = tuple(canonical_method(m) for m in layer_methods)
    if not methods:
        raise ValueError("a schedule needs at least one layer")
    world = int(world_size)
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    speeds = None if speeds is None or len(set(speeds)) <= 1 else tuple(float(v) for v in speeds)
    if speeds is not None and len(speeds) != world:
        raise ValueError(f"{len(speeds)} rank speeds for {world} ranks")
    key = (grid, methods, world, tuple(num_windows), blocks, PLAN_VERSION) + ((speeds,) if speeds else ())

    def make() -> HaloPlan:
        T, H, _ = grid
        if blocks is not None:
            a, b = blocks
            if a < 1 or b < 1 or a > T or b > H or a * b > world:
                raise ValueError(f"{a}x{b} slabs do not fit grid {grid} on {world} ranks")
            return _build(grid, methods, world, num_windows, a, b, speeds)
        target = min(world, T * H)
        cands = [(a, target // a) for a in range(1, min(T, target) + 1)
                 if target % a == 0 and target // a <= H]
        if not cands:  # no exact factorisation fits: the largest slab count that does
            cands = [max(((a, min(H, target // a)) for a in range(1, min(T, target) + 1)),
                         key=lambda ab: (ab[0] * ab[1], -ab[0]))]
        plans = [_build(grid, methods, world, num_windows, a, b, speeds) for a, b in cands]
        return min(plans, key=lambda hp: (sum(hp.halo_rows_per_layer()),
                                          sum(int(c.rank_compute_rows.max()) for c in hp.layouts.values()),
                                          hp.blocks))

    return _PLANS.get_or_make(key, make)


# -- the runtime ---------------------------------------------------------------------------------


class HaloSlabRuntime:
    """Plan B for one request on one SP group; implements :class:`~ditsp.sp.protocol.SPRuntime`."""

    kernel_shapes = DEFAULT

    def __init__(self, grid: Sequence[int], layer_methods: Sequence[str], comm: Comm,
                 num_windows: Sequence[int] = NUM_WINDOWS, dtype: torch.dtype = torch.float32,
                 blocks: tuple[int, int] | None = None, transport=None, shares: Shares | None = None):
        self.comm, self.rank, self.world_size, self.dtype = comm, comm.rank, comm.world_size, dtype
        self.transport = Transport(comm, transport)  # the halo and handoff exchanges' settings
        methods = [canonical_method(m) for m in layer_methods]
        agree(comm, "the halo-slab request (grid, schedule, windows, blocks, dtype, world size)",
              {"grid": [int(v) for v in grid], "schedule": [short_name(m) for m in methods],
               "num_windows": [int(v) for v in num_windows], "blocks": list(blocks) if blocks else None,
               "dtype": str(dtype), "world_size": comm.world_size, "version": PLAN_VERSION,
               "speeds": None if shares is None else list(shares.speed)})
        self.plan = plan_halo(grid, methods, comm.world_size, num_windows, blocks,
                              None if shares is None else shares.speed)
        self.current: str | None = None
        self._packs: dict = {}
        self._ids = torch.from_numpy(self.plan.slabs.rank_ids(self.rank))

    @classmethod
    def single(cls, grid, layer_methods, num_windows=NUM_WINDOWS, dtype=torch.float32) -> "HaloSlabRuntime":
        return cls(grid, layer_methods, Comm.single(), num_windows, dtype)

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.plan.grid

    @property
    def layer_methods(self) -> tuple[str, ...]:
        return self.plan.layer_methods

    def num_windows(self, layer: int) -> int:
        return len(self.plan.layer(layer).layout)

    def num_local_rows(self, layer: int = 0) -> int:
        return int(self._ids.numel())

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        lc = self.plan.layer(layer)
        return [lc.layout.window_shape(i) for i in lc.rank_windows(self.rank)]

    def window_pack(self, layer: int, device) -> WindowPack:
        key = (self.plan.layer_methods[layer], str(device))
        if key not in self._packs:
            self._packs[key] = WindowPack.build(self.local_window_shapes(layer), device)
        return self._packs[key]

    def scatter(self, x_canonical: torch.Tensor, layer: int = 0) -> torch.Tensor:
        if x_canonical.shape[0] != self.plan.num_tokens:
            raise ValueError(f"expected {self.plan.num_tokens} canonical rows, got {x_canonical.shape[0]}")
        self.current = self.plan.layer_methods[layer]
        return x_canonical.index_select(0, self._ids.to(x_canonical.device))

    def scatter_rows(self, x_rows: torch.Tensor, src: RowOwnership, patch) -> torch.Tensor:
        """This rank's rows of ``src`` -> its slab's patched rows, one exchange."""
        self.current = self.plan.layer_methods[0]
        return rows_to_tokens(x_rows, src, self.plan.slabs, patch, self.transport)

    def gather_rows(self, y_local: torch.Tensor, dst: RowOwnership, patch) -> torch.Tensor:
        return tokens_to_rows(y_local, self.plan.slabs, dst, patch, self.transport)

    def enter_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows stay on their slab: only attention borrows halo rows."""
        if self.current is None:
            raise RuntimeError("scatter() the input before entering a layer")
        self.current = self.plan.layer_methods[layer]
        return x

    def attend(self, q, k, v, tq, tk, tv, pack: WindowPack, rope: RopeFn | None = None):
        """Fetch halo Q/K/V -> attention over whole windows -> outputs back to the slab owners."""
        method = self.current
        n, heads, dim = q.shape
        qkv = exchange(torch.stack((q, k, v), 1), self.plan.fetch(method), self.transport)  # (m, 3, H, D)
        q_, k_, v_ = qkv.unbind(1)
        out, tsum = window_attention(q_, k_, v_, tq, tk, tv, pack, rope)
        if pack.num_rows == 0:  # no window here: stay in the backward graph (ditsp.distributed.autograd)
            out, tsum = connect_empty(out, tsum, q_, k_, v_, tq, tk, tv)
        del qkv, q_, k_, v_
        return exchange(out, self.plan.give_back(method), self.transport), tsum

    def reduce_text(self, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
        """Plain mean over all windows: local sums, one SUM all-reduce, / window count."""
        if txt_sum.dtype != self.dtype:
            raise TypeError(f"text reduction in {txt_sum.dtype}, but the runtime agreed on {self.dtype}")
        return all_reduce_sum(self.comm, txt_sum, kind="text_all_reduce") / self.num_windows(layer)

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        own = torch.from_numpy(self.plan.slabs.rank_ids(self.rank))
        return replicated_gather(self._gather, y_local, own)

    def _gather(self, y_local: torch.Tensor) -> torch.Tensor:
        rows = [int(v) for v in self.plan.slabs.rank_rows]
        parts = self.comm.all_gather_rows(y_local, rows, kind="output_gather")
        out = y_local.new_empty((self.plan.num_tokens,) + tuple(y_local.shape[1:]))
        for r, part in enumerate(parts):
            if part.shape[0]:
                out[torch.from_numpy(self.plan.slabs.rank_ids(r)).to(out.device)] = part
        return out

    def report(self, heads: int | None = None) -> str:
        heads_txt = f", {heads} heads on every rank" if heads else ""
        return f"halo-slab Plan B, {self.plan.describe()}, SP={self.world_size}{heads_txt}"
