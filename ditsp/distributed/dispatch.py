"""Run a rank function on the ranks a job asks for, wherever they are: the one launch every job goes through.

Inside a torchrun job this process is one of the ranks; for one rank the
function runs in this process (no group, no spawn); otherwise on a
:class:`~ditsp.distributed.launcher.LocalCluster` of local ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from .launcher import LocalCluster, RankContext, init_from_env
from .torchrun import under_torchrun


def dispatch(fn: Callable, *args, sp: int, threads: int = 1, timeout_s: float = 3600.0,
             cluster: LocalCluster | None = None, fork: bool = False) -> list:
    """Run ``fn(ctx, *args)`` on ``sp`` ranks; returns every rank's result (rank order).

    Inside a torchrun job this process is one rank and returns its own result
    only; ``sp == 1`` runs in this process; otherwise on ``cluster`` or on a
    LocalCluster started (and closed) for this call, its ranks forked from this
    process where ``fork`` asks and it is safe (``launcher.fork_is_safe``): a
    command's fresh process, whose imports the ranks then need not repeat.
    """
    if under_torchrun():
        ctx = init_from_env()
        if ctx.world_size != sp:
            raise ValueError(f"--sp {sp} but torchrun started {ctx.world_size} ranks")
        return [fn(ctx, *args)]
    if sp == 1:
        torch.set_num_threads(threads)
        return [fn(RankContext(0, 1, None, torch.device("cpu")), *args)]
    if cluster is not None:
        return cluster.run(fn, *args, timeout_s=timeout_s)
    with LocalCluster(sp, timeout_s=timeout_s, threads=threads, fork=fork) as own:
        return own.run(fn, *args, timeout_s=timeout_s)
