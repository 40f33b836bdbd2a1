"""A parallelized diffusers Wan transformer whose kernel calls never take a shape from the SP degree.

Under Ulysses SP a rank runs its own share of the video tokens through every
tokenwise layer, so a plain ``nn.Linear`` call's row count, and the query rows
of cross-attention, follow the degree; the BLAS then picks its blocking by
that count and a token's bits can change with the degree (docs/determinism.md).
:func:`fix_shapes` installs, on a model :func:`~.parallelize.parallelize` has
already put under Ulysses SP:

- every ``nn.Linear`` as :class:`FixedShapeLinear`: rows in tiles of exactly
  :data:`ditsp.fixed_shape.ROW_TILE` (:func:`ditsp.fixed_shape.linear_rows`),
  the same call with and without autograd (the backward is a plain GEMM), so a
  training forward gives the bits of an inference forward;
- cross-attention (``attn2``) as :class:`FixedCrossAttention`: queries in
  tiles of exactly :data:`QUERY_TILE` rows against the replicated text;
- self-attention as :class:`FixedHeadsUlysses`: after the all-to-all every
  rank holds whole heads of the whole sequence, and each head runs alone in
  its own call of one shape ``[B, 1, S, D]``.

The rest of the forward is elementwise or per-row (norms, modulation, RoPE,
GELU) on tensors whose rows are whole on every rank, or replicated (patch
embedding, time and text embedding). Elementwise kernels take a scalar tail
for the last elements of a buffer that are not a multiple of the SIMD
length, and a transcendental function (the FFN's tanh-GELU) may round there
differently: widths that are multiples of 64 (every released Wan's) keep a
row's elements out of the tail at every degree, so :func:`fix_shapes` refuses
other widths. With these the forward at SP 1, 2, 3 gives one device's bits
(``tests/test_rl_identity.py``), under the premise docs/determinism.md states
(a call of one shape is position-free; ``ditsp doctor`` probes it).
"""

from __future__ import annotations

import torch

from ...attention.kernels import choose, local_attention
from ...attention.ulysses import head_plan, to_heads, to_seq
from ...fixed_shape import DETERMINISTIC, linear_rows
from .hooks import ParallelizeError
from .parallelize import runtime_of

QUERY_TILE = 256  # cross-attention query rows per call: a function of nothing but this constant
WIDTH_MULTIPLE = 64  # the model's widths (hidden, FFN, head dim x heads) must be multiples of this


class _Linear(torch.autograd.Function):
    """The fixed-shape linear with autograd: the forward is the inference call itself (same bits)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_rows(x, weight, bias, DETERMINISTIC)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g @ weight if ctx.needs_input_grad[0] else None
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class FixedShapeLinear(torch.nn.Linear):
    """``nn.Linear`` whose GEMMs run in fixed row tiles (installed by :func:`fix_shapes`; same weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        grad = torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad))
        out = _Linear.apply(rows, self.weight, self.bias) if grad else linear_rows(rows, self.weight, self.bias,
                                                                                    DETERMINISTIC)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(2, (heads, -1)).transpose(1, 2)  # [B, s, H*D] -> [B, H, s, D]


class FixedCrossAttention:
    """Wan cross-attention (text-to-video): the module's projections and norms, queries in fixed tiles."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        if attention_mask is not None or rotary_emb is not None or encoder_hidden_states is None:
            raise ParallelizeError(f"{self.path}: fixed-shape cross-attention takes text states only")
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(encoder_hidden_states))
        v = attn.to_v(encoder_hidden_states)
        q, k, v = (_heads_first(t, attn.heads) for t in (q, k, v))
        backend = choose(q.device.type, q.dtype, q.shape[-1]).name
        scale = q.shape[-1] ** -0.5
        rows = q.shape[2]
        pad = -rows % QUERY_TILE
        qp = torch.nn.functional.pad(q, (0, 0, 0, pad)) if pad else q
        out = torch.cat([local_attention(backend, t.contiguous(), k.contiguous(), v.contiguous(), scale)
                         for t in qp.split(QUERY_TILE, dim=2)], dim=2)[:, :, :rows]
        out = out.transpose(1, 2).flatten(2, 3).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


class FixedHeadsUlysses:
    """Ulysses self-attention with one head per kernel call: the all-to-all of ``inner`` (an
    :class:`~ditsp.attention.usp.SPAttention` of ring degree 1), then ``[B, 1, S, D]`` calls."""

    def __init__(self, inner):
        if inner.r.world_size != 1:
            raise ParallelizeError("fixed-shape attention runs under Ulysses only (ring degree 1)")
        self.inner, self.name = inner, f"{inner.name}-fixed-heads"

    def __call__(self, q, k, v, seq_lens=None, **kwargs):
        if kwargs:
            raise ParallelizeError(f"fixed-shape Ulysses attention takes no {sorted(kwargs)}")
        a = self.inner
        backend = a.agree(q, k, v, 0, "front", seq_lens, None).name
        u = a.u.world_size
        plan = head_plan(q.shape[2], k.shape[2], u)
        if plan.heads != plan.kv_heads:
            raise ParallelizeError("fixed-shape attention: grouped K/V heads are not supported")
        if u > 1:
            hq, hk, hv = to_heads(a.transport, plan, list(seq_lens), q, k, v, a.stacked, False)
        else:
            hq, hk, hv = (x.transpose(1, 2) for x in (q, k, v))
        scale = q.shape[-1] ** -0.5
        heads = [local_attention(backend, *(x[:, i:i + 1].contiguous() for x in (hq, hk, hv)), scale)
                 for i in range(hq.shape[1])]
        o = torch.cat(heads, dim=1) if heads else hq.new_zeros(hq.shape)
        return to_seq(a.transport, plan, list(seq_lens), o, a.stacked) if u > 1 else o.transpose(1, 2)


def check_config(config) -> None:
    """Refuse (one line) a Wan config whose kernel calls cannot be made fixed-shape: widths not multiples of
    :data:`WIDTH_MULTIPLE`, or image conditioning. ``config``: the model's config or its config.json dict."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    dim = get("num_attention_heads", 40) * get("attention_head_dim", 128)
    for name, v in (("hidden width", dim), ("ffn_dim", get("ffn_dim", 13824))):
        if v % WIDTH_MULTIPLE:
            raise ParallelizeError(f"fixed-shape Wan: the {name} {v} is not a multiple of {WIDTH_MULTIPLE} "
                                   "(the elementwise kernels' tail would follow the SP degree)")
    if get("added_kv_proj_dim", None) or get("image_dim", None):
        raise ParallelizeError("fixed-shape Wan: image-conditioned (I2V) models are not supported")


def fix_shapes(model: torch.nn.Module) -> torch.nn.Module:
    """Make a parallelized Wan transformer's kernel calls fixed-shape (module doc), in place; returns it.
    Raises :class:`ParallelizeError` (one line) for a model it cannot fix."""
    if type(model).__name__ != "WanTransformer3DModel":
        raise ParallelizeError(f"fixed-shape kernel calls are built for WanTransformer3DModel, not "
                               f"{type(model).__name__}")
    runtime = runtime_of(model)
    if runtime.cfg is not None or runtime.sparse is not None:
        raise ParallelizeError("fixed-shape kernel calls: CFG-parallel and sparse attention are not supported")
    if isinstance(runtime.attention, FixedHeadsUlysses):
        raise ParallelizeError("this model's kernel calls are already fixed-shape")
    check_config(model.config)
    runtime.attention = FixedHeadsUlysses(runtime.attention)
    for path, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = FixedShapeLinear
        elif path.endswith(".attn2") and hasattr(m, "set_processor"):
            if getattr(m, "fused_projections", False):
                raise ParallelizeError(f"{path}: fused projections are not supported by fixed-shape attention")
            m.set_processor(FixedCrossAttention(path))
    return model
