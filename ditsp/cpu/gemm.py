"""Float32 linears on CPU through oneDNN, the library PyTorch already uses for convolutions and bf16.

PyTorch hands a float32 ``F.linear`` on CPU to its BLAS (MKL) and a bf16 one to
oneDNN. MKL picks its kernels by CPU vendor as well as features: on an AMD EPYC
with AVX-512 it runs its AVX2 kernels, 82-88 GFLOP/s on one core against
oneDNN's 177-195 GFLOP/s (2.2x) for the DiT's shapes; with the ISA capped at
AVX2 for both, oneDNN is still 1.6x (``benchmarks/results/speed.md``). oneDNN
dispatches on the CPU's feature flags alone, which is also how it already runs
every convolution of the VAE.

:func:`linear` is ``F.linear`` with that route for float32 CPU tensors that
need no gradient (oneDNN's op here has no backward; training keeps the BLAS).
Both kernel policies take it: the fast policy's plain calls and the
deterministic policy's fixed-shape tiles (:mod:`ditsp.fixed_shape`; a 768-row
oneDNN call is position-free under the AVX-512 and AVX2 kernel sets, which
``ditsp doctor`` probes on any machine). Results differ from the BLAS's in
summation order only (about 5e-7 of the output's scale). The route is the
``gemm`` field of :class:`~ditsp.cpu.settings.CpuSettings`: ``DITSP_CPU_GEMM=blas``
turns it off for a process (read when this module is imported), :func:`use_route`
for a block; a call oneDNN refuses runs on the BLAS (which raises ``F.linear``'s
own error for operands that do not fit).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from . import settings


def _onednn_op():
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_op = _onednn_op() if settings.process().gemm == "onednn" else None


def route() -> str:
    """The route float32 CPU linears take here: ``onednn`` or ``blas``."""
    if _op is None:
        return "blas"
    return settings.current().gemm


@contextmanager
def use_route(name: str) -> Iterator[str]:
    """Run the block's eager float32 CPU linears on ``name`` (``blas`` or ``onednn``, where available);
    ``ditsp bench speed`` runs both routes in one process."""
    if name not in settings.GEMM_ROUTES:
        raise ValueError(f"unknown GEMM route {name!r}; expected one of {', '.join(settings.GEMM_ROUTES)}")
    with settings.use(gemm=name):
        yield route()


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` sends this call to oneDNN (float32 CPU, no gradient, the route on)."""
    return route() == "onednn" and _eligible(x, weight, bias)


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if _op is None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    if x.dim() < 2 or x.numel() == 0:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))


@torch.library.custom_op("ditsp::onednn_linear", mutates_args=())
def _compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The oneDNN call as one opaque op, so torch.compile calls it as it stands (inductor would not lower it)."""
    return _call(x, weight, bias)


@_compiled_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, float32 CPU inference through oneDNN (see the module docstring)."""
    if torch.compiler.is_compiling():
        return _compiled_linear(x, weight, bias) if _eligible(x, weight, bias) else F.linear(x, weight, bias)
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    return _call(x, weight, bias)


def _call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _op is None:
        return F.linear(x, weight, bias)
    try:
        return _op(x.contiguous(), weight.contiguous(), bias, "none", [], "")
    except RuntimeError:
        # oneDNN refused this call: operands F.linear rejects too (it raises its own error) or a shape this
        # build cannot run (it computes it). Decided per call, never for the process, so every process of a
        # group takes the same route for the same call and the deterministic tiles stay equal across ranks.
        return F.linear(x, weight, bias)
