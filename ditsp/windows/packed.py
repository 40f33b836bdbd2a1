"""A packed window layout: the windows of several requests (grids) as one layout, planned once.

Each request keeps its own reference windows; the packed layout lists request
0's windows, then request 1's, ... (window id offsets), and gives request
``r``'s canonical token ``i`` the packed id ``row_offset[r] + i`` (packed rows
are the requests' canonical rows back to back). It is an ordinary
:class:`~ditsp.windows.geometry.WindowLayout`, so plans, transitions, the
exchange and both planners (``lpt``, ``locality``) take it unchanged:

- ids: a permutation of ``0..total-1`` (what plans and transitions index by);
- geometry: request grids placed side by side along ``w`` in a virtual grid
  ``(max T, max H, sum W)``; windows of different requests never overlap, and
  the locality planner's coordinate starts see requests as neighbouring
  blocks. Only window *shapes* reach attention (RoPE is window-local), so the
  placement changes no output;
- fingerprint: the method's geometry fingerprint plus every request's grid,
  so a different mix never reuses a cached plan.

Pure numpy, cached by the request mix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from .geometry import NUM_WINDOWS, WindowLayout, canonical_method, check_grid, window_layout


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """One window method's packed layout plus where each request sits in it."""

    layout: WindowLayout
    grids: tuple[tuple[int, int, int], ...]
    row_offsets: tuple[int, ...]  # packed row of each request's first token, plus the total
    window_offsets: tuple[int, ...]  # packed window id of each request's first window, plus the total

    @property
    def num_requests(self) -> int:
        return len(self.grids)

    def request_windows(self, r: int) -> int:
        return self.window_offsets[r + 1] - self.window_offsets[r]

    def window_request(self) -> np.ndarray:
        """Request index of every packed window."""
        counts = np.diff(np.array(self.window_offsets))
        return np.repeat(np.arange(self.num_requests), counts)


def _fingerprint(method: str, grids, num_windows, base: str) -> str:
    text = f"packed|{base}|{canonical_method(method)}|{tuple(num_windows)}|{grids}"
    return hashlib.sha1(text.encode()).hexdigest()


@lru_cache(maxsize=64)
def _packed(grids: tuple, method: str, num_windows: tuple) -> PackedLayout:
    lays = [window_layout(g, method, num_windows) for g in grids]
    vgrid = (max(g[0] for g in grids), max(g[1] for g in grids), sum(g[2] for g in grids))
    windows, counts, ids = [], [], []
    row_off, win_off, w0 = [0], [0], 0
    for g, lay in zip(grids, lays):
        for st, sh, sw in lay.windows:
            windows.append((st, sh, slice(sw.start + w0, sw.stop + w0)))
        counts.append(lay.token_counts)
        ids.append(lay.token_ids + row_off[-1])
        row_off.append(row_off[-1] + lay.num_tokens)
        win_off.append(win_off[-1] + len(lay))
        w0 += g[2]
    counts_a = np.concatenate(counts).astype(np.int64)
    offsets = np.zeros(len(windows) + 1, dtype=np.int64)
    np.cumsum(counts_a, out=offsets[1:])
    ids_a = np.concatenate(ids).astype(np.int64)
    for arr in (counts_a, offsets, ids_a):
        arr.setflags(write=False)
    layout = WindowLayout(grid=vgrid, method=lays[0].method, num_windows=lays[0].num_windows,
                          windows=tuple(windows), token_counts=counts_a, offsets=offsets, token_ids=ids_a,
                          fingerprint=_fingerprint(method, grids, num_windows, lays[0].fingerprint))
    return PackedLayout(layout, grids, tuple(row_off), tuple(win_off))


def packed_layout(grids: Sequence[Sequence[int]], method: str, num_windows: Sequence[int] = NUM_WINDOWS) -> PackedLayout:
    """The (cached) packed layout of ``grids`` (one per request, in request order) for ``method``."""
    if not grids:
        raise ValueError("a packed layout needs at least one request grid")
    gs = tuple(check_grid(g) for g in grids)
    return _packed(gs, canonical_method(method), tuple(int(v) for v in num_windows))
