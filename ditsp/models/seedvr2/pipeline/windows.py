"""Long videos: overlapping temporal windows and a streaming cross-fade.

A clip longer than one window is restored window by window. Windows hold
``window`` frames (``4n + 1``, so the causal VAE needs no padding) and
consecutive windows share at least ``overlap`` frames:

* the plan uses the fewest windows that cover the clip with every overlap
  at least ``overlap`` frames, all of the full length (the same tensor shapes
  for every window, full temporal context at the clip's end too), with the
  starts spread evenly from frame 0 to ``frames - window``: the leftover
  frames become a little more overlap everywhere instead of a short or a
  heavily overlapping last window;
* a clip no longer than one window is a single window of the clip's length
  (the caller pads it to ``4n + 1``).

Every window has its own deterministic noise seed (``window_seed``), so the
result depends only on the clip, the seed and the window settings, never on
the SP degree or the number of ranks.

How consecutive windows are stitched together (``STITCHES``, ``--stitch``):

* ``cosine``: the restored pixels are cross-faded over the frames the windows
  share with a raised cosine sampled at frame centres: over an overlap of ``L``
  frames, at position ``k`` the earlier window weighs
  ``0.5 + 0.5 cos(pi (k + 0.5) / L)`` and the later one the rest, so neither
  ever switches hard;
* ``hann``: the overlap-add of tiled processing: every window's pixels weigh a
  Hann window over its whole length, ``sin^2(pi (k + 0.5) / N)`` at frame ``k``
  of ``N``, and the weights of a frame are normalised to sum to one (a frame
  only one window covers takes it whole). Against ``cosine`` the hand-over in
  an overlap is steeper in its middle and flatter at its ends;
* ``latent``: no pixel fade: the windows' latents are placed on the clip's one
  latent timeline, the latent frames two windows share are blended with the
  raised cosine, and the causal VAE decodes the timeline once, continuing from
  window to window (:mod:`.latent_stitch`). The decoder then never sees a
  window's cold start after the first, and each shared frame is decoded once,
  not twice. Its windows start at multiples of the VAE's time factor (a latent
  frame of one window is then a latent frame of the next), so with a factor
  above 1 the last window may be shorter and is padded like a short clip.

When more than two windows cover a frame (possible when the overlap is close to
half a window) the per-window weights are renormalised to sum to one.

``StreamingBlender`` takes restored windows in order and yields finished
frames in order, holding only the frames still shared with the next window.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..vae.config import RELEASED  # the reference pipeline's VAE: the default time factor
from .condition import window_seed

STITCHES = ("cosine", "hann", "latent")  # how consecutive windows are joined (see above); the first is the default
PIXEL_STITCHES = ("cosine", "hann")  # the ones that fade decoded pixels (StreamingBlender)

@dataclass(frozen=True)
class Window:
    """Frames ``[start, stop)`` of the clip, restored with noise seed ``seed``."""

    index: int
    start: int
    stop: int
    seed: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WindowPlan:
    """The windows of a clip, with their blend weights."""

    frames: int
    window: int
    overlap: int
    windows: tuple[Window, ...]
    stitch: str = STITCHES[0]

    def __len__(self) -> int:
        return len(self.windows)

    def __iter__(self) -> Iterator[Window]:
        return iter(self.windows)

    def __getitem__(self, i: int) -> Window:
        return self.windows[i]

    def weights(self, i: int) -> torch.Tensor:
        """Blend weights (fp64, one per frame of window ``i``) after renormalisation."""
        return _normalised_weights(self)[i]

    def covering(self, frame: int) -> list[int]:
        """Indices of the windows that contain ``frame``."""
        return [w.index for w in self.windows if w.start <= frame < w.stop]

    def seams(self) -> list[tuple[int, int]]:
        """Per pair of consecutive windows, the steps ``t - 1 -> t`` its join covers, as ``[first, stop)`` of ``t``:
        from the later window's first frame to one past the earlier's last (just the later window's first frame
        when they share nothing). The seam measure (:mod:`.seams`) reads them."""
        return [(b.start, max(a.stop, b.start) + 1) for a, b in zip(self.windows, self.windows[1:])]


def check_window(window: int, overlap: int, temporal_factor: int = RELEASED.temporal_factor) -> None:
    """Raise ``ValueError`` unless ``window`` is kn+1 (k the VAE's time factor) and ``0 <= overlap < window``."""
    k = temporal_factor
    if window < 1 or (window - 1) % k:
        examples = ", ".join(str(k * n + 1) for n in range(1, 4))
        raise ValueError(f"window must be {k}n+1 frames ({examples}, ...), got {window}")
    if not 0 <= overlap < window:
        raise ValueError(f"overlap must be in [0, window) = [0, {window}), got {overlap}")


def check_stitch(stitch: str) -> str:
    if stitch not in STITCHES:
        raise ValueError(f"unknown stitch {stitch!r}; choose one of {', '.join(STITCHES)}")
    return stitch


def plan_windows(frames: int, window: int, overlap: int = 4, seed: int = 0,
                 temporal_factor: int = RELEASED.temporal_factor, stitch: str = STITCHES[0]) -> WindowPlan:
    """Windows of ``window`` frames sharing ``overlap`` frames that cover ``frames`` frames, for ``stitch``."""
    if frames < 1:
        raise ValueError(f"a clip needs at least one frame, got {frames}")
    check_window(window, overlap, temporal_factor)
    check_stitch(stitch)
    if frames <= window:
        return WindowPlan(frames, window, overlap, (Window(0, 0, frames, window_seed(seed, 0)),), stitch)
    # As few windows as keep every overlap >= ``overlap``, spread evenly; the starts on multiples of ``align``.
    align = temporal_factor if stitch == "latent" else 1
    span = -(-(frames - window) // align)  # the distance the window start travels, in units of ``align``
    most = (window - overlap) // align  # the longest step between starts that keeps the overlap
    if most < 1:
        raise ValueError(f"the {stitch} stitch starts windows on multiples of {align} frames: an overlap of "
                         f"{overlap} leaves no room in a window of {window} (at most {window - align})")
    steps = -(-span // most)  # ceil
    starts = [align * ((i * span + steps // 2) // steps) for i in range(steps + 1)]
    wins = tuple(Window(i, s, min(s + window, frames), window_seed(seed, i)) for i, s in enumerate(starts))
    return WindowPlan(frames, window, overlap, wins, stitch)


def ramp_down(length: int) -> torch.Tensor:
    """Raised-cosine weights of the earlier window over an overlap of ``length`` frames (fp64)."""
    k = torch.arange(length, dtype=torch.float64)
    return 0.5 + 0.5 * torch.cos(math.pi * (k + 0.5) / length)


def hann(length: int) -> torch.Tensor:
    """A Hann window over ``length`` frames sampled at frame centres (fp64; never zero)."""
    k = torch.arange(length, dtype=torch.float64)
    return torch.sin(math.pi * (k + 0.5) / length) ** 2


def blend_weights(spans: Sequence[tuple[int, int]], total: int, shape: str = "cosine") -> list[torch.Tensor]:
    """Normalised weights (fp64, one per frame of each span) of consecutive spans ``[start, stop)`` that cover
    ``[0, total)`` in order: ``shape`` ``cosine`` fades over each overlap, ``hann`` weighs each span by a Hann
    window over its length; either way each frame's weights sum to one. Pixel windows and the latent
    stitch's latent frames both use it."""
    key = (tuple(spans), total, shape)
    got = _CACHE.get(key)
    if got is not None:
        return got
    raw = []
    for i, (a, b) in enumerate(spans):
        if shape == "hann":
            raw.append(hann(b - a))
            continue
        wt = torch.ones(b - a, dtype=torch.float64)
        if i > 0:  # fade in over the frames shared with the previous span
            n = max(0, spans[i - 1][1] - a)
            if n:
                wt[:n] *= 1.0 - ramp_down(n)
        if i + 1 < len(spans):  # fade out over the frames shared with the next span
            n = max(0, b - spans[i + 1][0])
            if n:
                wt[b - a - n:] *= ramp_down(n)
        raw.append(wt)
    cover = torch.zeros(total, dtype=torch.float64)
    for (a, b), wt in zip(spans, raw):
        cover[a:b] += wt
    out = [wt / cover[a:b] for (a, b), wt in zip(spans, raw)]
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = out
    return out


_CACHE: dict[tuple, list[torch.Tensor]] = {}


def _normalised_weights(plan: WindowPlan) -> list[torch.Tensor]:
    """The pixel weights of ``plan``'s windows (the latent stitch's pixels: the raised cosine's, for reference)."""
    shape = plan.stitch if plan.stitch in PIXEL_STITCHES else "cosine"
    return blend_weights([(w.start, w.stop) for w in plan.windows], plan.frames, shape)


def frame_weights(plan: WindowPlan) -> torch.Tensor:
    """``(len(plan), frames)`` matrix of each window's weight on each clip frame (zeros outside)."""
    m = torch.zeros(len(plan), plan.frames, dtype=torch.float64)
    for w, wt in zip(plan.windows, _normalised_weights(plan)):
        m[w.index, w.start : w.stop] = wt
    return m


class StreamingBlender:
    """Cross-fade restored windows into a stream of finished frames.

    ``push(i, frames)`` takes window ``i``'s output (frames on dim 0, exactly
    ``plan[i].length`` of them, any trailing shape) in window order and
    returns the clip frames that are now final, in order, as one tensor
    (possibly empty). Only the frames shared with the next window are kept
    between calls, accumulated in float32. Frames are returned in
    ``out_dtype`` (default: the dtype pushed); integer dtypes are rounded and
    clamped to the dtype's range.
    """

    def __init__(self, plan: WindowPlan, out_dtype: torch.dtype | None = None):
        if plan.stitch not in PIXEL_STITCHES:
            raise ValueError(f"the {plan.stitch} stitch does not fade pixels: its latents are blended "
                             f"(latent_stitch.LatentStitch)")
        self.plan = plan
        self.out_dtype = out_dtype
        self._weights = _normalised_weights(plan)
        self._next = 0  # next window expected
        self._emitted = 0  # frames returned so far
        self._acc: torch.Tensor | None = None  # frames [self._emitted, self._emitted + len) pending

    @property
    def done(self) -> bool:
        return self._next == len(self.plan)

    @property
    def emitted(self) -> int:
        return self._emitted

    @property
    def held_frames(self) -> int:
        return 0 if self._acc is None else self._acc.shape[0]

    def push(self, index: int, frames: torch.Tensor) -> torch.Tensor:
        if index != self._next:
            raise ValueError(f"windows must be pushed in order: expected window {self._next}, got {index}")
        w = self.plan[index]
        if frames.shape[0] != w.length:
            raise ValueError(f"window {index} covers {w.length} frames, got {frames.shape[0]}")
        out_dtype = self.out_dtype or frames.dtype
        wt = self._weights[index].to(torch.float32).reshape(-1, *([1] * (frames.ndim - 1)))
        contrib = frames.to(torch.float32) * wt.to(frames.device)
        # The pending accumulator always starts at self._emitted, which is <= w.start.
        held = self.held_frames
        offset = w.start - self._emitted
        if offset < 0 or offset > held:
            raise RuntimeError("window plan is not contiguous")  # cannot happen with plan_windows
        need = offset + w.length
        acc = torch.zeros((need, *frames.shape[1:]), dtype=torch.float32, device=frames.device)
        if self._acc is not None and held:
            acc[:held] += self._acc
        acc[offset:need] += contrib
        self._next += 1
        # Frames before the next window's start are final.
        final_upto = self.plan[self._next].start if self._next < len(self.plan) else self.plan.frames
        n_final = final_upto - self._emitted
        ready, rest = acc[:n_final], acc[n_final:]
        self._acc = rest.clone() if rest.shape[0] else None
        self._emitted += n_final
        return _cast(ready, out_dtype)

    def flush(self) -> torch.Tensor | None:
        """Check that every window arrived (raises otherwise); nothing is ever left over."""
        if not self.done:
            raise RuntimeError(f"only {self._next} of {len(self.plan)} windows were pushed")
        return None


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return x.round().clamp(info.min, info.max).to(dtype)


def blend_windows(plan: WindowPlan, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """All windows at once (convenience for tests and short clips)."""
    b = StreamingBlender(plan)
    parts = [b.push(i, o) for i, o in enumerate(outputs)]
    b.flush()
    return torch.cat(parts)
