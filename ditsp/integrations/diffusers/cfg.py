"""Classifier-free guidance parallel: the conditional and unconditional passes at once on two halves.

A model parallelized with ``ParallelConfig(cfg_degree=2, ...)`` lives on two
SP groups of ``sp_degree`` ranks each. :func:`cfg_forward` runs the
conditional inputs on the first half and the unconditional ones on the
second (SP inside each half), then rank j of each half swaps its full output
with rank j of the other (one all-gather of two), so every rank returns both.
With ``cfg_degree=1`` it runs the two passes one after the other. Inference
only: no gradients flow through the swap.
"""

from __future__ import annotations

import torch

from .parallelize import runtime_of


def _run(model, kwargs: dict) -> torch.Tensor:
    out = model(**kwargs, return_dict=False)
    return out[0] if isinstance(out, (tuple, list)) else out


def cfg_forward(model, cond: dict, uncond: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model(**cond), model(**uncond))`` full on every rank; each half computes one (``cfg_degree=2``)."""
    rt = runtime_of(model)
    if rt.cfg is None:
        return _run(model, cond), _run(model, uncond)
    with torch.no_grad():
        mine = _run(model, uncond if rt.cfg_half else cond)
        parts = rt.cfg.all_gather_rows(mine.unsqueeze(0).contiguous(), [1, 1], kind="cfg_exchange")
    return parts[0][0], parts[1][0]


def guided(model, cond: dict, uncond: dict, scale: float) -> torch.Tensor:
    """The guided prediction ``uncond + scale * (cond - uncond)``, the same on every rank."""
    c, u = cfg_forward(model, cond, uncond)
    return u + scale * (c - u)
