"""The VAE's execution modes, each with what it promises and what it needs: the one table every list derives from.

``auto`` has one meaning everywhere (:func:`.memory.choose_mode`): the first
exact mode in ``AUTO_ORDER`` whose modelled per-rank peak, over encode and
decode, fits the budget; ``tiled`` (approximate) only when none does. Every
exact mode gives bitwise the one-device result at every SP degree on CPU
(tests/test_vae_sharded.py), so whichever fits keeps a restoration identical
at every degree; the sharded ones come first because they split the work and
the memory across the group.

On one device a mode that splits across ranks (``splits``) splits nothing: a
height slab is the whole frame, run through the slab machinery. ``auto`` skips
those there, so one device takes ``chunked``, the leanest whole-frame mode,
which was also the quickest measured (small restorer, fp32, 9-33 frames at
256x256-384x384, one core: decode 0.68-0.93x the time of one whole slab and
0.76-0.96x that of ``replicated``; encode 0.80-0.91x and 0.95-1.01x).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True)
class VaeMode:
    name: str
    exact: bool  # bitwise the one-device result at every SP degree
    slab: bool = False  # height-sharded: each rank holds a slab of rows (handed straight to the DiT's windows)
    chunked: bool = False  # causal chunks of ``chunk`` latent frames
    splits: bool = False  # divides the clip across ranks (one device: the whole clip through the split machinery)
    min_latent_frames: int = 1  # auto skips the mode for shorter clips (a time split needs two latent frames)
    auto_rank: int | None = None  # place in auto's preference order; None: only when no exact mode fits


TABLE = (
    VaeMode("replicated", exact=True, auto_rank=3),
    VaeMode("chunked", exact=True, chunked=True, auto_rank=2),
    VaeMode("time", exact=True, splits=True, min_latent_frames=2, auto_rank=4),
    VaeMode("height", exact=True, slab=True, splits=True, auto_rank=0),
    VaeMode("height+chunks", exact=True, slab=True, splits=True, chunked=True, auto_rank=1),
    VaeMode("tiled", exact=False),
)
BY_NAME = {m.name: m for m in TABLE}
MODES = tuple(m.name for m in TABLE)
EXACT_MODES = tuple(m.name for m in TABLE if m.exact)
SLAB_MODES = tuple(m.name for m in TABLE if m.slab)
CHUNKED_MODES = tuple(m.name for m in TABLE if m.chunked)
AUTO_ORDER = tuple(m.name for m in sorted((m for m in TABLE if m.auto_rank is not None), key=lambda m: m.auto_rank))
FALLBACK = tuple(m.name for m in TABLE if m.auto_rank is None)
CHOICES = (AUTO,) + MODES  # what a front door offers


def check(mode: str) -> str:
    if mode != AUTO and mode not in BY_NAME:
        raise ValueError(f"unknown VAE mode {mode!r}; choose one of {', '.join(CHOICES)}")
    return mode
