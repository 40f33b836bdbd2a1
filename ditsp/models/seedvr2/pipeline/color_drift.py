"""Colour drift: how far the restored frames' colour moved from the input's upscale, per window and overall.

Both sides are uint8 frames ``(T, H, W, 3)`` of the output's size: the frames
rank 0 writes, and the input resized to that size by the pipeline's own
transform (what the model was given). In CIE L*a*b* (D65, :mod:`.lab`), per pixel
chroma ``C* = sqrt(a*^2 + b*^2)`` (how far from grey) and hue angle
``h = atan2(b*, a*)``:

* ``saturation_shift``: the output's mean C* over the input's, minus 1
  (+0.30: 30% more saturated);
* ``hue_shift_deg``: the circular mean of ``h_out - h_in`` in degrees, each pixel
  weighted by ``C*_out C*_in``: the angle of ``sum (a_o + i b_o)(a_i - i b_i)``,
  so a grey pixel, whose hue means nothing, weighs nothing;
* ``lightness_shift``: the output's mean L* minus the input's (L* in 0-100).

A window's figures are over the frames written while it was the newest window
(each frame counts once). Frames of more than 2^16 pixels are measured on a
regular subgrid (every s-th row and column, the smallest s that brings them
under): means over a whole frame need no more, and the cost stays small at 4K.
"""

from __future__ import annotations

import math

import torch

from .lab import rgb_to_lab

MAX_PIXELS = 2**16
LISTED = 6  # windows the text line lists one by one; past that, the one that drifts most (--json has all)
_SUMS = ("n", "chroma_out", "chroma_in", "cross", "dot", "lightness")


def _lab(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (T, H, W, 3) -> L*a*b* (T, 3, h, w) in float32, on the subgrid."""
    t, h, w, _ = frames.shape
    s = max(1, math.ceil(math.sqrt(h * w / MAX_PIXELS)))
    x = frames[:, ::s, ::s].permute(0, 3, 1, 2).float().div(255)
    return rgb_to_lab(x)


def drift_sums(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The sums the figures are made of, for uint8 frames ``out`` and ``ref`` of one shape."""
    if out.shape != ref.shape or out.dim() != 4 or out.shape[-1] != 3:
        raise ValueError(f"colour drift: output {tuple(out.shape)} and reference {tuple(ref.shape)} must be equal "
                         f"(T, H, W, 3) shapes")
    lo, li = _lab(out).double(), _lab(ref).double()
    ao, bo, ai, bi = lo[:, 1], lo[:, 2], li[:, 1], li[:, 2]
    return {"n": float(ao.numel()), "chroma_out": torch.hypot(ao, bo).sum().item(),
            "chroma_in": torch.hypot(ai, bi).sum().item(), "cross": (bo * ai - ao * bi).sum().item(),
            "dot": (ao * ai + bo * bi).sum().item(), "lightness": (lo[:, 0] - li[:, 0]).sum().item()}


def figures(sums: dict[str, float]) -> dict[str, float | None]:
    """The three figures of summed :func:`drift_sums` (None where undefined: a grey input has no saturation)."""
    n = sums["n"]
    sat = sums["chroma_out"] / sums["chroma_in"] - 1 if sums["chroma_in"] > 0 else None
    hue = math.degrees(math.atan2(sums["cross"], sums["dot"])) if sums["cross"] or sums["dot"] else None
    return {"saturation_shift": sat, "hue_shift_deg": hue, "lightness_shift": sums["lightness"] / n if n else None}


def color_drift(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float | None]:
    """The figures of whole clips ``out`` against ``ref`` (uint8 (T, H, W, 3))."""
    return figures(drift_sums(out, ref))


class ColorDrift:
    """The figures of frames written in chunks, per window and overall (rank 0's writer feeds it)."""

    def __init__(self):
        self.windows: dict[int, dict[str, float]] = {}
        self.frames: dict[int, int] = {}

    def add(self, window: int, out: torch.Tensor, ref: torch.Tensor) -> None:
        if not out.shape[0]:
            return
        got = drift_sums(out, ref)
        have = self.windows.setdefault(window, dict.fromkeys(_SUMS, 0.0))
        for k, v in got.items():
            have[k] += v
        self.frames[window] = self.frames.get(window, 0) + out.shape[0]

    def report(self) -> dict | None:
        if not self.windows:
            return None
        total = {k: sum(w[k] for w in self.windows.values()) for k in _SUMS}
        return {"space": "CIE L*a*b* (D65); saturation: chroma C*ab", **figures(total),
                "windows": [{"window": i, "frames": self.frames[i], **figures(self.windows[i])}
                            for i in sorted(self.windows)]}


def format_color_drift(d: dict) -> str:
    """One line of the text report."""
    def f(v, unit=""):
        return "n/a" if v is None else f"{v:+.3g}{unit}"

    def sat(v):
        return "n/a" if v is None else f"{100 * v:+.1f}%"

    def window(w):
        return f"{w['window'] + 1}: {sat(w['saturation_shift'])} / {f(w['hue_shift_deg'], ' deg')}"

    ws = d["windows"]
    if len(ws) <= LISTED:
        per = "per window, saturation / hue: " + ", ".join(window(w) for w in ws)
    else:
        most = max(ws, key=lambda w: abs(w["saturation_shift"] or 0.0))
        per = f"the most saturation drift of {len(ws)} windows: {window(most)}"
    return (f"colour drift vs the input's upscale ({d['space']}): saturation {sat(d['saturation_shift'])}, hue "
            f"{f(d['hue_shift_deg'], ' deg')}, lightness {f(d['lightness_shift'])} L* ({per})")
