"""SeedVR2 3D window layouts, exactly as the reference partitions a token grid.

A layout is the ordered list of windows of a post-patch grid (T, H, W) for one
window method, plus the canonical token ids ``(t*H + h)*W + w`` of each window
(row-major inside a window). Everything here is pure: no torch, no network.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

# The reference's window counts (t, h, w) of a 720p-sized grid, scaled by size for other grids.
NUM_WINDOWS = (4, 3, 3)

GEOMETRY_VERSION = 1
REFERENCE_AREA = 45 * 80  # 720x1280 pixels / 16x16 pixels per post-patch token
MAX_TEMPORAL_WINDOW = 30  # BYTEDANCE_MAX_TEMPORAL_WINDOW

REGULAR = "720pwin_by_size_bysize"
SHIFTED = "720pswin_by_size_bysize"
_ALIASES = {"regular": REGULAR, "shifted": SHIFTED, REGULAR: REGULAR, SHIFTED: SHIFTED}

Grid = tuple[int, int, int]
Window = tuple[slice, slice, slice]


def canonical_method(method: str) -> str:
    """Reference method name for a method or its alias (``regular``/``shifted``)."""
    try:
        return _ALIASES[method]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown window method {method!r}; expected one of "
            f"{sorted(set(_ALIASES))}"
        ) from None


def short_name(method: str) -> str:
    """``regular`` or ``shifted`` for a method name or alias."""
    return "regular" if canonical_method(method) == REGULAR else "shifted"


def check_grid(grid: Sequence[int]) -> Grid:
    """Validate a post-patch grid (T, H, W) of positive integers."""
    if isinstance(grid, (str, bytes)) or len(grid) != 3:
        raise ValueError(f"grid must be three positive integers (T, H, W), got {grid!r}")
    out = []
    for name, v in zip("THW", grid):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"grid {name} must be an integer, got {v!r}")
        if v <= 0:
            raise ValueError(f"grid {name} must be positive, got {v}")
        out.append(int(v))
    return (out[0], out[1], out[2])


def _check_num_windows(num_windows: Sequence[int]) -> tuple[int, int, int]:
    if isinstance(num_windows, (str, bytes)) or len(num_windows) != 3:
        raise ValueError(f"num_windows must be three positive integers, got {num_windows!r}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0 for n in num_windows):
        raise ValueError(f"num_windows must be three positive integers, got {num_windows!r}")
    return tuple(int(n) for n in num_windows)  # type: ignore[return-value]


def window_size(grid: Sequence[int], num_windows: Sequence[int] = NUM_WINDOWS) -> Grid:
    """(wt, wh, ww): the 720p-normalised window size of the reference."""
    t, h, w = check_grid(grid)
    nt, nh, nw = _check_num_windows(num_windows)
    scale = math.sqrt(REFERENCE_AREA / (h * w))
    rh, rw = round(h * scale), round(w * scale)  # Python round: half to even
    # A very thin grid (e.g. 1 x 14400) rounds one side to 0 tokens and the reference divides by
    # zero; every window spans at least one token instead (no grid the reference plans changes).
    rh, rw = max(1, rh), max(1, rw)
    return (math.ceil(min(t, MAX_TEMPORAL_WINDOW) / nt), math.ceil(rh / nh), math.ceil(rw / nw))


def _regular_cuts(size: int, win: int) -> list[tuple[int, int]]:
    return [(i * win, min((i + 1) * win, size)) for i in range(math.ceil(size / win))]


def _shifted_cuts(size: int, win: int) -> list[tuple[int, int]]:
    shift = 0.5 if win < size else 0.0
    count = math.ceil((size - shift) / win) + 1 if shift > 0 else 1
    cuts = [(max(int((i - shift) * win), 0), min(int((i - shift + 1) * win), size)) for i in range(count)]
    return [(a, b) for a, b in cuts if b > a]  # empty windows are dropped


def make_windows(grid: Sequence[int], method: str, num_windows: Sequence[int] = NUM_WINDOWS) -> list[Window]:
    """Windows of ``grid`` in reference order (w outermost, then h, t fastest)."""
    t, h, w = check_grid(grid)
    cuts = _regular_cuts if canonical_method(method) == REGULAR else _shifted_cuts
    wt, wh, ww = window_size((t, h, w), num_windows)
    ct, ch, cw = cuts(t, wt), cuts(h, wh), cuts(w, ww)
    return [(slice(*st), slice(*sh), slice(*sw)) for sw in cw for sh in ch for st in ct]


def window_counts(grid: Sequence[int], method: str, num_windows: Sequence[int] = NUM_WINDOWS) -> Grid:
    """Windows along (t, h, w) of ``grid`` for ``method``, by arithmetic (no window list is built).

    The same counts as :func:`make_windows`, whose window list is their product.
    """
    t, h, w = check_grid(grid)
    shifted = canonical_method(method) == SHIFTED

    def count(size: int, win: int) -> int:
        if not shifted:
            return -(-size // win)
        if win >= size:
            return 1
        n = math.ceil((size - 0.5) / win) + 1
        # only the first and the last shifted cut can be empty (inner ones span >= win - 1 >= 1)
        first = int(0.5 * win) > 0
        last = min(int((n - 0.5) * win), size) > max(int((n - 1.5) * win), 0)
        return n - (not first) - (not last)

    wt, wh, ww = window_size((t, h, w), num_windows)
    return (count(t, wt), count(h, wh), count(w, ww))


def geometry_fingerprint(method: str, num_windows: Sequence[int] = NUM_WINDOWS) -> str:
    """SHA-1 over the method, its parameters and the geometry version."""
    text = (
        f"v{GEOMETRY_VERSION}|{canonical_method(method)}|nw={tuple(_check_num_windows(num_windows))}"
        f"|area={REFERENCE_AREA}|tcap={MAX_TEMPORAL_WINDOW}|round=half-even|shift=clipped-half"
    )
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class WindowLayout:
    """One window layout of one grid: windows, token counts and canonical ids.

    ``token_ids`` holds every window's canonical ids back to back (window order,
    row-major inside); window ``i`` owns ``token_ids[offsets[i]:offsets[i+1]]``.
    """

    grid: Grid
    method: str
    num_windows: tuple[int, int, int]
    windows: tuple[Window, ...]
    token_counts: np.ndarray
    offsets: np.ndarray
    token_ids: np.ndarray
    fingerprint: str
    _window_of_token: list = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return short_name(self.method)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return len(self.windows)

    def window_token_ids(self, i: int) -> np.ndarray:
        return self.token_ids[self.offsets[i] : self.offsets[i + 1]]

    def window_shape(self, i: int) -> Grid:
        st, sh, sw = self.windows[i]
        return (st.stop - st.start, sh.stop - sh.start, sw.stop - sw.start)

    def window_of_token(self) -> np.ndarray:
        """For every canonical token id, the index of the window that holds it."""
        if not self._window_of_token:
            owner = np.empty(self.num_tokens, dtype=np.int64)
            owner[self.token_ids] = np.repeat(np.arange(len(self)), self.token_counts)
            self._window_of_token.append(owner)
        return self._window_of_token[0]

    def key(self) -> tuple:
        return (self.grid, self.fingerprint, GEOMETRY_VERSION)


def _window_ids(grid: Grid, win: Window) -> np.ndarray:
    _, h, w = grid
    st, sh, sw = win
    t_ = np.arange(st.start, st.stop, dtype=np.int64)[:, None, None]
    h_ = np.arange(sh.start, sh.stop, dtype=np.int64)[None, :, None]
    w_ = np.arange(sw.start, sw.stop, dtype=np.int64)[None, None, :]
    return ((t_ * h + h_) * w + w_).ravel()


@lru_cache(maxsize=64)
def _layout(grid: Grid, method: str, num_windows: tuple[int, int, int]) -> WindowLayout:
    windows = tuple(make_windows(grid, method, num_windows))
    counts = np.array(
        [(a.stop - a.start) * (b.stop - b.start) * (c.stop - c.start) for a, b, c in windows], dtype=np.int64
    )
    offsets = np.zeros(len(windows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids = np.concatenate([_window_ids(grid, win) for win in windows])
    for arr in (counts, offsets, ids):
        arr.setflags(write=False)
    return WindowLayout(
        grid=grid,
        method=method,
        num_windows=num_windows,
        windows=windows,
        token_counts=counts,
        offsets=offsets,
        token_ids=ids,
        fingerprint=geometry_fingerprint(method, num_windows),
    )


def window_layout(grid: Sequence[int], method: str, num_windows: Sequence[int] = NUM_WINDOWS) -> WindowLayout:
    """The (cached, immutable) layout of ``grid`` for ``method``."""
    return _layout(check_grid(grid), canonical_method(method), _check_num_windows(num_windows))
