"""``--compile``: torch.compile (inductor) of the DiT blocks and of the VAE's GroupNorm+SiLU, collectives outside.

What is compiled, and where the graphs break:

- **DiT**: every block's forward (both families). The runtime's ``attend`` (window SDPA per window
  shape; Plan B's and Ulysses' collectives) and ``reduce_text`` (one all-reduce) run eagerly: they
  are the only graph breaks (``nadit.blocks.attend`` / ``reduce_text``, disabled for the compiler),
  so each block is three graphs around them. A rank's row count follows the SP degree, the plan
  and the request, and the text length follows the request: both are marked dynamic, so one
  compile per block kind serves every shape family (0 or 1 rows, an empty rank, compile once more).
- **VAE**: each GroupNorm's per-frame normalisation and the SiLU after it, one fused kernel
  instead of two passes (the statistics, their all-gather over height slabs, the halo exchanges
  and the convolutions stay eager: the convolutions are oneDNN calls either way). Frames, rows
  and columns are marked dynamic.

Compiled kernels are not the fixed-shape calls of :mod:`ditsp.fixed_shape`, so a compiled model
refuses the deterministic policy (:func:`check_policy`, at the request and again per forward).
Outputs equal eager within tolerance (``benchmarks/results/speed.md`` has the measured error).

The first forward of a shape family compiles (tens of seconds per block kind on one core); the
compiled code lives with the model object, so a server worker's model cache
(:func:`ditsp.models.seedvr2.weights.load`) keeps it across jobs, and a request that did not ask
for compile runs the same object eagerly (:func:`stance`).

Failure is never silent: if compiling raises (no C++ compiler, an op inductor cannot lower), the
model goes back to eager for good, a one-line warning goes to stderr and :meth:`CompileState.describe`
(every report's ``compile`` line) says so. CUDA: the same calls would go to inductor's Triton
backend; not run in this project, and the report says so.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from ...fixed_shape import current
from .nadit import blocks

__all__ = ["CompileState", "check_policy", "compile_dit", "compile_vae", "describe", "fused_norm", "stance"]

POLICY_ERROR = ("--compile runs inductor's kernels, which the fixed-shape promise (--deterministic) does not "
                "cover: pass --no-deterministic with --compile")
_ATTR = "_ditsp_compile"
# False inside a request that did not ask for compile (its models may have been compiled by an earlier one)
_enabled: ContextVar[bool] = ContextVar("ditsp_compile", default=True)


def check_policy(deterministic: bool) -> None:
    """ValueError (one line) when compile is asked for together with fixed-shape kernel calls."""
    if deterministic:
        raise ValueError(POLICY_ERROR)


class CompileState:
    """One model's compile: asked for, on which device, and whether it failed (then eager for good)."""

    def __init__(self, what: str, device: torch.device):
        self.what, self.device, self.error = what, torch.device(device), None

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self.error = f"{type(e).__name__}: {first}"
            print(f"ditsp: warning: compile of the {self.what} failed ({self.error}); running it eager",
                  file=sys.stderr)

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.what}: eager (compile failed: {self.error})"
        where = self.device.type if self.device.type == "cpu" else f"{self.device.type}, not verified in this project"
        return f"{self.what}: compiled (torch.compile, inductor, {where})"


def describe(*modules: nn.Module) -> str:
    """The report's ``compile`` line for ``modules``: "eager" when none was compiled."""
    states = [getattr(m, _ATTR) for m in modules if getattr(m, _ATTR, None) is not None]
    return "; ".join(s.describe() for s in states) if states else "eager"


@contextlib.contextmanager
def stance(compiled: bool):
    """Run the block with the compiled code (where its models were compiled) or the original eager code
    (a request without --compile, on models an earlier request compiled: the same bits as never compiled)."""
    token = _enabled.set(compiled)
    try:
        yield
    finally:
        _enabled.reset(token)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The compiler's own errors; looked up when needed, since importing the compiler stack costs every
    process (each rank of every job) 1.2 s of start-up."""
    return (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.CppCompileError)


def _mark(t: torch.Tensor, dims) -> None:
    for d in dims:
        if t.dim() > d and t.shape[d] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, d)


def _guard(state: CompileState, compiled, eager, dynamic_dims):
    def call(*args, **kw):
        if state.error is not None or not _enabled.get():
            return eager(*args, **kw)
        check_policy(current().deterministic)
        for a, dims in zip(args, dynamic_dims):
            _mark(a, dims)
        try:
            return compiled(*args, **kw)
        except _compile_errors() as e:  # evaluated only when something raised
            state.fail(e)
            return eager(*args, **kw)
    return call


def kernel_set_cache() -> str:
    """Point inductor's on-disk cache at a folder of this torch build and CPU kernel set (unless the user
    named one with ``TORCHINDUCTOR_CACHE_DIR``) and return it.

    Inductor's cache key does not cover the kernel set ATen dispatches to: measured on an AVX-512 CPU, a
    run under ``ATEN_CPU_CAPABILITY=avx2`` reused the kernels an AVX-512 run had cached and computed a
    normalise+SiLU wrong by 14 (NaN in the DiT); with a cache per kernel set both are right.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # local: loads the compiler stack

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or named == default_cache_dir():  # unset, or inductor's own default (it writes it back)
        kernels = torch.backends.cpu.get_cpu_capability()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"ditsp-{torch.__version__}-{kernels}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _break_graphs_at_runtime_calls() -> None:
    """Put the blocks' calls into the SP runtime (``blocks.RUNTIME_CALLS``) outside compiled graphs, once."""
    for name in blocks.RUNTIME_CALLS:
        fn = getattr(blocks, name)
        if not getattr(fn, "_ditsp_outside_graphs", False):
            fn = torch.compiler.disable(fn)
            fn._ditsp_outside_graphs = True
            setattr(blocks, name, fn)


def compile_dit(model: nn.Module) -> CompileState:
    """Compile every block of a NaDiT in place (idempotent); returns its state."""
    state = getattr(model, _ATTR, None)
    if state is not None:
        return state
    kernel_set_cache()
    _break_graphs_at_runtime_calls()
    state = CompileState("DiT blocks", next(model.parameters()).device)
    # the 3B's text RoPE cos/sin come from an lru_cache'd helper; tracing it is correct (the values depend on
    # the arguments only), so dynamo's generic warning about cached functions is noise here
    warnings.filterwarnings("ignore", message=".*functools.lru_cache.*", category=UserWarning)
    for block in model.blocks:
        eager = block.forward
        block.forward = _guard(state, torch.compile(eager), eager, ((0,), (0,)))  # vid rows, text rows
    setattr(model, _ATTR, state)
    return state


def _norm_silu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, silu: bool) -> torch.Tensor:
    y = torch.addcmul(shift, x, scale)
    return F.silu(y) if silu else y


def compile_vae(vae: nn.Module) -> CompileState:
    """Give every GroupNorm of a VideoVAE the compiled normalise+SiLU (idempotent); returns its state."""
    state = getattr(vae, _ATTR, None)
    if state is not None:
        return state
    state = CompileState("VAE GroupNorm+SiLU", next(vae.parameters()).device)
    kernel_set_cache()
    # x (b, g, cg, t, h, w); scale and shift (b, g, cg, t, 1, 1)
    fused = _guard(state, torch.compile(_norm_silu), _norm_silu, ((3, 4, 5), (3,), (3,)))
    for m in vae.modules():
        if isinstance(m, nn.GroupNorm):
            m.fused = fused
    setattr(vae, _ATTR, state)
    return state


def fused_norm(layer: nn.Module):
    """The compiled ``(x, scale, shift, silu) -> silu(x * scale + shift)`` of a GroupNorm, or None: not
    compiled, or a request that runs eager (the executor's own two passes then run)."""
    fused = getattr(layer, "fused", None)
    if fused is None or not _enabled.get():
        return None
    check_policy(current().deterministic)
    return fused
