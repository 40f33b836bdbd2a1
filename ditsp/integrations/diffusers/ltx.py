"""LTX-Video (``LTXVideoTransformer3DModel``) under ditsp SP.

The packed latent tokens (``hidden_states [B, S, C]``) and per-token
timesteps (``[B, S]``, when given) are sharded at the model's input, the RoPE
tables the model builds for the whole grid are sharded as they leave
``rope``, self-attention (``attn1``) runs the configured strategy,
cross-attention (``attn2``, text with its mask) stays local, and the output
projection is gathered.
"""

from __future__ import annotations

import torch

from .hooks import Gather, ParallelizeError, Plan, Split


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LTX's RoPE on ``[B, s, C]`` (before the head split) with tables ``[B, s, C]``, in fp32, cast back."""
    re, im = x.unflatten(2, (-1, 2)).unbind(-1)
    turned = torch.stack([-im, re], -1).flatten(2)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


class LTXSelfAttention:
    """Processor of an LTX self-attention module: its projections, QK norms and RoPE, ditsp attention."""

    def __init__(self, runtime, module, path: str):
        self.runtime, self.path = runtime, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ParallelizeError(f"{self.path}: ditsp's LTX self-attention takes no encoder states or mask")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = rotate(q, *image_rotary_emb), rotate(k, *image_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self.runtime.attention(q, k, v, seq_lens=self.runtime.lens)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


PLAN = Plan(
    family="LTXVideoTransformer3DModel",
    inputs={"": {"hidden_states": Split(1), "timestep": Split(1, ndim=2)}},
    outputs={"rope": {0: Split(1), 1: Split(1)}, "proj_out": {None: Gather(1)}},
    self_attention=("transformer_blocks.*.attn1",),
    local_attention=("transformer_blocks.*.attn2",),
    processor=LTXSelfAttention,
    processor_classes=("LTXVideoAttnProcessor",),
)
