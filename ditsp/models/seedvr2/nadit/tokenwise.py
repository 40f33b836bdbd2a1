"""Tokenwise linears whose per-row result does not depend on the SP degree.

Under SP a rank projects only its own rows, so a plain GEMM's row count would
follow the SP degree and the plan, and on some BLAS builds a row's bits follow
the row count. :class:`TokenLinear` (an ``nn.Linear`` with the same parameters
and state-dict keys, used for every NaDiT linear that runs on token rows) hands
the BLAS fixed-shape tiles instead (:func:`ditsp.fixed_shape.linear_rows`,
under the policy of the running forward).
"""

from __future__ import annotations

import torch
from torch import nn

from ....fixed_shape import linear_rows, plain_linear


class TokenLinear(nn.Linear):
    """``nn.Linear`` on token rows in fixed-shape GEMM tiles (see :mod:`ditsp.fixed_shape`).

    ``replicated_rows``: the layer only ever sees rows that every rank holds whole (a request's
    text stream), so its call already has the same shape at every SP degree and runs as one
    plain GEMM; tiling would pad a 64-row text to a 768-row tile.
    """

    replicated_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replicated_rows or torch.compiler.is_compiling():  # compiled: plain calls (models/seedvr2/compiled.py)
            return plain_linear(x, self.weight, self.bias)
        return linear_rows(x, self.weight, self.bias)


def mark_replicated_rows(module: nn.Module) -> nn.Module:
    """Mark every :class:`TokenLinear` inside ``module`` as seeing replicated rows only."""
    for m in module.modules():
        if isinstance(m, TokenLinear):
            m.replicated_rows = True
    return module
