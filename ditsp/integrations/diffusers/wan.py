"""Wan 2.1 / 2.2 (``WanTransformer3DModel``: T2V, I2V, TI2V) under ditsp SP.

Cut points: the RoPE tables (one row per video token) and the patch-embedded
tokens entering block 0 are sharded; so is Wan 2.2 TI2V's per-token
timestep (``[B, S]``) at the model's input, which makes the per-token
modulation of every block and of the output norm local too. Self-attention
(``attn1``) runs the configured strategy; cross-attention (``attn2``, also
the I2V image keys) attends replicated text from the rank's own queries and
stays as diffusers wrote it. The output projection is gathered.
"""

from __future__ import annotations

import torch

from .hooks import Gather, ParallelizeError, Plan, Split


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on ``[B, s, H, D]`` with pair-interleaved tables ``[1, s, 1, D]``; computed in the tables'
    precision and cast back, as the model does."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)


class WanSelfAttention:
    """Processor of a Wan self-attention module: the module's own projections and norms, ditsp attention."""

    def __init__(self, runtime, module, path: str):
        if getattr(module, "is_cross_attention", False) or getattr(module, "add_k_proj", None) is not None:
            raise ParallelizeError(f"cannot parallelize {path}: a cross-attention module matched the self-attention plan")
        self.runtime, self.path = runtime, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ParallelizeError(f"{self.path}: ditsp's Wan self-attention takes no encoder states or mask")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = self.runtime.attention(q, k, v, seq_lens=self.runtime.lens)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def grid(model, args, kwargs) -> tuple[int, int, int]:
    """Post-patch (T, H, W) of a forward's latents ``[B, C, F, H, W]`` (tokens in canonical order)."""
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    pt, ph, pw = model.config.patch_size
    return x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw


PLAN = Plan(
    family="WanTransformer3DModel",
    inputs={
        "": {"timestep": Split(1, ndim=2)},  # Wan 2.2 TI2V: one timestep per token
        "blocks.0": {"hidden_states": Split(1)},
    },
    outputs={"rope": {0: Split(1), 1: Split(1)}, "proj_out": {None: Gather(1)}},
    self_attention=("blocks.*.attn1",),
    local_attention=("blocks.*.attn2",),
    processor=WanSelfAttention,
    processor_classes=("WanAttnProcessor",),
    grid=grid,
)
