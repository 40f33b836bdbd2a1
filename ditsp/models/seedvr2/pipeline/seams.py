"""Seams: where consecutive temporal windows join, and how much each join stands out in the written frames.

The seam of consecutive windows ``a`` and ``b`` covers the frame-to-frame steps
``t - 1 -> t`` for ``t`` from ``b.start`` to ``a.stop`` (into, through and out of
the frames they share; just ``b``'s first frame when they share none):
:meth:`.windows.WindowPlan.seams`. A step's change is the mean absolute difference
of the two frames (uint8 levels, over every pixel and channel).

The seam measure compares each seam's mean change with the **median** change of
the steps no seam covers (inside windows): a ratio near 1 means the join moves no
more than the clip's own motion does; a hard cut gives many times 1. The median,
not the mean, so that one fast moment inside a window neither hides nor inflates
a seam. Overall: the mean change over every seam step against the same median.

Rank 0 measures the frames as it writes them (:class:`SeamMeter`: one number per
step, each chunk joined to the previous chunk's last frame), so the video is never
read again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Span = tuple[int, int]  # steps into frames [first, stop): t - 1 -> t for first <= t < stop


def frame_steps(frames: torch.Tensor, last: torch.Tensor | None = None) -> list[float]:
    """Mean absolute change of each step into ``frames`` (frames on dim 0), starting from ``last`` if given."""
    x = frames.double() if last is None else torch.cat([last[None], frames]).double()
    if x.shape[0] < 2:
        return []
    return (x[1:] - x[:-1]).abs().reshape(x.shape[0] - 1, -1).mean(dim=1).tolist()


def _number(v: float) -> float | None:
    return None if math.isnan(v) else v


def seam_report(steps: Sequence[float], spans: Sequence[Span]) -> dict | None:
    """The seam measure of a clip whose step ``k`` (into frame ``k + 1``) changed by ``steps[k]``.

    Returns None without a seam; else ``ratio`` (every seam step's mean change / the median inside),
    ``change`` (that mean), ``inside_median``, and ``each``: per seam its ``frames`` ``[first, last]``
    (the frames whose steps it covers), ``change`` and ``ratio``. A ratio is None when it is undefined
    (no step inside windows, or a still clip).
    """
    step = torch.as_tensor(list(steps), dtype=torch.float64)
    t = step.numel() + 1
    cut = [(max(a, 1), min(b, t)) for a, b in spans]
    cut = [(a, b) for a, b in cut if a < b]
    if not cut:
        return None
    seam = torch.zeros(t - 1, dtype=torch.bool)
    for a, b in cut:
        seam[a - 1 : b - 1] = True
    inside = step[~seam].median().item() if (~seam).any() else float("nan")

    def ratio(change: float) -> float | None:
        return _number(change / inside) if inside > 0 else None

    each = []
    for a, b in cut:
        change = step[a - 1 : b - 1].mean().item()
        each.append({"frames": [a - 1, b - 1], "change": change, "ratio": ratio(change)})
    change = step[seam].mean().item()
    return {"ratio": ratio(change), "change": change, "inside_median": _number(inside), "each": each}


def seam_measure(frames: torch.Tensor, spans: Sequence[Span]) -> dict | None:
    """:func:`seam_report` of a whole clip ``frames`` (frames on dim 0, any dtype)."""
    if frames.shape[0] < 2:
        raise ValueError("a seam measure needs at least two frames")
    return seam_report(frame_steps(frames), spans)


class SeamMeter:
    """The seam measure of frames written in chunks, in order (rank 0's writer feeds it)."""

    def __init__(self, spans: Sequence[Span]):
        self.spans = list(spans)
        self.steps: list[float] = []
        self._last: torch.Tensor | None = None

    def add(self, frames: torch.Tensor) -> None:
        if frames.shape[0]:
            self.steps += frame_steps(frames, self._last)
            self._last = frames[-1].clone()

    def report(self) -> dict | None:
        return seam_report(self.steps, self.spans) if self.spans and self.steps else None


LISTED = 6  # joins the text line lists one by one; past that, the one that stands out most (--json has all)


def format_seams(m: dict) -> str:
    """One line of the text report."""
    def r(v):
        return "n/a" if v is None else f"{v:.2f}"

    def join(s):
        return f"{s['frames'][0]}-{s['frames'][1]} {r(s['ratio'])}"

    each = m["each"]
    if len(each) <= LISTED:
        per = "per join, frames: " + ", ".join(join(s) for s in each)
    else:
        worst = max(each, key=lambda s: -1.0 if s["ratio"] is None else s["ratio"])
        per = f"the most of {len(each)} joins: frames {join(worst)}"
    return (f"seams: mean frame-to-frame change {m['change']:.2f} across the {len(each)} window join(s) vs median "
            f"{r(m['inside_median'])} inside windows, ratio {r(m['ratio'])} ({per})")
