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

from ....fixed_shape import linear_rows


class TokenLinear(nn.Linear):
    """``nn.Linear`` on token rows in fixed-shape GEMM tiles (see :mod:`ditsp.fixed_shape`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)
