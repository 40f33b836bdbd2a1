"""Flux.1 (``FluxTransformer2DModel``): a joint-text image DiT under ditsp SP.

The packed image tokens and their position ids (``img_ids``) are sharded at
the model's input, so the RoPE tables the model builds from
``cat(txt_ids, img_ids)`` already hold the replicated text rows followed by
this rank's image rows. Text stays replicated: the double-stream blocks join
it in front of the local image tokens inside attention, the single-stream
blocks carry it in front of their hidden states; either way ditsp's
attention takes it as joint text (``text_len`` rows in front), attends it
once per rank and returns the same text output on every rank. The output
projection (image tokens only) is gathered.
"""

from __future__ import annotations

import torch

from .hooks import Gather, ParallelizeError, Plan, Refuse, Split


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's RoPE on ``[B, L, H, D]`` with real tables ``[L, D]`` (pairs interleaved), in fp32, cast back."""
    re, im = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-im, re], -1).flatten(3)
    return (x.float() * cos[None, :, None] + turned.float() * sin[None, :, None]).to(x.dtype)


class FluxJointAttention:
    """Processor of a Flux attention module (double- or single-stream) running ditsp's joint-text attention."""

    def __init__(self, runtime, module, path: str):
        self.runtime, self.path = runtime, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs):
        if attention_mask is not None:
            raise ParallelizeError(f"{self.path}: ditsp's Flux attention takes no attention mask")
        fused = getattr(attn, "fused_projections", False)
        if fused:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        rt = self.runtime
        if encoder_hidden_states is not None:  # double-stream: the text's own projections, joined in front
            e = encoder_hidden_states
            if fused:
                eq, ek, ev = attn.to_added_qkv(e).chunk(3, dim=-1)
            else:
                eq, ek, ev = attn.add_q_proj(e), attn.add_k_proj(e), attn.add_v_proj(e)
            eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            text = e.shape[1]
            q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        else:  # single-stream: the hidden states already are [text; local image tokens]
            text = hidden_states.shape[1] - rt.lens[rt.comm.rank]
        if image_rotary_emb is not None:
            q, k = rotate(q, *image_rotary_emb), rotate(k, *image_rotary_emb)
        out = rt.attention(q, k, v, text_len=text, joint="front", seq_lens=rt.lens)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        e_out, out = out[:, :text], out[:, text:]
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(e_out.contiguous())


_CONTROLNET = "ControlNet residuals are full-sequence tensors; ditsp does not shard them"

PLAN = Plan(
    family="FluxTransformer2DModel",
    inputs={"": {"hidden_states": Split(1), "img_ids": Split(0, ndim=2, required=True),
                 "controlnet_block_samples": Refuse(_CONTROLNET),
                 "controlnet_single_block_samples": Refuse(_CONTROLNET)}},
    outputs={"proj_out": {None: Gather(1)}},
    self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    processor=FluxJointAttention,
    processor_classes=("FluxAttnProcessor",),
)
