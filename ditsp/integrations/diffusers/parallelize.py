"""``parallelize(model, config, group)``: a diffusers transformer under ditsp sequence parallelism, in place.

After it, the model's own ``forward`` takes the full inputs on every rank of
the SP group and returns the full output on every rank: the sequence is
sharded after patch embedding (plus RoPE tables and per-token timesteps),
self-attention runs the strategy ``config`` names (Ulysses, Ring, USP,
AllGather-KV; uneven heads with ``advanced_uaa``), cross-attention to
replicated text stays local, and the output projection is gathered.

With ``config.cfg_degree == 2`` the group holds two SP groups (the two
classifier-free guidance passes): ``forward`` runs one pass on the half it is
called on; :func:`ditsp.integrations.diffusers.cfg.cfg_forward` runs both at
once and exchanges them.

Gradients: parameters end with per-rank partial gradients whose sum over
the SP group is the single-device gradient (:func:`reduce_gradients` sums
them); see :mod:`ditsp.attention.sequence` for the convention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...attention.usp import SPAttention
from ...config import ParallelConfig
from ...distributed.comm import Comm
from ...distributed.groups import build_sp_groups
from .hooks import ParallelizeError, Runtime, install
from .plans import PLANS


def _plan(model):
    name = type(model).__name__
    for cls in type(model).__mro__:
        if cls.__name__ in PLANS:
            return PLANS[cls.__name__]
    raise ParallelizeError(f"cannot parallelize {name}: ditsp supports {', '.join(sorted(PLANS))}")


def _heads(model) -> int | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "num_attention_heads", None) if cfg is not None else None


def _attention(config: ParallelConfig, group, heads, backend):
    """(SP Comm, attention strategy, CFG Comm or None, CFG half) over ``group`` (None: the default group,
    or one device). With ``cfg_degree=2`` the group's first ``sp_degree`` ranks run the conditional pass
    and the rest the unconditional one; rank j of one half exchanges outputs with rank j of the other."""
    need = config.sp_degree * config.cfg_degree
    if not dist.is_initialized():
        if need != 1:
            raise ParallelizeError(f"{need} ranks (SP {config.sp_degree} x CFG {config.cfg_degree}) need "
                                   "torch.distributed initialised")
        return Comm.single(), SPAttention(backend=backend, name="single"), None, 0, None
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    if len(ranks) != need:
        raise ParallelizeError(f"the group has {len(ranks)} ranks but the config asks for {need} (ulysses "
                               f"{config.ulysses_degree} x ring {config.ring_degree} x cfg {config.cfg_degree})")
    config.validate("global", len(ranks), heads)
    groups = build_sp_groups(config, parent)  # one SP group per CFG half (every rank creates all of them)
    cfg, half = None, 0
    if config.cfg_degree > 1:
        sp, me = config.sp_degree, dist.get_rank()
        for j in range(sp):
            pair = [ranks[j], ranks[j + sp]]
            g = dist.new_group(pair)
            if me in pair:
                cfg, half = Comm.of(g), pair.index(me)
    return Comm.of(groups.sp), SPAttention.from_config(config, groups, backend), cfg, half, groups.sp


def parallelize(model: torch.nn.Module, config: ParallelConfig, group=None, backend: str | None = None,
                sparse=None):
    """Put ``model`` (a diffusers transformer) under SP on ``group`` (every rank calls this); returns ``model``.

    Every rank of the default process group must call it (SP sub-groups are created collectively).
    ``backend`` requests an attention kernel (see ``ditsp.attention.kernels``). ``sparse``: a
    :class:`ditsp.attention.sparse.SparseConfig` runs self-attention as adaptive block-sparse attention
    with head-migration balancing instead (Ulysses only, inference only; families whose plan knows its
    token grid: Wan). Raises
    :class:`ParallelizeError` with one line naming the model or module it cannot parallelize.
    """
    if getattr(model, "_ditsp_runtime", None) is not None:
        raise ParallelizeError(f"{type(model).__name__} is already parallelized by ditsp")
    if getattr(model, "_parallel_config", None) is not None:
        raise ParallelizeError(f"{type(model).__name__} already runs diffusers' own context parallelism "
                               "(enable_parallelism); use one or the other")
    plan = _plan(model)
    if not isinstance(config, ParallelConfig):
        raise ParallelizeError(f"config must be a ditsp ParallelConfig, got {type(config).__name__}")
    if sparse is not None:
        if plan.grid is None:
            raise ParallelizeError(f"sparse attention for {plan.family}: its plan does not know the token grid "
                                   "(supported: " + ", ".join(sorted(p.family for p in PLANS.values() if p.grid)) + ")")
        if config.ring_degree != 1:
            raise ParallelizeError("sparse attention runs under Ulysses only: use ring_degree=1")
    comm, attention, cfg, half, sp_group = _attention(config, group, _heads(model), backend)
    runtime = Runtime(comm, attention, config)
    runtime.cfg, runtime.cfg_half = cfg, half
    if sparse is not None:
        runtime.sparse = (sp_group, sparse)
    runtime.handles = install(model, plan, runtime)
    model._ditsp_runtime = runtime
    return model


def runtime_of(model) -> Runtime:
    rt = getattr(model, "_ditsp_runtime", None)
    if rt is None:
        raise ParallelizeError(f"{type(model).__name__} is not parallelized by ditsp")
    return rt


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sum every parameter gradient over the model's SP group, in place: afterwards each rank holds the
    single-device gradient (one all-reduce per parameter that has one)."""
    rt = runtime_of(model)
    if rt.cfg is not None:
        raise ParallelizeError("reduce_gradients: a CFG-parallel model runs inference only")
    comm = rt.comm
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, kind="grad_all_reduce")
