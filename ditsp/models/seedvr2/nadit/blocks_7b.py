"""The NaDiT 7B block (reference ``models/dit``): what it does unlike the 3B block.

Shared with the 3B (:mod:`.blocks`): pre-norm RMSNorm without affine, AdaSingle
modulation in the stride-6 slot layout with no implicit +1, per-head q/k
RMSNorm, window attention over [window video ; replicated text] with the text
output averaged over all windows, the residual order.

Different here:
- every block has separate ``vid`` and ``txt`` modules for qkv, proj_out, the
  q/k norms, the MLP and AdaSingle (no shared ``all`` set);
- the MLP is ``proj_out(gelu_tanh(proj_in(x)))``, both linears with a bias,
  hidden width ``4 * dim`` (:class:`GeluTanhMLP`);
- RoPE is :class:`~.rope_pixel.PixelRope3d` (window-normalised positions, text unrotated);
- the last block runs the text stream like every other block: its text is
  modulated before attention, and the text output (gate, residual, MLP) is
  computed too. Since the model returns video only, the forward may skip that
  discarded text output (``txt_out=False``), which changes nothing in the video.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....attention.window import WindowPack
from .blocks import ATTN, MLP, MM, AdaSingle, WindowMMAttention, emb_slots, rms_norm
from .config import NaDiTConfig
from .rope_pixel import PixelRope3d
from .tokenwise import TokenLinear


class GeluTanhMLP(nn.Module):
    """``proj_out(gelu_tanh(proj_in(x)))`` with biases (the reference's "normal" MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in = TokenLinear(dim, hidden, bias=True)
        self.proj_out = TokenLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class NaMMSRBlock7B(nn.Module):
    """One 7B ``mmdit_sr`` block: separate vid/txt weights, GELU-tanh MLP, pixel RoPE, full text path."""

    def __init__(self, cfg: NaDiTConfig, index: int):
        super().__init__()
        self.last = index == cfg.num_layers - 1
        self.eps = cfg.norm_eps
        self.attn = WindowMMAttention(cfg, shared=False, rope=PixelRope3d(cfg.rope_dim, cfg.rope_max_freq))
        self.mlp = MM(lambda: GeluTanhMLP(cfg.vid_dim, cfg.mlp_hidden), shared=False)
        self.ada = MM(lambda: AdaSingle(cfg.vid_dim), shared=False)

    def forward(self, vid, txt, emb, pack: WindowPack, runtime, layer: int, txt_out: bool = True):
        """vid (N, D) local rows, txt (L, D) -> (vid, txt). ``txt_out=False`` (allowed for the last
        block, whose text output the model discards) returns the incoming text unchanged."""
        e = emb_slots(emb)
        ada_v, ada_t = self.ada["vid"], self.ada["txt"]
        a = ada_v.mod_in(rms_norm(vid, None, self.eps), e, ATTN)
        at = ada_t.mod_in(rms_norm(txt, None, self.eps), e, ATTN)  # modulated in the last block too
        a, at = self.attn(a, at, pack, runtime, layer, txt_out=txt_out)
        vid = ada_v.residual(vid, a, e, ATTN)
        m = ada_v.mod_in(rms_norm(vid, None, self.eps), e, MLP)
        vid = ada_v.residual(vid, self.mlp["vid"](m), e, MLP)
        if not txt_out:
            return vid, txt
        txt = ada_t.residual(txt, at, e, ATTN)
        m = ada_t.mod_in(rms_norm(txt, None, self.eps), e, MLP)
        txt = ada_t.residual(txt, self.mlp["txt"](m), e, MLP)
        return vid, txt
