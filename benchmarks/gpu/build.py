"""Models of the GPU check, built on the device they run on, and the arithmetic of a NaDiT forward."""

from __future__ import annotations

import numpy as np
import torch

from ditsp.dtypes import DTYPES
from ditsp.models.meta import meta_device
from ditsp.models.seedvr2.job.sizing import request_grid
from ditsp.models.seedvr2.nadit.config import get_config
from ditsp.models.seedvr2.nadit.model import NaDiT, init_random_, random_inputs
from ditsp.sp.choice import _attn_flops, _token_flops
from ditsp.windows.schedule import plan_schedule


def dit(preset: str, device: torch.device, dtype: str = "bf16", layers: int | None = None, seed: int = 0) -> NaDiT:
    """A NaDiT at ``preset``'s widths with seeded weights drawn on ``device`` (no host copy of its weights):
    the structure on the meta device, storage on ``device``, :func:`init_random_` there, then the dtype."""
    cfg = get_config(preset, layers)
    with meta_device():
        model = NaDiT(cfg)
    model.to_empty(device=device)
    init_random_(model, seed)
    return model.to(DTYPES[dtype]).eval().requires_grad_(False)


def grid_of(size) -> tuple[int, int, int]:
    """The DiT's token grid of a (width, height, frames) request."""
    return request_grid(*size).grid


def inputs(cfg, size, device: torch.device, seed: int = 0):
    """(grid, latent (T, H, W, 33), text) of a (width, height, frames) request, on ``device``."""
    grid = grid_of(size)
    vid, txt = random_inputs(cfg, grid, seed)
    return grid, vid.to(device), txt.to(device)


def forward_flops(cfg, grid) -> float:
    """FLOPs of one forward: every token's (video and text) linears in every layer, plus window attention
    over [window, text] in every layer (the same arithmetic as the SP path choice's cost model)."""
    schedule = plan_schedule(grid, cfg.window_methods, 1, "lpt", cfg.num_windows)
    tokens, inner, L = int(np.prod(grid)), cfg.heads * cfg.head_dim, cfg.txt_len
    total = 0.0
    for method in schedule.layer_methods:
        total += (tokens + L) * _token_flops(cfg) + _attn_flops(schedule.plans[method].layout.token_counts, L, inner)
    return total
