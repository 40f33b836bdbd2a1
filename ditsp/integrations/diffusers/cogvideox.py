"""CogVideoX (``CogVideoXTransformer3DModel``, 2B/5B/1.5) under ditsp SP: joint text in every attention.

The patch embedding runs whole (it embeds text and video together and adds
the grid's positional embedding); the video tokens are sharded as they enter
block 0, and so are the RoPE tables the pipeline passes in
(``image_rotary_emb``, one row per video token). Text stays replicated: each
block's attention joins it in front of the local video tokens, and ditsp's
attention takes it as joint text (``text_len`` rows in front). The output
projection is gathered.
"""

from __future__ import annotations

import torch

from .flux import rotate
from .hooks import Gather, ParallelizeError, Plan, Split


class CogVideoXJointAttention:
    """Processor of a CogVideoX attention module: projections and norms over [text; video], RoPE on video."""

    def __init__(self, runtime, module, path: str):
        self.runtime, self.path = runtime, path

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if attention_mask is not None:
            raise ParallelizeError(f"{self.path}: ditsp's CogVideoX attention takes no attention mask")
        text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = torch.cat([q[:, :text], rotate(q[:, text:], *image_rotary_emb)], 1)
            k = torch.cat([k[:, :text], rotate(k[:, text:], *image_rotary_emb)], 1)
        out = self.runtime.attention(q, k, v, text_len=text, joint="front", seq_lens=self.runtime.lens)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))
        return out[:, text:], out[:, :text]


PLAN = Plan(
    family="CogVideoXTransformer3DModel",
    inputs={"": {"image_rotary_emb": Split(0, required=False)}, "transformer_blocks.0": {"hidden_states": Split(1)}},
    outputs={"proj_out": {None: Gather(1)}},
    self_attention=("transformer_blocks.*.attn1",),
    processor=CogVideoXJointAttention,
    processor_classes=("CogVideoXAttnProcessor2_0",),
)
