"""A small global-attention DiT block (MMDiT/Flux-style joint text) to test SP strategies end to end.

Everything but attention is tokenwise, so under SP each rank runs the block on
its own tokens (replicated text joined to its video shard) and only the
attention strategy talks to other ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def sdpa_attention(q, k, v, text_len: int = 0, joint: str = "front", seq_lens=None, scale=None):
    """Single-device attention over the whole joined sequence (token order does not matter: no mask)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


class GlobalDiTBlock(nn.Module):
    """Pre-norm block: QKV (GQA allowed), RMSNorm on q and k, global attention, MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, mlp_ratio: float = 4.0):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * self.head_dim)
        self.to_kv = nn.Linear(dim, 2 * self.kv_heads * self.head_dim)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.proj = nn.Linear(heads * self.head_dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))

    def forward(self, x, attn=sdpa_attention, text_len: int = 0, joint: str = "front", seq_lens=None):
        """``x`` [B, T+s, dim]: text (T rows, replicated) joined to this rank's video tokens."""
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q_norm(self.to_q(h).view(b, n, self.heads, self.head_dim))
        k, v = self.to_kv(h).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        o = attn(q, self.k_norm(k), v, text_len=text_len, joint=joint, seq_lens=seq_lens)
        x = x + self.proj(o.reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))
