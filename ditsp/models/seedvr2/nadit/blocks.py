"""The NaDiT 3B block (``mmdit_sr``): MM window attention, SwiGLU, AdaSingle.

Structure and quirks of the reference 3B block:
- every sub-module exists per stream (``vid``/``txt``) below ``mm_layers`` and
  as one shared ``all`` set above it;
- AdaSingle reads the time embedding in the stride-6 interleaved layout
  ``emb[6c + 3l + g]`` (l: attn/mlp, g: shift/scale/gate); the +1 of the
  scale lives inside the learned parameter, so there is no implicit +1;
- the last block leaves text unmodulated, skips the text MLP, and never
  needs text queries (its text output is discarded).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ....attention.window import WindowPack
from ....row_blocks import rows_per_block
from .config import NaDiTConfig
from .rope import MMRope3d, RopeBuffer
from .tokenwise import TokenLinear, mark_replicated_rows

ATTN, MLP = 0, 1  # AdaSingle layer slots


def attend(runtime, *args):
    """``runtime.attend``: outside any compiled graph (its collectives and per-window-shape loops run eager;
    ``compiled.compile_dit`` marks it, see RUNTIME_CALLS)."""
    return runtime.attend(*args)


def reduce_text(runtime, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
    """``runtime.reduce_text`` (one all-reduce): outside any compiled graph (see RUNTIME_CALLS)."""
    return runtime.reduce_text(txt_sum, layer)


# The calls into the SP runtime, where a compiled block's graph breaks. ``compiled.compile_dit`` wraps them
# with ``torch.compiler.disable`` when it first compiles: as decorators here they would load the compiler
# stack into every process that imports the model (1.3 s of each rank's start-up).
RUNTIME_CALLS = ("attend", "reduce_text")
SHIFT, SCALE, GATE = 0, 1, 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, accumulated in fp32 (as apex FusedRMSNorm).

    Without autograd the rows go through in cache-sized blocks (:mod:`ditsp.row_blocks`), each
    through one reused fp32 buffer: every op is per element or per row, so the bits are those of the whole
    tensor at once (a 5120 x 2560 bf16 norm: 54 -> 7 ms on one core). Autograd, CUDA and compiled
    graphs (which fuse the chain themselves) take the whole tensor at once."""
    if torch.is_grad_enabled() or x.dim() < 2 or x.device.type != "cpu" or torch.compiler.is_compiling():
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * weight.float() if weight is not None else y).to(x.dtype)
    rows = rows_per_block(4 * math.prod(x.shape[1:]))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    buf = torch.empty((min(rows, x.shape[0]),) + tuple(x.shape[1:]), dtype=torch.float32, device=x.device)
    wf = weight.float() if weight is not None else None
    for i in range(0, x.shape[0], rows):
        part = x[i:i + rows]
        b = buf[:part.shape[0]].copy_(part)
        b.mul_(torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + eps))
        if wf is not None:
            b.mul_(wf)
        out[i:i + rows].copy_(b)
    return out


def emb_slots(emb: torch.Tensor) -> torch.Tensor:
    """(6D,) time embedding -> (D, 2, 3) = (channel, attn|mlp, shift|scale|gate)."""
    return emb.view(-1, 2, 3)


class MM(nn.ModuleDict):
    """Per-stream modules: ``vid`` + ``txt``, or one ``all`` set when shared.

    ``vid_only`` drops the text module (the reference's last block, for ada and mlp). A ``txt``
    module sees the request's whole text on every rank, so its token linears run plain calls."""

    def __init__(self, make, shared: bool, vid_only: bool = False):
        names = ["all"] if shared else (["vid"] if vid_only else ["vid", "txt"])
        super().__init__({n: mark_replicated_rows(make()) if n == "txt" else make() for n in names})
        self.shared = shared

    def get(self, branch: str) -> nn.Module:
        return self["all"] if self.shared else self[branch]


class HeadNorm(nn.Module):
    """Per-head RMSNorm weight (head_dim,): the reference's qk ``fusedrms``."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class AdaSingle(nn.Module):
    """Learned shift/scale/gate per layer, added to the shared time embedding."""

    def __init__(self, dim: int, layers=("attn", "mlp")):
        super().__init__()
        self.layers = tuple(layers)
        for name in self.layers:
            self.register_parameter(f"{name}_shift", nn.Parameter(torch.zeros(dim)))
            self.register_parameter(f"{name}_scale", nn.Parameter(torch.ones(dim)))
            self.register_parameter(f"{name}_gate", nn.Parameter(torch.zeros(dim)))

    def mod_in(self, x: torch.Tensor, e: torch.Tensor, slot: int) -> torch.Tensor:
        name = self.layers[slot]
        scale = getattr(self, f"{name}_scale") + e[:, slot, SCALE]
        shift = getattr(self, f"{name}_shift") + e[:, slot, SHIFT]
        return (x * scale).add_(shift)  # the shift added in place to the fresh product: the same bits

    def residual(self, x: torch.Tensor, update: torch.Tensor, e: torch.Tensor, slot: int) -> torch.Tensor:
        """``x + update * gate``, the sum taken in place on the fresh product (the same bits)."""
        return (update * (getattr(self, f"{self.layers[slot]}_gate") + e[:, slot, GATE])).add_(x)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in_gate = TokenLinear(dim, hidden, bias=False)
        self.proj_in = TokenLinear(dim, hidden, bias=False)
        self.proj_out = TokenLinear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.proj_in_gate(x)
        if torch.is_grad_enabled():
            return self.proj_out(F.silu(gate) * self.proj_in(x))
        return self.proj_out(F.silu(gate, inplace=True).mul_(self.proj_in(x)))  # no new (rows, hidden) buffers


class WindowMMAttention(nn.Module):
    """Window attention of [video window, replicated text]; all heads stay on this rank.

    The family's RoPE comes in as ``rope`` (default: the 3B's :class:`MMRope3d`);
    it rotates video per window shape and decides what happens to text."""

    def __init__(self, cfg: NaDiTConfig, shared: bool, rope: RopeBuffer | None = None):
        super().__init__()
        d, inner = cfg.vid_dim, cfg.heads * cfg.head_dim
        self.heads, self.head_dim, self.eps = cfg.heads, cfg.head_dim, cfg.norm_eps
        self.proj_qkv = MM(lambda: TokenLinear(d, 3 * inner, bias=False), shared)
        self.proj_out = MM(lambda: TokenLinear(inner, d, bias=True), shared)
        self.norm_q = MM(lambda: HeadNorm(cfg.head_dim), shared)
        self.norm_k = MM(lambda: HeadNorm(cfg.head_dim), shared)
        self.rope = rope if rope is not None else MMRope3d(cfg.rope_dim, cfg.rope_theta)

    def _qkv(self, x: torch.Tensor, branch: str):
        q, k, v = self.proj_qkv.get(branch)(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q = rms_norm(q, self.norm_q.get(branch).weight, self.eps)
        k = rms_norm(k, self.norm_k.get(branch).weight, self.eps)
        return q, k, v

    def forward(self, vid, txt, pack: WindowPack, runtime, layer: int, txt_out: bool = True):
        """vid (N, D) local rows, txt (L, D) -> (vid out, text out or None)."""
        q, k, v = self._qkv(vid, "vid")
        tq, tk, tv = self._qkv(txt, "txt")
        tq, tk = self.rope.text(tq), self.rope.text(tk)
        L = txt.shape[0]
        out, tsum = attend(runtime, q, k, v, tq if txt_out else None, tk, tv, pack,
                           lambda x, shape: self.rope.video(x, shape, L))
        vid = self.proj_out.get("vid")(out.flatten(1))
        if not txt_out:
            return vid, None
        # Plain mean over all windows (the runtime sums across ranks), then proj_out.
        tmean = reduce_text(runtime, tsum.to(runtime.dtype), layer).to(txt.dtype)
        return vid, self.proj_out.get("txt")(tmean.flatten(1))


class NaMMSRBlock(nn.Module):
    """One ``mmdit_sr`` block; ``last`` reproduces the reference's vid-only tail."""

    def __init__(self, cfg: NaDiTConfig, index: int):
        super().__init__()
        shared = not cfg.separate_weights(index)
        self.last = index == cfg.num_layers - 1
        self.eps = cfg.norm_eps
        self.attn = WindowMMAttention(cfg, shared)
        self.mlp = MM(lambda: SwiGLU(cfg.vid_dim, cfg.mlp_hidden), shared, vid_only=self.last)
        self.ada = MM(lambda: AdaSingle(cfg.vid_dim), shared, vid_only=self.last)

    def forward(self, vid, txt, emb, pack: WindowPack, runtime, layer: int, txt_out: bool = True):
        """``txt_out`` is ignored: the 3B's last block has no text tail to compute."""
        e = emb_slots(emb)
        ada_v = self.ada.get("vid")
        a = ada_v.mod_in(rms_norm(vid, None, self.eps), e, ATTN)
        at = rms_norm(txt, None, self.eps)
        if not self.last:
            at = self.ada.get("txt").mod_in(at, e, ATTN)
        a, at = self.attn(a, at, pack, runtime, layer, txt_out=not self.last)
        vid = ada_v.residual(vid, a, e, ATTN)
        m = ada_v.mod_in(rms_norm(vid, None, self.eps), e, MLP)
        vid = ada_v.residual(vid, self.mlp.get("vid")(m), e, MLP)
        if self.last:  # text output discarded by the reference: leave it as it came in
            return vid, txt
        ada_t = self.ada.get("txt")
        txt = ada_t.residual(txt, at, e, ATTN)
        m = ada_t.mod_in(rms_norm(txt, None, self.eps), e, MLP)
        txt = ada_t.residual(txt, self.mlp.get("txt")(m), e, MLP)
        return vid, txt
