"""One training step's gradients under SP against one device (``ditsp train --check`` and the tests).

The loss is a fixed seeded projection of the whole output (``sum(out * w)``),
computed identically on every rank; every parameter's and both inputs'
gradients are summed over the group in rank order
(:func:`ditsp.distributed.autograd.reduce_gradients`) and compared with the
one-device step's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ParallelConfig
from ..dtypes import DTYPES
from ..distributed.autograd import reduce_gradients
from ..distributed.comm import Comm
from ..fixed_shape import DEFAULT_DETERMINISTIC
from ..models.seedvr2.nadit.model import build_model, random_inputs
from ..models.seedvr2.parallelize import parallelize


@dataclass(frozen=True)
class GradSpec:
    model: str = "tiny"
    grid: tuple = (2, 4, 7)
    dtype: str = "fp32"
    path: str = "window"
    planner: str = "lpt"
    deterministic: bool = DEFAULT_DETERMINISTIC
    checkpoint: bool = False
    layers: int | None = None
    seed: int = 0


def model_grads(spec: GradSpec, group=None) -> dict[str, torch.Tensor]:
    """Name -> gradient (fp32 copies) of one forward+backward of ``spec`` on ``group`` (None: one device);
    inputs' gradients under ``input.vid`` and ``input.txt``."""
    dtype = DTYPES[spec.dtype]
    model = build_model(spec.model, spec.layers, seed=spec.seed, dtype=dtype).requires_grad_(True)
    model.checkpoint_blocks = spec.checkpoint
    vid, txt = random_inputs(model.cfg, spec.grid, seed=spec.seed + 1)
    vid, txt = vid.to(dtype).requires_grad_(True), txt.to(dtype).requires_grad_(True)
    world = 1 if group is None else torch.distributed.get_world_size(group)
    pc = ParallelConfig.window(world, window_planner=spec.planner if spec.path == "window" else None,
                               window_path=spec.path, deterministic=spec.deterministic)
    rt = parallelize(model.cfg, pc, spec.grid, group)
    out = model(vid, txt, 1000.0, runtime=rt)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(spec.seed + 2)).to(out.dtype)
    (out * w).float().sum().backward()
    comm = rt.comm if world > 1 else Comm.single()
    named = dict(model.named_parameters())
    reduce_gradients(comm, list(named.values()) + [vid, txt])
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).float().clone() for n, p in named.items()}
    grads["input.vid"], grads["input.txt"] = vid.grad.float().clone(), txt.grad.float().clone()
    return grads


def rank_grads(ctx, specs):
    """Rank function: every spec's gradients on the context's group."""
    return [model_grads(s, ctx.group) for s in specs]


def max_difference(a: dict, b: dict) -> tuple[float, float, str]:
    """(max |a - b| over all gradients, that tensor's max |b|, its name)."""
    worst = (0.0, 0.0, "")
    for name, ref in b.items():
        d = (a[name] - ref).abs().max().item() if ref.numel() else 0.0
        if d >= worst[0]:
            worst = (d, ref.abs().max().item() if ref.numel() else 0.0, name)
    return worst
