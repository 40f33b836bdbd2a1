"""Window geometry: the reference's worked examples and partition properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.windows.geometry import (
    GEOMETRY_VERSION,
    REGULAR,
    SHIFTED,
    geometry_fingerprint,
    make_windows,
    window_layout,
    window_size,
)


def _cuts(windows, axis):
    return sorted({w[axis].start for w in windows} | {w[axis].stop for w in windows})


# The reference's own worked examples (its window rule: docs/seedvr2.md): grid, window size, regular count, shifted count
WORKED = [
    ((21, 45, 80), (6, 15, 27), 36, 64),
    ((21, 90, 160), (6, 15, 27), 144, 196),
    ((21, 67, 120), (6, 15, 27), 100, 100),
    ((21, 135, 240), (6, 15, 27), 324, 400),
    ((1, 45, 80), (1, 15, 27), 9, 16),
    ((1, 90, 160), (1, 15, 27), 36, 49),
    ((31, 45, 80), (8, 15, 27), 36, 80),
    ((25, 45, 80), (7, 15, 27), 36, 80),
    ((1, 64, 64), (1, 20, 20), 16, 16),
]


@pytest.mark.parametrize("grid,size,n_reg,n_shift", WORKED)
def test_worked_examples(grid, size, n_reg, n_shift):
    assert window_size(grid) == size
    assert len(make_windows(grid, "regular")) == n_reg
    assert len(make_windows(grid, "shifted")) == n_shift


def test_720p_cuts_and_order():
    reg = make_windows((21, 45, 80), REGULAR)
    assert _cuts(reg, 0) == [0, 6, 12, 18, 21]
    assert _cuts(reg, 1) == [0, 15, 30, 45]
    assert _cuts(reg, 2) == [0, 27, 54, 80]
    starts = [(w[0].start, w[1].start, w[2].start) for w in reg[:6]]
    assert starts == [(0, 0, 0), (6, 0, 0), (12, 0, 0), (18, 0, 0), (0, 15, 0), (6, 15, 0)]
    sh = make_windows((21, 45, 80), SHIFTED)
    assert _cuts(sh, 0) == [0, 3, 9, 15, 21]
    assert _cuts(sh, 1) == [0, 7, 22, 37, 45]
    assert _cuts(sh, 2) == [0, 13, 40, 67, 80]
    lay = window_layout((21, 45, 80), "regular")
    assert lay.token_counts.min() == 1170 and lay.token_counts.max() == 2430
    assert window_layout((21, 45, 80), "shifted").token_counts.min() == 273


def test_edge_cases_from_facts():
    # 1080p: last h window 60-67, last w 108-120; shifted drops the empty 6th window
    reg = make_windows((21, 67, 120), "regular")
    assert _cuts(reg, 1)[-2:] == [60, 67] and _cuts(reg, 2)[-2:] == [108, 120]
    # image 720p: first windows (t,h,w starts) (0,0,0),(0,15,0),(0,30,0),(0,0,27)
    img = make_windows((1, 45, 80), "regular")
    assert [(w[0].start, w[1].start, w[2].start) for w in img[:4]] == [(0, 0, 0), (0, 15, 0), (0, 30, 0), (0, 0, 27)]
    assert _cuts(make_windows((31, 45, 80), "shifted"), 0) == [0, 4, 12, 20, 28, 31]
    last_t = make_windows((25, 45, 80), "shifted")[-1][0]
    assert (last_t.start, last_t.stop) == (24, 25)
    assert _cuts(make_windows((1, 64, 64), "shifted"), 1) == [0, 10, 30, 50, 64]
    assert window_layout((1, 64, 64), "regular").token_counts.min() == 16


def test_reference_vector_windows():
    """The windows listed in the reference vectors' config (grid 5,20,36)."""
    reg = [(w[0].start, w[0].stop, w[1].start, w[1].stop, w[2].start, w[2].stop) for w in make_windows((5, 20, 36), "regular")]
    assert reg[:4] == [(0, 2, 0, 15, 0, 27), (2, 4, 0, 15, 0, 27), (4, 5, 0, 15, 0, 27), (0, 2, 15, 20, 0, 27)]
    sh = [(w[0].start, w[0].stop, w[1].start, w[1].stop, w[2].start, w[2].stop) for w in make_windows((5, 20, 36), "shifted")]
    assert sh[0] == (0, 1, 0, 7, 0, 13) and sh[-1] == (3, 5, 7, 20, 13, 36) and len(sh) == 12


def test_bad_input():
    for grid in [(0, 4, 4), (1, -2, 4), (1.5, 4, 4), (1, 4), "1,2,3", (True, 4, 4)]:
        with pytest.raises(ValueError):
            make_windows(grid, "regular")
    with pytest.raises(ValueError, match="unknown window method"):
        make_windows((1, 4, 4), "diagonal")
    for nw in [(4, 3), (0, 3, 3), (4, 3, 3, 1)]:
        with pytest.raises(ValueError, match="num_windows"):
            make_windows((1, 4, 4), "regular", nw)


def test_fingerprint_and_aliases():
    assert geometry_fingerprint("regular") == geometry_fingerprint(REGULAR)
    assert geometry_fingerprint("regular") != geometry_fingerprint("shifted")
    assert geometry_fingerprint("regular") != geometry_fingerprint("regular", (4, 3, 2))
    lay = window_layout((5, 20, 36), "shifted")
    assert lay.key() == ((5, 20, 36), geometry_fingerprint("shifted"), GEOMETRY_VERSION)
    assert window_layout((5, 20, 36), "shifted") is lay  # cached


def test_4k_layout_is_vectorised_and_fast():
    import time

    t0 = time.perf_counter()
    lay = window_layout((21, 135, 240), "shifted", (4, 3, 2))  # a fresh cache entry
    assert lay.num_tokens == 680_400
    assert time.perf_counter() - t0 < 1.0


grids = st.tuples(st.integers(1, 40), st.integers(1, 60), st.integers(1, 60))


@settings(max_examples=80, deadline=None)
@given(grid=grids, method=st.sampled_from(["regular", "shifted"]),
       nw=st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4)))
def test_partition_properties(grid, method, nw):
    lay = window_layout(grid, method, nw)
    t, h, w = grid
    # every token in exactly one window
    assert np.array_equal(np.sort(lay.token_ids), np.arange(t * h * w))
    assert lay.token_counts.min() > 0
    # ids are canonical and row-major inside each window
    for i, (st_, sh, sw) in enumerate(lay.windows):
        tt, hh, ww = np.meshgrid(np.arange(st_.start, st_.stop), np.arange(sh.start, sh.stop),
                                 np.arange(sw.start, sw.stop), indexing="ij")
        assert np.array_equal(lay.window_token_ids(i), ((tt * h + hh) * w + ww).ravel())
    # order: w outermost, then h, t fastest
    keys = [(win[2].start, win[1].start, win[0].start) for win in lay.windows]
    assert keys == sorted(keys)
    # the window owner map inverts the partition
    owner = lay.window_of_token()
    assert np.array_equal(owner[lay.token_ids], np.repeat(np.arange(len(lay)), lay.token_counts))


@settings(max_examples=60, deadline=None)
@given(grid=grids)
def test_shift_is_half_window_clipped(grid):
    wt, wh, ww = window_size(grid)
    sh = window_layout(grid, "shifted")
    for axis, (size, win) in enumerate(zip(grid, (wt, wh, ww))):
        cuts = _cuts(sh.windows, axis)
        if win < size:
            want = sorted({int((i + 0.5) * win) for i in range(size + 1)} & set(range(1, size)))
            assert cuts[1:-1] == want
        else:
            assert cuts == [0, size]
