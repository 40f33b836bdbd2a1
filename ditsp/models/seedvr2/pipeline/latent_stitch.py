"""The latent stitch: consecutive windows blended as latents, the clip decoded once as one causal stream.

A pixel stitch decodes every window on its own and fades the decoded frames
where windows overlap: the decoder starts cold at every window (its causal
convolutions see copies of the window's first frame as their past) and the
shared frames are decoded twice. Here the windows' latents are placed on the
clip's one latent timeline instead:

* with a VAE time factor ``k`` a window starting at clip frame ``s`` (a multiple
  of ``k``: the plan aligns the starts, :func:`.windows.plan_windows`) holds
  latent frames ``s / k, s / k + 1, ...`` of the timeline. With ``k > 1`` a
  window's first latent frame encodes its first pixel frame alone while the
  timeline's frame there stands for ``k`` pixel frames, so every window but the
  first leaves it out (the previous window covers it);
* where two windows place latent frames on the same timeline frames, they are
  blended with the raised cosine of :func:`.windows.blend_weights` over those
  latent frames;
* the timeline frames no later window touches are final: they go to one
  continuous causal decode (``decode``), which carries each causal conv's last
  frames from one call to the next, so the result is the decode of the whole
  blended timeline at once, whatever the windows and the SP degree.

Timeline frame 0 decodes to clip frame 0, frame ``g > 0`` to clip frames
``k (g - 1) + 1 .. k g``; frames past the clip's end (the last window's padding)
are the caller's to drop.

Every step is elementwise on the latent's frames, so a rank holding a height slab
of every window's latent stitches its slab the same way (the SP degree changes
nothing). :meth:`LatentStitch.window` changes the stitch's state only once its
decode returned, so a window that failed (e.g. out of memory) can be run again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .padding import padded_length
from .windows import WindowPlan, blend_weights

# decode(latents (B, C, t, rows, w) float32, first timeline frame, carry, whether they end the timeline)
#   -> (pixels (B, 3, T, ...), new carry)
Decode = Callable[[torch.Tensor, int, Any, bool], tuple[torch.Tensor, Any]]


def pixel_range(first: int, stop: int, temporal_factor: int) -> tuple[int, int]:
    """Clip frames ``[a, b)`` that timeline latent frames ``[first, stop)`` decode to."""
    k = temporal_factor
    a = 0 if first == 0 else k * (first - 1) + 1
    return a, (0 if stop == 0 else k * (stop - 1) + 1)


class LatentStitch:
    """Windows' latents in, final latent frames decoded in order (see the module doc).

    ``plan``: the clip's windows (their starts multiples of ``temporal_factor`` when there are several).
    """

    def __init__(self, plan: WindowPlan, temporal_factor: int):
        k = self.k = temporal_factor
        self.plan = plan
        self.placed = []  # per window: (local latent frames skipped, first timeline frame, latent frames)
        for w in plan.windows:
            if w.start % k:
                raise ValueError(f"window {w.index} starts at frame {w.start}, not a multiple of the VAE's time "
                                 f"factor {k}: the latent stitch needs aligned windows")
            t = (padded_length(w.length, k) - 1) // k + 1
            skip = 1 if w.index > 0 and k > 1 else 0
            self.placed.append((skip, w.start // k + skip, t))
        self.frames = max(g + t - skip for skip, g, t in self.placed)  # timeline latent frames
        self._weights = blend_weights([(g, g + t - skip) for skip, g, t in self.placed], self.frames, "cosine")
        self._next = 0  # the next window expected
        self._emitted = 0  # timeline frames decoded so far
        self._acc: torch.Tensor | None = None  # timeline frames [self._emitted, ...) blended so far (float32)
        self.carry: Any = None  # the decoder's causal state after frame self._emitted - 1

    @property
    def done(self) -> bool:
        return self._next == len(self.plan)

    def window(self, index: int, z: torch.Tensor, decode: Decode) -> tuple[torch.Tensor, int]:
        """Blend window ``index``'s latent ``z`` (B, C, t, ...) in and decode the frames now final.

        Returns (the decoded pixels, the clip frame of their first). Every window hands out at least one
        frame: the next window starts later on the timeline.
        """
        if index != self._next:
            raise ValueError(f"windows must be stitched in order: expected window {self._next}, got {index}")
        skip, g0, t = self.placed[index]
        if z.shape[2] != t:
            raise ValueError(f"window {index} has {t} latent frames, got {z.shape[2]}")
        wt = self._weights[index].to(torch.float32).reshape(1, 1, -1, *([1] * (z.dim() - 3))).to(z.device)
        part = z[:, :, skip:].to(torch.float32) * wt
        held = 0 if self._acc is None else self._acc.shape[2]
        offset = g0 - self._emitted
        if offset < 0 or offset > held:
            raise RuntimeError("the windows' latents are not contiguous on the timeline")
        acc = part.new_zeros((*part.shape[:2], max(held, offset + part.shape[2]), *part.shape[3:]))
        if held:
            acc[:, :, :held] += self._acc
        acc[:, :, offset:offset + part.shape[2]] += part
        final = self.placed[index + 1][1] if index + 1 < len(self.placed) else self.frames
        n = final - self._emitted
        if n <= 0:
            raise RuntimeError("the window plan hands no latent frame out")  # cannot happen with plan_windows
        first = pixel_range(self._emitted, final, self.k)[0]
        pixels, carry = decode(acc[:, :, :n], self._emitted, self.carry, final == self.frames)
        # commit: only now that the decode returned
        self._acc = acc[:, :, n:].clone() if acc.shape[2] > n else None
        self._emitted = final
        self.carry = carry
        self._next += 1
        return pixels, first
