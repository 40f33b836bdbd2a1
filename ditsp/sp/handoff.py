"""Hand activations between a model's SP runtime and another ownership of the same rows, directly.

A sharded VAE leaves each rank with a height slab of the latent; the DiT's
runtime wants whole windows of its first layout. Instead of gathering the
latent on every rank and scattering it again, one transition moves each
latent pixel row from the rank that encoded it to the rank whose window
holds its token (:func:`rows_to_tokens`), and at the end one transition moves
each output row back to the rank that decodes it (:func:`tokens_to_rows`).
Both work at the pixel level of the patched grid (see
:meth:`~ditsp.windows.ownership.RowOwnership.refine`), so slab boundaries need
not align with patches.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..distributed.transport import Transport
from ..windows.exchange import exchange
from ..windows.ownership import RowOwnership, ownership_transition


def rows_to_tokens(x_local: torch.Tensor, src: RowOwnership, tokens: RowOwnership, patch: Sequence[int],
                   link: Transport) -> torch.Tensor:
    """``(n_pixels, C)`` rows held as ``src`` -> this rank's ``(n_tokens, P*C)`` patched rows as ``tokens``.

    ``link``: the runtime's Transport."""
    dst = tokens.refine(patch)
    y = exchange(x_local, ownership_transition(src, dst), link)
    return y.reshape(-1, math.prod(patch) * x_local.shape[-1])


def tokens_to_rows(y_local: torch.Tensor, tokens: RowOwnership, dst: RowOwnership, patch: Sequence[int],
                   link: Transport) -> torch.Tensor:
    """This rank's ``(n_tokens, P*C)`` rows held as ``tokens`` -> ``(n_pixels, C)`` rows held as ``dst``."""
    P = math.prod(patch)
    src = tokens.refine(patch)
    return exchange(y_local.reshape(-1, y_local.shape[-1] // P), ownership_transition(src, dst), link)
