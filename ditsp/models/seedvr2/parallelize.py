"""Apply SP to a SeedVR2 NaDiT from outside the model: pick and build its runtime.

The model code never decides how it is parallelised. For one request (its
post-patch grid) and an SP group, :func:`parallelize` checks the parallel
configuration against what SeedVR2 can run (window attention only: no ring,
no uneven-head Ulysses, no permuted transport) and returns the runtime the
model's forward takes (:func:`single_runtime`: the one for one device):

Everything comes from the :class:`~ditsp.config.ParallelConfig` (one route per setting):
``window_path`` picks the runtime and ``window_planner`` Plan A's planner.

- ``path="window"``: window-aligned SP (Plan A), planner from the config;
- ``path="ulysses"``: the Ulysses baseline (contiguous token shards, heads
  moved around window attention), for comparison;
- ``path="halo"``: halo-slab Plan B (fixed slabs, halo Q/K/V lent to attention);
- ``path="auto"``: the cheapest of Plan A (LPT, locality), Plan B and Ulysses by
  :func:`ditsp.sp.choice.choose`, the same on every rank; its report names the
  choice and the runner-up. This is the default (``window_path="auto"``); a
  named ``window_planner`` under ``auto`` means Plan A with that planner.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...config import ParallelConfig, ParallelConfigError
from ...distributed.comm import Comm
from ...distributed.agree import agree
from ...distributed.transport import TransportSettings
from ...fixed_shape import DEFAULT_DETERMINISTIC, shapes_for
from ...sp import SPRuntime, UlyssesWindowRuntime, WindowRuntime
from .nadit.config import NaDiTConfig
from ...sp.halo_slab import HaloSlabRuntime
from ...sp.choice import ChosenRuntime, Link, choose, split_path
from ...windows.capacity import Shares

PATHS = ("window", "ulysses", "halo", "auto")


def parallelize(cfg: NaDiTConfig, parallel_config: ParallelConfig | None, grid: Sequence[int],
                group=None, shares: Shares | None = None) -> SPRuntime:
    """The SP runtime of one request of model ``cfg`` on SP group ``group`` (None: one rank; a
    :class:`~ditsp.distributed.comm.Comm`: that Comm itself, so a job's collectives count in one place).

    ``shares``: the ranks' speeds and token caps where they differ (:mod:`ditsp.windows.capacity`): Plan A
    balances modelled time under the caps, Plan B cuts its slabs in proportion to speed, ``auto`` chooses
    among the paths that can (the Ulysses baseline splits evenly and refuses them).

    ``group``'s size must equal the configured SP degree. Text sums are
    reduced in fp64 whatever the model dtype, so their value does not depend
    on which rank holds which window.
    """
    pc = parallel_config or ParallelConfig()
    comm = Comm.of(group)
    world = comm.world_size
    pc.validate("seedvr2", pc.sp_degree)  # the SeedVR2 rejections first, whatever the group
    if pc.sp_degree != world:
        raise ParallelConfigError(
            f"window-aligned SP degree {pc.sp_degree} needs an SP group of {pc.sp_degree} ranks, got {world}")
    path, planner = pc.window_path, pc.window_planner
    if path == "auto" and planner:
        path = "window"  # a named planner means Plan A with it
    if path not in PATHS:
        raise ValueError(f"unknown SP path {path!r}; choose from {', '.join(PATHS)}")
    a2a = TransportSettings.resolve(pc)  # the policy of the runtime's all-to-alls (carried by the runtime)
    shares = None if shares is None or shares.even else shares
    if shares is not None and shares.world_size != world:
        raise ValueError(f"capacities of {shares.world_size} ranks for an SP group of {world}")
    rt = _auto(cfg, grid, comm, a2a, shares) if path == "auto" else \
        _build(path, cfg, grid, comm, planner or "lpt", a2a, shares)
    rt.kernel_shapes = shapes_for(pc.deterministic)
    if world > 1:
        agree(comm, "the kernel-shape policy (deterministic)", {"deterministic": pc.deterministic})
    return rt


def single_runtime(cfg: NaDiTConfig, grid: Sequence[int], planner: str = "lpt",
                   deterministic: bool = DEFAULT_DETERMINISTIC) -> SPRuntime:
    """The one-device runtime of a request: the single-device forward runs the runtime SP builds, on one rank
    (Plan A with ``planner``), so one device and SP share every line of the model's forward."""
    return parallelize(cfg, ParallelConfig(window_planner=planner, deterministic=deterministic), grid)


def _build(path: str, cfg: NaDiTConfig, grid: Sequence[int], comm: Comm, planner: str | None,
           a2a: TransportSettings, shares: Shares | None = None) -> SPRuntime:
    if path == "window":
        return WindowRuntime(grid, cfg.window_methods, comm, planner, cfg.num_windows, torch.float64, a2a,
                             shares=shares)
    if path == "ulysses":
        if shares is not None:
            raise ParallelConfigError("the Ulysses baseline splits rows and heads evenly; ranks of unequal "
                                      "capacity need the window or halo path")
        return UlyssesWindowRuntime(grid, cfg.window_methods, cfg.heads, comm, cfg.num_windows, torch.float64,
                                    a2a)

    return HaloSlabRuntime(grid, cfg.window_methods, comm, cfg.num_windows, torch.float64, transport=a2a,
                           shares=shares)


def _auto(cfg: NaDiTConfig, grid: Sequence[int], comm: Comm, a2a: TransportSettings,
          shares: Shares | None = None) -> SPRuntime:
    """The cost model's cheapest path, checked to be the same on every rank, then built."""

    link = Link.load()
    choice = choose(cfg, grid, comm.world_size, link, shares=shares)
    agree(comm, "the auto SP path (choice, runner-up, link)",
          {"choice": [c.path for c in choice.costs[:2]], "link": link.as_dict()})
    base, planner = split_path(choice.best.path)
    rt = _build(base, cfg, grid, comm, planner, a2a, shares)
    return ChosenRuntime(rt, choice)
