"""Where a diffusers model's sequence is cut and put back together: plans of hooks, installed from outside.

A :class:`Plan` names submodules of one model class by their path (``""`` is
the model itself) and says, for each, which inputs or outputs to shard along
the token dimension (:class:`Split`) and which output to gather
(:class:`Gather`). Between the first shard and the gather every rank holds
its own contiguous share of the tokens (``ditsp.attention.sequence``); every
tokenwise layer then runs unchanged, and only the self-attention processors
talk to other ranks.

Each forward checks that every required hook fired exactly once: a diffusers
release that changed its forward would otherwise run with some tensors
sharded and others not.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...attention.sequence import gather, shard, splits
from ...attention.sparse import SparseUlysses


class ParallelizeError(ValueError):
    """A model (or one of its modules) that ditsp cannot parallelize, said in one line."""


@dataclass(frozen=True)
class Split:
    """Shard along ``dim``; only tensors with ``ndim`` dimensions when given (e.g. per-token timesteps)."""

    dim: int
    ndim: int | None = None
    required: bool | None = None  # must fire once per forward (default: when ``ndim`` is not given)


@dataclass(frozen=True)
class Gather:
    """Gather this output back to the full sequence along ``dim`` on every rank."""

    dim: int


@dataclass(frozen=True)
class Refuse:
    """An input ditsp does not shard (e.g. ControlNet residuals): given (not None), the forward raises."""

    why: str
    required: bool = False


@dataclass(frozen=True)
class Plan:
    """One model class under SP.

    - ``inputs``: module path -> {parameter name: Split} (a forward pre-hook);
    - ``outputs``: module path -> {output index (None: the output itself): Split or Gather};
    - ``self_attention``: module-path globs whose processor becomes ``processor(runtime, module)``;
    - ``local_attention``: globs of attention modules left as they are (cross-attention to replicated text);
    - ``processor_classes``: the diffusers processor class names the replaced processors must have.
    """

    family: str
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    self_attention: tuple[str, ...] = ()
    local_attention: tuple[str, ...] = ()
    processor: Callable | None = None
    processor_classes: tuple[str, ...] = ()
    check: Callable | None = None  # model -> a one-line reason it cannot be parallelized, or None
    grid: Callable | None = None  # (model, args, kwargs) -> post-patch (T, H, W) of a forward (sparse attention)


class Runtime:
    """The SP state of one parallelized model: its groups, attention strategy and current token split."""

    def __init__(self, comm, attention, config):
        self.comm, self.attention, self.config = comm, attention, config
        self.lens: list[int] | None = None  # every rank's tokens, set by the last token shard
        self.fired: dict[str, int] = {}
        self.cfg, self.cfg_half = None, 0  # CFG-parallel exchange Comm and this rank's pass (0 cond, 1 uncond)
        self.sparse = None  # (SP process group, SparseConfig): sparse attention per forward's grid
        self._sparse_by_grid: dict = {}

    def begin(self, plan: "Plan", model, args, kwargs) -> None:
        """Start a forward: reset the token split; with sparse attention, pick the strategy of this grid."""
        self.fired, self.lens = {}, None
        if self.sparse is not None:
            grid = tuple(plan.grid(model, args, kwargs))
            if grid not in self._sparse_by_grid:
                if len(self._sparse_by_grid) >= 8:
                    self._sparse_by_grid.pop(next(iter(self._sparse_by_grid)))
                self._sparse_by_grid[grid] = SparseUlysses(self.sparse[0], grid, self.sparse[1],
                                                           transport=self.config)
            self.attention = self._sparse_by_grid[grid]

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        lens = splits(x.shape[dim], self.comm)
        if self.lens is not None and self.lens != lens and self.fired:
            raise ParallelizeError(f"token shards of one forward disagree: {self.lens} vs {lens} "
                                   f"(a tensor of {x.shape[dim]} rows along dim {dim})")
        self.lens = lens
        return shard(x, dim, self.comm)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.lens is None:
            raise ParallelizeError("gather before any token shard in this forward")
        return gather(x, dim, self.comm, seq_lens=self.lens)


def _names(module) -> list[str]:
    return [n for n in inspect.signature(module.forward).parameters if n not in ("args", "kwargs")]


def _apply(runtime: Runtime, op, x, key: str):
    if isinstance(op, Refuse):
        if x is not None:
            raise ParallelizeError(f"{key} is not supported under ditsp SP: {op.why}")
        return x
    if isinstance(op, Gather):
        if not isinstance(x, torch.Tensor):
            raise ParallelizeError(f"{key}: expected a tensor to gather, got {type(x).__name__}")
        runtime.fired[key] = runtime.fired.get(key, 0) + 1
        return runtime.gather(x, op.dim)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):  # e.g. (cos, sin)
        runtime.fired[key] = runtime.fired.get(key, 0) + 1
        return type(x)(runtime.shard(t, op.dim) for t in x)
    if not isinstance(x, torch.Tensor) or (op.ndim is not None and x.dim() != op.ndim):
        return x
    runtime.fired[key] = runtime.fired.get(key, 0) + 1
    return runtime.shard(x, op.dim)


def _pre_hook(runtime: Runtime, path: str, specs: dict, names: list[str]):
    def hook(module, args, kwargs):
        args = list(args)
        for name, op in specs.items():
            key = f"{path or '<model>'}:{name}"
            if name in kwargs:
                kwargs[name] = _apply(runtime, op, kwargs[name], key)
            elif name in names and names.index(name) < len(args):
                i = names.index(name)
                args[i] = _apply(runtime, op, args[i], key)
        return tuple(args), kwargs

    return hook


def _post_hook(runtime: Runtime, path: str, specs: dict):
    def hook(module, args, out):
        for index, op in specs.items():
            key = f"{path}:{'output' if index is None else index}"
            if index is None:
                out = _apply(runtime, op, out, key)
            else:
                items = list(out)
                items[index] = _apply(runtime, op, items[index], key)
                out = type(out)(items)
        return out

    return hook


def _required(op) -> bool:
    if isinstance(op, Gather):
        return True
    if op.required is not None:
        return op.required
    return getattr(op, "ndim", None) is None


def required_keys(plan: Plan) -> set[str]:
    keys = {f"{path or '<model>'}:{name}" for path, specs in plan.inputs.items()
            for name, op in specs.items() if _required(op)}
    keys |= {f"{path}:{'output' if i is None else i}" for path, specs in plan.outputs.items()
             for i, op in specs.items() if _required(op)}
    return keys


def matches(path: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


def install(model: torch.nn.Module, plan: Plan, runtime: Runtime) -> list:
    """Check every attention module against ``plan``, then hook the model; returns the hook handles."""
    modules = dict(model.named_modules())
    why = plan.check(model) if plan.check is not None else None
    if why:
        raise ParallelizeError(f"cannot parallelize {plan.family}: {why}")
    for path in list(plan.inputs) + list(plan.outputs):
        if path not in modules:
            raise ParallelizeError(f"{plan.family}: module {path!r} of the plan is missing from this model")
    replaced = []
    for path, m in modules.items():
        if not hasattr(m, "processor") or not hasattr(m, "set_processor"):
            continue
        proc = type(m.processor).__name__
        if matches(path, plan.self_attention):
            if plan.processor_classes and proc not in plan.processor_classes:
                raise ParallelizeError(f"cannot parallelize {path} ({type(m).__name__}): its processor {proc} is "
                                       f"not one ditsp knows for {plan.family} ({', '.join(plan.processor_classes)})")
            replaced.append((path, m))
        elif not matches(path, plan.local_attention):
            raise ParallelizeError(f"cannot parallelize {path} ({type(m).__name__}, processor {proc}): "
                                   f"not an attention module the {plan.family} plan knows")
    if not replaced:
        raise ParallelizeError(f"{plan.family}: no self-attention module matches {list(plan.self_attention)}")
    for path, m in replaced:
        m.set_processor(plan.processor(runtime, m, path))
    handles = []
    required = required_keys(plan)

    def begin(module, args, kwargs):
        runtime.begin(plan, module, args, kwargs)
        return None

    def end(module, args, out):
        missing = sorted(k for k in required if runtime.fired.get(k) != 1)
        if missing:
            raise ParallelizeError(f"{plan.family}: these sequence hooks did not fire exactly once in the forward "
                                   f"(an unsupported diffusers version or code path?): {missing} "
                                   f"(fired: {runtime.fired})")
        return out

    handles.append(model.register_forward_pre_hook(begin, with_kwargs=True))
    for path, specs in plan.inputs.items():
        m = modules[path]
        handles.append(m.register_forward_pre_hook(_pre_hook(runtime, path, specs, _names(m)), with_kwargs=True))
    for path, specs in plan.outputs.items():
        handles.append(modules[path].register_forward_hook(_post_hook(runtime, path, specs)))
    handles.append(model.register_forward_hook(end))
    return handles
