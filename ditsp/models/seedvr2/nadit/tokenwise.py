"""Tokenwise linears whose per-row result does not depend on how many rows share the call.

Under SP a rank projects only its own rows, so the row count ``M`` of every
tokenwise GEMM changes with the SP degree and the plan. On the CPU BLAS this
package is tested with (MKL sgemm, fp32), a row's result is the same for every
``M`` that is a multiple of 4, but a call with ``M % 4 != 0`` rows may take a
different kernel for some rows: at one thread the rows of a 1-3 row call
differ in the last bit from the same rows inside a larger call; at 2 threads
the per-thread share can be short, so calls of 5-7 and 9-11 rows differ too.
(bf16 matched at every ``M`` measured; see ``docs/determinism.md``.)

:class:`TokenLinear` (an ``nn.Linear`` with the same parameters and state-dict
keys, used for every linear of the NaDiT that runs on token rows) therefore
never hands the BLAS a row count that is not a multiple of 4: the first
``M - M % 4`` rows go in one call written straight into the output, and the
last ``M % 4`` rows are taken from a call on the last 4 rows (zero-padded when
``M < 4``). The extra work is one 4-row GEMM per call; no activation-sized
copy is made, and module hooks see the whole input and output as usual.
:func:`row_guard` switches it off (for the invariance benchmark only).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROW_BLOCK = 4
_enabled = True


@contextmanager
def row_guard(enabled: bool):
    """Turn the row-count guard on or off inside the block (benchmarks; not thread-safe)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2D token rows ``x`` (M, K), in calls of a multiple of 4 rows."""
    m = x.shape[0]
    tail = m % ROW_BLOCK
    if not _enabled or tail == 0 or x.dim() != 2:
        return F.linear(x, weight, bias)
    if m < ROW_BLOCK:
        return F.linear(torch.cat([x, x.new_zeros(ROW_BLOCK - m, x.shape[1])]), weight, bias)[:m]
    head = m - tail
    last = F.linear(x[m - ROW_BLOCK :], weight, bias)[ROW_BLOCK - tail :]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # out= has no autograd
        return torch.cat([F.linear(x[:head], weight, bias), last])
    out = x.new_empty(m, weight.shape[0])
    if bias is None:
        torch.mm(x[:head], weight.t(), out=out[:head])
    else:
        torch.addmm(bias, x[:head], weight.t(), out=out[:head])
    out[head:] = last
    return out


class TokenLinear(nn.Linear):
    """``nn.Linear`` on token rows whose per-row result does not depend on the row count (see module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)
