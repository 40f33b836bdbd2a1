"""Window attention over [video window, replicated text] segments.

Every window attends to its own video tokens plus all text tokens; the text
is replicated into each window, so each window also yields one text output.
This module returns the video output rows (local order kept) and the *sum* of
the per-window text outputs: the caller's runtime turns that sum into the
reference's plain mean over all windows (across ranks). The sum is kept in
fp64: per element, fp32 (or bf16) text outputs add exactly in fp64 unless their
nonzero magnitudes span more than about 2^(29 - log2(windows)), and an exact
sum does not depend on which rank summed which windows, i.e. on the SP degree
or the plan (docs/determinism.md). A window's output does not depend on the
other windows in its attention call: under the deterministic kernel-shape
policy every call holds a fixed number of (window, head) pairs that depends on
the window length only (:func:`segment_attention`, :mod:`ditsp.fixed_shape`).

Two paths, same maths:
- ``varlen``: one packed flash-attn varlen call with ``cu_seqlens`` (CUDA,
  flash-attn installed).
- ``sdpa``: windows grouped by shape, one batched SDPA call per group (the
  portable path; a layout has only a few distinct window shapes).

RoPE is applied here, per window shape, because positions are window-local:
``rope(x, shape)`` rotates ``x`` (n, prod(shape), H, D), n windows of ``shape``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..fixed_shape import pair_batch

try:  # optional packed-varlen backend
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_varlen_func = None

RopeFn = Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor]


@dataclass(frozen=True, eq=False)
class WindowPack:
    """Local windows (back to back, row-major) grouped by shape: (shape, row index, count)."""

    shapes: tuple[tuple[int, int, int], ...]
    lengths: tuple[int, ...]
    groups: tuple[tuple[tuple[int, int, int], torch.Tensor, int], ...]

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], device="cpu") -> "WindowPack":
        shapes = tuple(tuple(int(v) for v in s) for s in shapes)
        lengths = tuple(s[0] * s[1] * s[2] for s in shapes)
        starts, acc = [], 0
        for n in lengths:
            starts.append(acc)
            acc += n
        by_shape: dict = {}
        for s, a, n in zip(shapes, starts, lengths):
            by_shape.setdefault(s, []).append(torch.arange(a, a + n))
        groups = tuple((s, torch.cat(rows).to(device), len(rows)) for s, rows in by_shape.items())
        return cls(shapes, lengths, groups)

    @property
    def num_rows(self) -> int:
        return sum(self.lengths)


def backend_for(x: torch.Tensor) -> str:
    """``varlen`` when flash-attn can run on ``x`` (CUDA, half precision), else ``sdpa``."""
    if flash_attn_varlen_func is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        return "varlen"
    return "sdpa"


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    tq: torch.Tensor | None, tk: torch.Tensor, tv: torch.Tensor,
    pack: WindowPack, rope: RopeFn | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Video q/k/v (N, H, D) in local window order, text q/k/v (L, H, D) already roped.

    Returns the video output (N, H, D) and the fp64 sum over windows of the text
    output (L, H, D); ``tq=None`` skips text queries (the last block discards them)
    and returns ``None`` for the text.
    """
    backend = backend or backend_for(q)
    fn = _varlen if backend == "varlen" else _grouped_sdpa
    return fn(q, k, v, tq, tk, tv, pack, rope)


def _grouped_sdpa(q, k, v, tq, tk, tv, pack, rope):
    _, heads, dim = q.shape
    L = tk.shape[0]
    out = q.new_empty(q.shape)
    txt = torch.zeros(L, heads, dim, dtype=torch.float64, device=q.device) if tq is not None else None
    for shape, idx, n in pack.groups:
        l = idx.numel() // n
        qg, kg, vg = (t.index_select(0, idx).view(n, l, heads, dim) for t in (q, k, v))
        if rope is not None:
            qg, kg = rope(qg, shape), rope(kg, shape)
        kg = torch.cat([kg, tk.expand(n, L, heads, dim)], 1)
        vg = torch.cat([vg, tv.expand(n, L, heads, dim)], 1)
        if tq is not None:
            qg = torch.cat([qg, tq.expand(n, L, heads, dim)], 1)
        o = segment_attention(qg, kg, vg)  # (n, l[+L], H, D)
        out.index_copy_(0, idx, o[:, :l].reshape(n * l, heads, dim))
        if txt is not None:
            txt += o[:, l:].double().sum(0)
    return out, txt


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of n segments of one shape: q (n, lq, H, D), k/v (n, lk, H, D) -> (n, lq, H, D).

    Plain (fast policy): one SDPA call over all n segments. Deterministic
    policy: the n*H (segment, head) pairs run in calls of exactly
    :func:`~ditsp.fixed_shape.pair_batch` pairs (the last call zero-padded), so
    a call's shape depends on (lq, lk, D) alone, never on how many segments or
    heads this rank holds.
    """
    n, lq, heads, dim = q.shape
    per_call = pair_batch(lq)
    if per_call is None:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    qp, kp, vp = (t.permute(0, 2, 1, 3).reshape(n * heads, 1, t.shape[1], dim) for t in (q, k, v))
    pairs = n * heads
    out = qp.new_empty(qp.shape)
    for a in range(0, pairs, per_call):
        b = min(pairs, a + per_call)
        if b - a == per_call:
            out[a:b] = F.scaled_dot_product_attention(qp[a:b], kp[a:b], vp[a:b])
            continue
        padded = [t.new_zeros((per_call,) + t.shape[1:]) for t in (qp, kp, vp)]
        for dst, src in zip(padded, (qp, kp, vp)):
            dst[: b - a] = src[a:b]
        out[a:b] = F.scaled_dot_product_attention(*padded)[: b - a]
    return out.view(n, heads, lq, dim).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class _Packing:
    """Where the rows of one layer's flash-attn call come from and go to, on the rows' device.

    Worked out on the host from the pack's window lengths (Python ints, no device read) and copied to
    the device once per (pack, text length, device): the per-layer call only gathers and scatters."""

    src: torch.Tensor  # packed [video_i, text] row -> row of cat([video, text])
    video: torch.Tensor  # packed positions of the video rows, in local window order
    text: torch.Tensor  # packed positions of each segment's text rows, segment by segment
    cu_k: torch.Tensor  # int32 segment starts of the [video_i, text] segments, plus the total
    cu_video: torch.Tensor  # int32 segment starts of the video-only queries, plus the total
    max_k: int
    max_video: int


def _packing(pack: WindowPack, text_len: int, device) -> _Packing:
    cache = pack.__dict__.setdefault("_varlen", {})  # lives with the pack (a runtime caches one per layout)
    key = (int(text_len), str(device))
    if key not in cache:
        n_rows, src, video, text, cu_k, cu_v = pack.num_rows, [], [], [], [0], [0]
        start = 0
        for n in pack.lengths:
            at = cu_k[-1]
            src += list(range(start, start + n)) + list(range(n_rows, n_rows + text_len))
            video += list(range(at, at + n))
            text += list(range(at + n, at + n + text_len))
            cu_k.append(at + n + text_len)
            cu_v.append(cu_v[-1] + n)
            start += n
        as_dev = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt).to(device)  # noqa: E731
        cache[key] = _Packing(as_dev(src), as_dev(video), as_dev(text), as_dev(cu_k, torch.int32), as_dev(cu_v, torch.int32),
                              max(pack.lengths, default=0) + text_len, max(pack.lengths, default=0))
    return cache[key]


def _varlen(q, k, v, tq, tk, tv, pack, rope):
    """One packed flash-attn call; segments are [window video, text] back to back. No host sync: the
    packing is cached per layout (:func:`_packing`)."""
    n_rows, heads, dim = q.shape
    L = tk.shape[0]
    if rope is not None:  # rotate video q/k per window shape (positions are window-local)
        q, k = q.clone(), k.clone()
        for shape, idx, n in pack.groups:
            for t in (q, k):
                t.index_copy_(0, idx, rope(t.index_select(0, idx).view(n, -1, heads, dim), shape).flatten(0, 1))
    pk = _packing(pack, L, q.device)
    kp, vp = torch.cat([k, tk]).index_select(0, pk.src), torch.cat([v, tv]).index_select(0, pk.src)
    if tq is None:  # video queries only
        return flash_attn_varlen_func(q, kp, vp, pk.cu_video, pk.cu_k, pk.max_video, pk.max_k, causal=False), None
    qp = torch.cat([q, tq]).index_select(0, pk.src)
    o = flash_attn_varlen_func(qp, kp, vp, pk.cu_k, pk.cu_k, pk.max_k, pk.max_k, causal=False)
    out = o.index_select(0, pk.video)
    txt = o.index_select(0, pk.text).view(len(pack.lengths), L, heads, dim).double().sum(0)
    return out, txt
