"""Plan A: move activation rows from one window plan to another.

Each rank's rows are packed grouped by destination (each group already in
the destination's local order) and moved by :mod:`ditsp.distributed.transport`
(whole, or in chunks bounded by its capacity): rows that cross ranks go
through one variable-split all-to-all per chunk, rows that stay are gathered
into place while they fly, and received rows are scattered to their
dst-local positions (precomputed once per transition). Whether any row crosses ranks is read off the
global count matrix, so all ranks take the same branch; a rank that sends
and receives nothing still joins the collective. When ownership does not
change (always at SP=1) the change is a local permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import transport
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from .plan import Transition


@dataclass(frozen=True)
class RankIndices:
    """One rank's share of a transition, as torch index tensors (built once, cached)."""

    send_index: torch.Tensor  # src-local rows, in send order
    placement: transport.Placement  # received row j (peer order) -> dst-local position
    key: bytes  # the transport's agreement key: the global count matrix's digest
    input_splits: list[int]  # row r of the count matrix
    output_splits: list[int]  # column r of the count matrix
    local_perm: torch.Tensor | None  # src-local -> dst-local rows when nothing crosses ranks


def rank_indices(t: Transition, rank: int, device: torch.device | str = "cpu") -> RankIndices:
    """Index tensors of ``rank`` for transition ``t``, cached with the transition."""
    def make() -> RankIndices:
        send = torch.from_numpy(t.send_index(rank)).to(device)
        recv = torch.from_numpy(t.recv_order(rank)).to(device)
        inverse = torch.empty_like(recv)
        inverse[recv] = torch.arange(recv.numel(), dtype=recv.dtype, device=recv.device)
        return RankIndices(
            send_index=send,
            placement=transport.Placement(inverse),
            key=transport.matrix_key(t.counts),
            input_splits=[int(v) for v in t.counts[rank]],
            output_splits=[int(v) for v in t.counts[:, rank]],
            local_perm=None if t.exchange_required else send[recv],
        )

    return t.memo(("torch", rank, str(device)), make)


def exchange(x: torch.Tensor, t: Transition, link: Transport | Comm) -> torch.Tensor:
    """Rows of ``x`` (this rank's src-local activations) -> this rank's dst-local rows.

    ``link``: the caller's :class:`~ditsp.distributed.transport.Transport` (its settings and agreed
    plans); a bare Comm gets a fresh one (environment settings, agreed on this call).
    """
    link = Transport.of(link)
    comm = link.comm
    idx = rank_indices(t, comm.rank, x.device)
    if x.shape[0] != sum(idx.input_splits):
        raise ValueError(f"rank {comm.rank} holds {x.shape[0]} rows; the plan says {sum(idx.input_splits)}")
    if idx.local_perm is not None:  # same ownership: no collective on any rank
        return x.index_select(0, idx.local_perm)
    # Packed and placed by the transport: whole (off) or in chunks bounded by its capacity.
    return link.all_to_all(transport.Rows(x, idx.send_index), idx.input_splits, idx.output_splits,
                           "window_exchange", place=idx.placement, key=idx.key)
