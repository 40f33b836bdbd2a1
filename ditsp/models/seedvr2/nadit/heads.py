"""Output heads: what sits between the last block's video state and ``vid_out.proj``.

The head's parameters are top-level model attributes (their checkpoint keys
have no prefix), so a head is a small strategy object that adds them to the
model and applies them.

- :class:`NormAdaHead` (3B): RMSNorm with a weight (``vid_out_norm``), then a
  modulation whose shift/scale are the time embedding's *attention* slot plus
  the learned ``vid_out_ada.out_shift``/``out_scale`` (no gate).
- :class:`PlainHead` (7B): nothing; ``vid_out.proj`` reads the last block's
  video state directly.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import ATTN, SCALE, SHIFT, emb_slots, rms_norm


class OutAda(nn.Module):
    """``vid_out_ada``: only ``out_shift``/``out_scale`` (no gate)."""

    def __init__(self, dim: int):
        super().__init__()
        self.out_shift = nn.Parameter(torch.zeros(dim))
        self.out_scale = nn.Parameter(torch.ones(dim))


class RMSNormWeight(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class NormAdaHead:
    """The 3B head: ``vid_out_norm`` + ``vid_out_ada`` (attention slot of the time embedding)."""

    @staticmethod
    def install(model: nn.Module, dim: int) -> None:
        model.vid_out_norm = RMSNormWeight(dim)
        model.vid_out_ada = OutAda(dim)

    @staticmethod
    def apply(model: nn.Module, x: torch.Tensor, emb: torch.Tensor, eps: float) -> torch.Tensor:
        e = emb_slots(emb)
        y = rms_norm(x, model.vid_out_norm.weight, eps)
        return y * (e[:, ATTN, SCALE] + model.vid_out_ada.out_scale) + (e[:, ATTN, SHIFT] + model.vid_out_ada.out_shift)


class PlainHead:
    """The 7B head: no norm, no modulation."""

    @staticmethod
    def install(model: nn.Module, dim: int) -> None:
        pass

    @staticmethod
    def apply(model: nn.Module, x: torch.Tensor, emb: torch.Tensor, eps: float) -> torch.Tensor:
        return x
