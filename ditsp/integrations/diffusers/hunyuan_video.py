"""HunyuanVideo (``HunyuanVideoTransformer3DModel``, text-to-video) under ditsp SP: joint text behind the video.

The RoPE tables (built from the latent before patch embedding) and the
patch-embedded video tokens are sharded; text (after the token refiner,
whose own attention over the text stays local) is replicated and joined
*behind* the local video tokens in every attention, taken by ditsp's
attention as rear joint text. The output projection is gathered.

Text padding: the model masks padded text tokens as keys. Here they are left
out of attention (their rows get zeros): a padded token is never a key and
the text stream is dropped at the end, so nothing they compute reaches the
output or any gradient. One effective text length per batch is required.
"""

from __future__ import annotations

import torch

from .flux import rotate
from .hooks import Gather, ParallelizeError, Plan, Split


class HunyuanJointAttention:
    """Processor of a HunyuanVideo attention (double-stream: added text projections; single-stream: shared)."""

    def __init__(self, runtime, module, path: str):
        self.runtime, self.path = runtime, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if encoder_hidden_states is None:
            raise ParallelizeError(f"{self.path}: ditsp's HunyuanVideo attention expects the text stream")
        rt = self.runtime
        s, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
        joint = attn.add_q_proj is None  # single-stream: one set of projections over [video; text]
        x = torch.cat([hidden_states, encoder_hidden_states], 1) if joint else hidden_states
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (attn.to_q(x), attn.to_k(x), attn.to_v(x)))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = torch.cat([rotate(q[:, :s], *image_rotary_emb), q[:, s:]], 1)
            k = torch.cat([rotate(k[:, :s], *image_rotary_emb), k[:, s:]], 1)
        if not joint:
            e = encoder_hidden_states
            eq, ek, ev = (t.unflatten(2, (attn.heads, -1))
                          for t in (attn.add_q_proj(e), attn.add_k_proj(e), attn.add_v_proj(e)))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], 1), torch.cat([k, ek], 1), torch.cat([v, ev], 1)
        valid = text
        if attention_mask is not None:  # [B, 1, 1, s + text]: True for video and the unpadded text
            counts = {int(n) - s for n in attention_mask.reshape(attention_mask.shape[0], -1).sum(-1)}
            if len(counts) != 1:
                raise ParallelizeError(f"{self.path}: text lengths differ across the batch ({sorted(counts)}); "
                                       "run one prompt length per batch")
            valid = counts.pop()
        n = s + valid
        out = rt.attention(q[:, :n], k[:, :n], v[:, :n], text_len=valid, joint="rear", seq_lens=rt.lens)
        if valid < text:
            out = torch.cat([out, out.new_zeros(out.shape[0], text - valid, *out.shape[2:])], 1)
        out = out.flatten(2, 3).to(q.dtype)
        video, txt = out[:, :s], out[:, s:]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            txt = attn.to_add_out(txt)
        return video, txt


def _check(model) -> str | None:
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        return "image_condition_type 'token_replace' modulates the first frame's tokens by position (not supported)"
    return None


PLAN = Plan(
    family="HunyuanVideoTransformer3DModel",
    outputs={"rope": {0: Split(0), 1: Split(0)}, "x_embedder": {None: Split(1)}, "proj_out": {None: Gather(1)}},
    self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    local_attention=("context_embedder.*",),
    processor=HunyuanJointAttention,
    processor_classes=("HunyuanVideoAttnProcessor2_0",),
    check=_check,
)
