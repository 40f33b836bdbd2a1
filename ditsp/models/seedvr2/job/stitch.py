"""How a restored window's latent becomes clip frames under the plan's stitch (``pipeline/windows.STITCHES``).

The pixel stitches (``cosine``, ``hann``) decode every window on its own: its
frames start at the window's first, and the blender fades them into the
neighbours'. The latent stitch blends the window's latent into the clip's latent
timeline (:class:`..pipeline.latent_stitch.LatentStitch`) and decodes the frames
that became final, continuing one causal decode (``ParallelVAE.decode_continued``):
its frames start where the previous window's ended, and nothing is faded.

On one device, or with whole latents on every rank, a slab mode's continued
decode runs as ``chunked`` (exact, the same bits; on one device a slab is the whole
frame anyway); handed-off slabs continue as slabs.
"""

from __future__ import annotations

import torch

from ..pipeline.latent_stitch import LatentStitch
from ..pipeline.windows import WindowPlan
from ..vae.layouts import SlabLayout
from ..vae.modes import SLAB_MODES
from ..vae.sharded import ParallelVAE


class WindowDecoder:
    """Every rank's decode of each window, in window order (one per job)."""

    def __init__(self, pvae: ParallelVAE, windows: WindowPlan):
        self.pvae = pvae
        self.latent = LatentStitch(windows, pvae.cfg.temporal_factor) if windows.stitch == "latent" else None

    def whole(self, win, z: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the decoded video (1, 3, T, H, W), the clip frame of its first) from the window's whole latent."""
        if self.latent is None:
            return self.pvae.decode(z, win.vae_mode), win.start
        mode = "chunked" if win.vae_mode in SLAB_MODES else win.vae_mode
        return self.latent.window(win.index, z, lambda lat, g, carry, last: self.pvae.decode_continued(
            lat, g, carry, mode, last=last))

    def slab(self, win, z: torch.Tensor, layout: SlabLayout) -> tuple[torch.Tensor, int]:
        """(this rank's decoded pixel rows, the clip frame of their first) from its latent slab of ``layout``."""
        if self.latent is None:
            return self.pvae.decode_slab(z, layout, chunked=win.vae_mode == "height+chunks", gather=False), win.start
        return self.latent.window(win.index, z, lambda lat, g, carry, last: self.pvae.decode_continued(
            lat, g, carry, win.vae_mode, layout, last=last))
