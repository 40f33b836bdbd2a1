"""CPU stand-in for the one flash-attn entry point the SeedVR reference imports.

``flash_attn_varlen_func`` gets packed q, k, v of shape (total, heads, dim) and the cumulative
segment offsets; each segment (one attention window, or one sample) attends only to itself. Here
every segment is one call of ``torch.nn.functional.scaled_dot_product_attention`` on its slice,
and the outputs are packed back in the same order. Non-causal only (the reference never asks for
causal), no dropout; the softmax scale defaults to 1/sqrt(dim) as in flash-attn.
"""

import torch
import torch.nn.functional as F

__version__ = "cpu-shim"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, **_ignored):
    if causal or dropout_p:
        raise NotImplementedError("the CPU shim implements non-causal attention without dropout only")
    bq = [int(x) for x in cu_seqlens_q.tolist()]
    bk = [int(x) for x in cu_seqlens_k.tolist()]
    outs = []
    for i in range(len(bq) - 1):
        # (L, h, d) -> (1, h, L, d): 4-D inputs, so SDPA takes torch's fused CPU kernel (3-D ones fall
        # back to the unfused math path)
        qs = q[bq[i]:bq[i + 1]].transpose(0, 1)[None]
        ks = k[bk[i]:bk[i + 1]].transpose(0, 1)[None]
        vs = v[bk[i]:bk[i + 1]].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=softmax_scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
