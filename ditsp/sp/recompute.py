"""Activation checkpointing of one layer under an SP runtime.

``torch.utils.checkpoint`` (non-reentrant) drops the layer's activations and
recomputes them in the backward. The recomputation runs outside the model's
forward, so it must see what the forward saw: the kernel-shape policy (a
context variable, re-entered here) and the runtime's current layout (a Plan B
runtime attends by it; restored here). Collectives inside the layer (the text
reduction, Plan B's halo exchanges) run again in the recomputation, in the
same order on every rank: the engine runs nodes in reverse creation order and
each collective node saves a tensor, so the recomputation is triggered before
the layer's own backward collectives on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ..fixed_shape import current, use


def checkpointed(fn: Callable, runtime, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its activations recomputed in the backward."""
    shapes, layout = current(), getattr(runtime, "current", None)

    def run(*a):
        if hasattr(runtime, "current"):
            runtime.current = layout
        with use(shapes):
            return fn(*a, **kwargs)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)
