"""Fused attention kernels that return the log-sum-exp: the backend table of the global-attention strategies.

A *block call* is attention of ``q`` [B, H, Sq, D] on one K/V block ``k``/``v``
[B, Hkv, Sk, D] (``H % Hkv == 0``, query head ``h`` uses K/V head
``h // (H / Hkv)``), non-causal or causal (``causal``: query row i sees keys
0..i, the diagonal block of a causal sequence), returning ``(out, lse)`` with
``lse`` [B, H, Sq] the real log-sum-exp of the scaled scores. Its backward takes the
*final* output and LSE of the whole row (all blocks merged), which is what
lets a ring compute every K/V block's gradients independently.

GQA needs no K/V copy on any backend: the ``g = H / Hkv`` query heads of one
K/V head are viewed as ``g * Sq`` query rows of that head (``[B, Hkv, g*Sq, D]``),
which is exact for non-causal attention; dK/dV come out summed over the group.
A causal block with GQA cannot use that view (rows would lose their
positions): each K/V head's query group becomes a batch item instead, with
the K/V head broadcast to it (a stride-0 view, no copy).

Backends (:data:`TABLE`, tried in order; the first that takes the call's
device, dtype and head dim wins):

===============  =========================================================  ===========================
name             kernel                                                     takes
===============  =========================================================  ===========================
cpu_flash        ``aten._scaled_dot_product_flash_attention_for_cpu`` and   CPU; fp16, bf16, fp32, fp64;
                 its ``_backward`` (the kernel CPU SDPA uses)               any head dim
cuda_flash       ``aten._scaled_dot_product_flash_attention`` (+ backward)  CUDA; fp16, bf16; head dim
                                                                            <= 256, a multiple of 8
cuda_efficient   ``aten._scaled_dot_product_efficient_attention``           CUDA; fp16, bf16, fp32;
                 (+ backward)                                               head dim a multiple of 8
reference        pure torch, fp32 score chunks (``attn_fwd/bwd`` here)     everything (the fallback)
===============  =========================================================  ===========================

The CUDA rows are thin, guarded wrappers, checked on CPU against the kernels'
own shape rules (tests/test_gpu_check.py) and on a GPU by ``make gpu-check``
(docs/gpu.md says which runs happened). A kernel is also probed once per
(device, dtype, head dim) with a tiny forward and backward; if it raises, the
call falls back to ``reference``, :func:`choose` says why in
:attr:`Choice.reason`, and a one-line warning names the failed kernel
(:attr:`Choice.fallback`: a kernel of the table takes the call but failed, so
the slow path runs where a fast one was expected; never a silent success).

Choosing: :func:`choose` returns a :class:`Choice`. The backend is a field of
every global-attention strategy (``SPAttention(backend=...)``, ``Ulysses``,
``Ring``, ``USP``); left unset it is :data:`DEFAULT_BACKEND` (``"auto"``: the
first kernel of the table that takes the call), which the environment
variable ``DITSP_ATTENTION_BACKEND`` overrides. ``"reference"`` forces the
pure-torch path. The SP strategies put the choice into the call signature
their ranks agree on, so every rank runs the same backend.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

ENV = "DITSP_ATTENTION_BACKEND"  # overrides DEFAULT_BACKEND where a strategy's backend field is unset
DEFAULT_BACKEND = "auto"  # the backend field's default: the first kernel of the table that takes the call

log = logging.getLogger("ditsp.attention")


@dataclass(frozen=True)
class Choice:
    """The backend of one call signature; ``reason`` says why ``reference`` runs (None for a fused kernel).

    ``fallback``: a kernel of the table takes the call (device, dtype, head dim) but raised when probed,
    so the pure-torch path runs where a fused one was expected; gpu-check reports it as a failure."""

    name: str
    reason: str | None = None
    fallback: bool = False


# -- GQA grouping: query heads of one K/V head become rows of that head ------------------------


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, ...] -> [B, Hkv, g*S, ...] (a view when ``x`` is contiguous)."""
    b, h, s = x.shape[:3]
    return x.reshape(b, kv_heads, (h // kv_heads) * s, *x.shape[3:])


def ungrouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, hk, gs = x.shape[:3]
    return x.reshape(b, heads, gs * hk // heads, *x.shape[3:])


# -- the kernels ---------------------------------------------------------------------------------


def _cpu_flash_fwd(q, k, v, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_bwd(q, k, v, out, lse, dout, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_flash_fwd(q, k, v, scale, causal=False):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _cuda_flash_bwd(q, k, v, out, lse, dout, scale, causal=False):
    sq, sk = q.shape[2], k.shape[2]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale)


def _cuda_efficient_fwd(q, k, v, scale, causal=False):
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1][..., : q.shape[2]]  # the kernel pads LSE rows to a multiple of 32


def _cuda_efficient_bwd(q, k, v, out, lse, dout, scale, causal=False):
    sq = q.shape[2]
    pad = (-sq) % 32
    if pad:  # the backward reads LSE in the padded layout the forward wrote
        lse = torch.nn.functional.pad(lse, (0, pad))
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    g = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
    return g[0], g[1], g[2]


@dataclass(frozen=True)
class Kernel:
    name: str
    device: str
    dtypes: tuple[torch.dtype, ...]
    head_dim_ok: Callable[[int], bool]
    fwd: Callable
    bwd: Callable
    contiguous_dtypes: tuple[torch.dtype, ...] = ()  # dtypes it reads faster from contiguous q/k/v

    def rejects(self, device: str, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this kernel does not take the call (None when it does)."""
        if device != self.device:
            return f"{self.name} needs {self.device} tensors, got {device}"
        if dtype not in self.dtypes:
            return f"{self.name} does not take {str(dtype).replace('torch.', '')}"
        if not self.head_dim_ok(head_dim):
            return f"{self.name} does not take head dim {head_dim}"
        return None


_HALF = (torch.float16, torch.bfloat16)
TABLE: tuple[Kernel, ...] = (
    # Strided bf16 q/k/v (Ulysses' head shards are views of the receive buffer) run ~4% slower in the
    # CPU flash op (seq 8192, 4 heads x 64, one thread: 0.746 vs 0.715 s); fp32 runs the same.
    Kernel("cpu_flash", "cpu", _HALF + (torch.float32, torch.float64), lambda d: d >= 1,
           _cpu_flash_fwd, _cpu_flash_bwd, _HALF),
    Kernel("cuda_flash", "cuda", _HALF, lambda d: d <= 256 and d % 8 == 0, _cuda_flash_fwd, _cuda_flash_bwd),
    Kernel("cuda_efficient", "cuda", _HALF + (torch.float32,), lambda d: d % 8 == 0,
           _cuda_efficient_fwd, _cuda_efficient_bwd),
)
KERNELS = {k.name: k for k in TABLE}
NAMES = tuple(KERNELS) + ("reference",)


def wants_contiguous(backend: str, dtype: torch.dtype) -> bool:
    """Whether ``backend`` runs faster on contiguous q/k/v of ``dtype`` (worth one copy per tensor)."""
    k = KERNELS.get(backend)
    return k is not None and dtype in k.contiguous_dtypes

_CHOICES: dict[tuple, Choice] = {}
_PROBED: dict[tuple, str | None] = {}


def _probe(kernel: Kernel, device: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Run the kernel once on a tiny block (forward and backward); the error it raised, or None."""
    key = (kernel.name, device, dtype, head_dim)
    if key not in _PROBED:
        try:
            x = torch.randn(1, 1, 3, head_dim, device=device).to(dtype)
            out, lse = kernel.fwd(x, x, x, 0.5)
            kernel.bwd(x, x, x, out, lse, torch.ones_like(out), 0.5)
            _PROBED[key] = None
        except Exception as e:  # noqa: BLE001 - any failure means: not this kernel
            _PROBED[key] = f"{kernel.name} failed on this device: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return _PROBED[key]


def requested_default() -> str:
    """The backend an unset field means: ``DITSP_ATTENTION_BACKEND`` when set, else :data:`DEFAULT_BACKEND`."""
    return os.environ.get(ENV, "").strip() or DEFAULT_BACKEND


def choose(device: str, dtype: torch.dtype, head_dim: int, requested: str | None = None, probe: bool = True) -> Choice:
    """The backend for calls on ``device`` (a type: "cpu", "cuda") with this dtype and head dim."""
    requested = requested or requested_default()
    if requested not in NAMES + ("auto",):
        raise ValueError(f"unknown attention backend {requested!r}; choose from auto, {', '.join(NAMES)}")
    key = (device, dtype, int(head_dim), requested, probe)
    if key in _CHOICES:
        return _CHOICES[key]
    if requested == "reference":
        choice = Choice("reference", "requested")
    else:
        kernels = TABLE if requested == "auto" else (KERNELS[requested],)
        reasons, failed = [], []
        choice = None
        for k in kernels:
            why = k.rejects(device, dtype, head_dim)
            if why is None and probe:
                why = _probe(k, device, dtype, head_dim)
                if why is not None:
                    failed.append(why)
            if why is None:
                choice = Choice(k.name)
                break
            if requested != "auto" or k.device == device:
                reasons.append(why)
        if choice is None:
            dt = str(dtype).replace("torch.", "")
            choice = Choice("reference", "; ".join(reasons) or f"no fused kernel for {dt} on {device}", bool(failed))
            if failed:  # once per signature (choices are cached): the slow path where a fused one was expected
                log.warning("attention falls back to the pure-torch reference for %s, head dim %d on %s: %s",
                            dt, head_dim, device, "; ".join(failed))
    _CHOICES[key] = choice
    return choice


# -- block calls ---------------------------------------------------------------------------------


def _per_group(q, k, v):
    """Causal blocks: [B, H, S, D] queries as [B*Hkv, g, S, D] and each K/V head broadcast over its group
    ([B*Hkv, g, Sk, D], stride 0 on g: no copy). Query rows keep their positions, unlike :func:`grouped`."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = h // hk

    def kv(x):
        return x.reshape(b * hk, 1, sk, x.shape[-1]).expand(b * hk, g, sk, x.shape[-1])

    return q.reshape(b * hk, g, sq, d), kv(k), kv(v)


# -- the reference kernel: pure torch, fp32 score chunks, GQA by grouping query rows (no K/V copy) ----

# Bound on fp32 score elements materialised at once (query rows are chunked).
SCORE_ELEMS = 1 << 22


def _chunks(rows: int, cols: int, heads: int):
    step = max(1, SCORE_ELEMS // max(1, cols * heads))
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def _causal_mask(i: int, j: int, sk: int, groups: int, device, offset: int = 0) -> torch.Tensor:
    """True where grouped query rows ``[i, j)`` (``groups`` heads' rows stacked) must not see a key: key
    ``c`` is hidden from query row ``r`` when ``c > r + offset``."""
    pos = torch.arange(i + offset, j + offset, device=device).repeat(groups)
    return pos[:, None] < torch.arange(sk, device=device)[None, :]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key) as 0, so ``exp(s - lse)`` of its hidden scores is 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def attn_fwd(q, k, v, scale: float, causal: bool = False, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention of ``q`` [B,H,Sq,D] on one K/V block [B,Hkv,Sk,D] (H % Hkv == 0, contiguous groups).

    Returns ``(out, lse)`` in fp32: out [B,H,Sq,Dv], lse [B,H,Sq] = logsumexp of the scaled scores.
    ``causal``: query row i sees keys 0..i+offset (``offset``: the query block's start minus the key
    block's, for blocks of one sequence that do not start together); a row that sees no key gets out 0
    and lse -inf. Any layout whose strides allow the views (e.g. sequence-major ``[B,S,H,D]``
    transposed): K and V are never copied.
    """
    b, h, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if h == 0 or hk == 0:  # a Ulysses rank holding no heads (fewer heads than ranks)
        if h != hk:
            raise ValueError(f"{h} query heads cannot attend to {hk} K/V heads")
        return (q.new_zeros((b, 0, sq, v.shape[-1]), dtype=torch.float32),
                q.new_zeros((b, 0, sq), dtype=torch.float32))
    if h % hk:
        raise ValueError(f"{h} query heads do not group onto {hk} K/V heads")
    out = q.new_empty((b, h, sq, v.shape[-1]), dtype=torch.float32)
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    kf, vf = k.float(), v.float()
    for i, j in _chunks(sq, sk, h):
        qc = grouped(q[:, :, i:j].float(), hk)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i, j, sk, h // hk, s.device, offset), float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(l).unsqueeze(-1))
        out[:, :, i:j] = ungrouped(torch.matmul(p, vf), h)
        lse[:, :, i:j] = ungrouped(l, h)
    return out, lse


def attn_bwd(q, k, v, lse, delta, dout, scale: float, causal: bool = False, offset: int = 0):
    """Reference gradients of one K/V block given the *final* ``lse`` and ``delta = rowsum(dout * out)``.

    Returns fp32 ``(dq, dk, dv)``; dk/dv sum over the query heads of each group. ``causal``/``offset``
    as for :func:`attn_fwd`.
    """
    h, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    f32 = dict(dtype=torch.float32, device=q.device)
    if h == 0 or hk == 0:  # a rank holding no heads: nothing to differentiate
        return torch.zeros(q.shape, **f32), torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32)
    kf, vf, lse, delta = k.float(), v.float(), lse.float(), delta.float()
    dq = torch.empty(q.shape, **f32)
    dk = torch.zeros(k.shape, **f32)
    dv = torch.zeros(v.shape, **f32)
    for i, j in _chunks(sq, sk, h):
        qc = grouped(q[:, :, i:j].float(), hk)
        do = grouped(dout[:, :, i:j].float(), hk)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(_causal_mask(i, j, sk, h // hk, s.device, offset), float("-inf"))
        p = torch.exp(s - grouped(_finite(lse[:, :, i:j, None]), hk))
        dv += torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, vf.transpose(-1, -2))
        ds = p * (dp - grouped(delta[:, :, i:j, None], hk)) * scale
        dq[:, :, i:j] = ungrouped(torch.matmul(ds, kf), h)
        dk += torch.matmul(ds.transpose(-1, -2), qc)
    return dq, dk, dv


def block_fwd(backend: str, q, k, v, scale: float, causal: bool = False):
    """``(out, lse)`` of one block. ``out`` is in q's dtype on a kernel, fp32 on ``reference``; lse >= fp32.

    ``causal``: query row i sees keys 0..i (the block is a sequence's own diagonal block).
    """
    b, h, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if (h != hk) if h == 0 or hk == 0 else h % hk:
        raise ValueError(f"{h} query heads do not group onto {hk} K/V heads")
    if h == 0 or sq == 0 or sk == 0:  # kernels crash on empty dims; these need no kernel
        return (q.new_zeros((b, h, sq, v.shape[-1]), dtype=torch.float32),
                q.new_full((b, h, sq), float("-inf") if sk == 0 else 0.0, dtype=torch.float32))
    if backend == "reference":
        return attn_fwd(q, k, v, scale, causal)
    if causal:
        out, lse = KERNELS[backend].fwd(*_per_group(q, k, v), scale, True)
        return out.reshape(b, h, sq, -1), lse.reshape(b, h, sq)
    out, lse = KERNELS[backend].fwd(grouped(q, hk), k, v, scale)
    return ungrouped(out, h), ungrouped(lse, h)


def block_bwd(backend: str, q, k, v, out, lse, dout, scale: float, delta=None, causal: bool = False):
    """Gradients ``(dq, dk, dv)`` of one K/V block given the row's final ``out`` and ``lse``.

    dK/dV sum over the query heads of each group. ``delta`` (rowsum(dout * out), fp32) is used by
    ``reference`` only (computed when omitted); a kernel computes it from ``out``.
    """
    h, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if h == 0 or hk == 0 or sq == 0 or sk == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    if backend == "reference":
        if delta is None:
            delta = (dout.float() * out.float()).sum(-1)
        return attn_bwd(q, k, v, lse, delta, dout, scale, causal)
    dt = q.dtype
    out, dout = out.to(dt), dout.to(dt)
    lse = lse.to(torch.float64 if dt == torch.float64 else torch.float32)
    if causal:
        b = q.shape[0]
        qg, kg, vg = _per_group(q, k, v)
        dq, dk, dv = KERNELS[backend].bwd(qg, kg, vg, out.reshape(qg.shape[:3] + out.shape[-1:]),
                                          lse.reshape(qg.shape[:3]), dout.reshape(qg.shape[:3] + dout.shape[-1:]),
                                          scale, True)
        fold = lambda x: x.sum(1).reshape(b, hk, *x.shape[2:])  # noqa: E731 - the group's gradients
        return dq.reshape(q.shape), fold(dk), fold(dv)
    # grouped() reshapes: a view where the layout allows (always without GQA), a copy otherwise.
    dq, dk, dv = KERNELS[backend].bwd(grouped(q, hk), k, v, grouped(out, hk), grouped(lse, hk),
                                      grouped(dout, hk), scale)
    return ungrouped(dq, h), dk, dv


class LocalAttention(torch.autograd.Function):
    """One block call with autograd: attention of ``q`` on all of ``k``/``v``; out in q's dtype."""

    @staticmethod
    def forward(ctx, backend, scale, causal, q, k, v):
        out, lse = block_fwd(backend, q, k, v, scale, causal)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (backend, scale, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, scale, causal = ctx.args
        dq, dk, dv = block_bwd(backend, q, k, v, out, lse, dout, scale, causal=causal)
        return None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def local_attention(backend: str, q, k, v, scale: float, causal: bool = False):
    """Attention of ``q`` [B,H,Sq,D] on ``k``/``v`` [B,Hkv,Sk,D] (compute layout), one fused call.

    ``causal``: row i sees keys 0..i (queries and keys are the same positions)."""
    return LocalAttention.apply(backend, scale, causal, q, k, v)
