"""Counted collectives on an explicit process group.

Every parallel path talks to the network through a :class:`Comm`: it holds
the SP group handle (never an implicit WORLD) and counts, per kind of
collective, the calls and the bytes this rank sent to and received from
other ranks (a rank's own segment is not traffic). The counts are exact and
deterministic, so tests compare them with planned figures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from . import shm_gather
from .heartbeat import beat


@dataclass
class KindStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0


@dataclass
class CommStats:
    """Per-kind counts of one rank's collectives."""

    kinds: dict = field(default_factory=lambda: defaultdict(KindStats))

    def add(self, kind: str, sent: int, recv: int) -> None:
        beat()  # a collective went through: this rank is not stuck
        k = self.kinds[kind]
        k.calls += 1
        k.bytes_sent += int(sent)
        k.bytes_recv += int(recv)

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kinds.values())

    @property
    def bytes_sent(self) -> int:
        return sum(k.bytes_sent for k in self.kinds.values())

    @property
    def bytes_recv(self) -> int:
        return sum(k.bytes_recv for k in self.kinds.values())

    def as_dict(self) -> dict:
        return {
            name: {"calls": k.calls, "bytes_sent": k.bytes_sent, "bytes_recv": k.bytes_recv}
            for name, k in sorted(self.kinds.items())
        }

    def reset(self) -> None:
        self.kinds.clear()


class _Left:
    """The group of a :class:`Comm` whose rank left it (:meth:`Comm.leave`): no collective runs on it."""

    def __repr__(self) -> str:
        return "<a process group this rank left>"


LEFT = _Left()


def _nbytes_rows(t: torch.Tensor, rows: int) -> int:
    return rows * math.prod(t.shape[1:]) * t.element_size()


class Comm:
    """An SP process group plus counters. ``group`` must be given explicitly."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None):
        if group is None:
            if dist.is_initialized():
                raise ValueError("Comm needs an explicit process group (pass the SP group, not None)")
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.stats = stats or CommStats()
        self._shm, self._cpu_gathers = None, 0  # the shared-memory all-gather: undecided, CPU all-gathers so far

    @classmethod
    def single(cls, stats: CommStats | None = None) -> "Comm":
        """A one-rank Comm without a process group (single device)."""
        obj = cls.__new__(cls)
        obj.group, obj.rank, obj.world_size, obj.stats = None, 0, 1, stats or CommStats()
        obj._shm, obj._cpu_gathers = False, 0  # one rank gathers nothing
        return obj

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> "Comm":
        """The Comm of ``group``; ``None`` (or a one-rank group) is the single-device Comm; a Comm is itself
        (``stats`` must then be None: the Comm keeps its own counters)."""
        if isinstance(group, Comm):
            if stats is not None and stats is not group.stats:
                raise ValueError("Comm.of(comm, stats): a Comm keeps its own counters")
            return group
        if group is None or dist.get_world_size(group) == 1:
            return cls.single(stats)
        return cls(group, stats)

    @property
    def wire_device(self) -> str:
        """Where this group's collectives take their tensors: ``"cuda"`` for NCCL, else ``"cpu"``."""
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return "cuda"
        return "cpu"

    def leave(self) -> None:
        """This rank takes no further part in the group, so that no peer waits for it: a peer's pending or later
        collective with it fails now rather than at the group's timeout. gloo: the process group is destroyed
        and this Comm drops it, so its connections close as soon as nothing else holds it (a failed call's
        traceback frames may: clear them); NCCL: aborted first; the shared-memory all-gather: flagged
        (:meth:`.shm_gather.ShmGather.leave`). The Comm runs no collective afterwards."""
        if self.group is None or self.group is LEFT:
            return
        pg, self.group = self.group, LEFT
        if self._shm:
            self._shm.leave()
        self._shm = False
        if dist.get_backend(pg) == "nccl":
            pg.abort()
        dist.destroy_process_group(pg)

    # -- collectives ---------------------------------------------------------

    def all_to_all_single(
        self,
        inp: torch.Tensor,
        input_splits: Sequence[int],
        output_splits: Sequence[int],
        kind: str = "all_to_all",
    ) -> torch.Tensor:
        """Variable-split all-to-all along dim 0; splits are row counts per peer."""
        input_splits = [int(s) for s in input_splits]
        output_splits = [int(s) for s in output_splits]
        out = inp.new_empty((sum(output_splits),) + tuple(inp.shape[1:]))
        if self.world_size == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp.contiguous(), output_splits, input_splits, group=self.group)
        sent = sum(input_splits) - input_splits[self.rank]
        recv = sum(output_splits) - output_splits[self.rank]
        self.stats.add(kind, _nbytes_rows(inp, sent), _nbytes_rows(inp, recv))
        return out

    def all_reduce(self, t: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        """In-place SUM all-reduce. Counted as the payload, sent and received once."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            self.stats.add(kind, t.numel() * t.element_size(), t.numel() * t.element_size())
        return t

    def all_reduce_ordered(self, t: torch.Tensor, kind: str = "all_reduce_ordered") -> torch.Tensor:
        """SUM over ranks added in rank order (r0 + r1 + ...), the same bits on every rank and every run.

        An all-gather and a local left-to-right sum: a backend's all-reduce may add in any order."""
        if self.world_size == 1:
            return t
        flat = t.contiguous()
        outs = self._all_gather(flat)
        nbytes = flat.numel() * flat.element_size()
        self.stats.add(kind, nbytes * (self.world_size - 1), nbytes * (self.world_size - 1))
        total = outs[0].clone()
        for o in outs[1:]:
            total += o
        return total

    def all_gather_rows(self, t: torch.Tensor, rows: Sequence[int], kind: str = "all_gather") -> list[torch.Tensor]:
        """Gather tensors of ``rows[r]`` rows from every rank (uneven sizes allowed)."""
        rows = [int(r) for r in rows]
        if t.shape[0] != rows[self.rank]:
            raise ValueError(f"rank {self.rank} holds {t.shape[0]} rows, expected {rows[self.rank]}")
        if self.world_size == 1:
            return [t]
        # Pad to the largest share so a plain all_gather serves uneven shares (even shares go as they are).
        width = max(rows)
        padded = t.contiguous()
        if t.shape[0] < width:
            padded = t.new_zeros((width,) + tuple(t.shape[1:]))
            padded[: t.shape[0]] = t
        outs = self._all_gather(padded)
        others = sum(rows) - rows[self.rank]
        self.stats.add(kind, _nbytes_rows(t, rows[self.rank] * (self.world_size - 1)), _nbytes_rows(t, others))
        return [o[:n] for o, n in zip(outs, rows)]

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contiguous ``t`` (same shape everywhere): through shared memory where the group's ranks
        share this machine's CPU (:mod:`.shm_gather`), else the backend's all-gather."""
        shm = self._shm_gather() if t.device.type == "cpu" else None
        if shm is not None and shm.fits(t.numel() * t.element_size()):
            return shm.all_gather(t)
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(outs, t, group=self.group)
        return outs

    def _shm_gather(self) -> "shm_gather.ShmGather | None":
        """This Comm's shared-memory all-gather, set up (collectively) at its :data:`~.shm_gather.AFTER_CALLS`-th
        CPU all-gather; every rank counts the same calls, so all set it up at the same one."""
        if self._shm is None:
            self._cpu_gathers += 1
            if self._cpu_gathers <= shm_gather.AFTER_CALLS:
                return None
            self._shm = shm_gather.open_for(self.group) or False
        return self._shm or None

    def reduce_scatter_rows(self, full: torch.Tensor, rows: Sequence[int], kind: str = "reduce_scatter") -> torch.Tensor:
        """Sum over ranks of ``full[my rows]``: every rank holds a full partial (``sum(rows)`` rows) and gets
        its own ``rows[rank]`` rows summed in rank order (the backward of :meth:`all_gather_rows`).

        One all-to-all of the partials, since gloo has no reduce-scatter: it is a reduction, not a row
        exchange, so it is the group's primitive here rather than the transport's."""
        rows = [int(r) for r in rows]
        me, n = self.rank, self.world_size
        recv = self.all_to_all_single(full.contiguous(), rows, [rows[me]] * n, kind=kind)
        return recv.view(n, rows[me], *full.shape[1:]).sum(0)

    def broadcast(self, t: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        """``t`` from group rank ``src`` to every rank, in place (receivers pass a buffer of the same shape)."""
        if self.world_size > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, src), group=self.group)
            n = t.numel() * t.element_size()
            self.stats.add(kind, n * (self.world_size - 1) if self.rank == src else 0, 0 if self.rank == src else n)
        return t

    def broadcast_object(self, obj, src: int):
        """A small Python object from group rank ``src`` (what receivers pass is ignored)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        self.stats.add("broadcast_object", 0, 0)
        return box[0]

    def barrier(self) -> None:
        """Every rank of the group reaches this point."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
            self.stats.add("barrier", 0, 0)

    def all_gather_object(self, obj) -> list:
        """Small Python objects from every rank (agreement checks)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        self.stats.add("all_gather_object", 0, 0)
        return out

    def batch_isend_irecv(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                          kind: str = "p2p"):
        """Post sends and receives (peer ranks are group ranks); returns the requests."""
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, p), self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, p), self.group) for t, p in recvs]
        reqs = dist.batch_isend_irecv(ops) if ops else []
        self.stats.add(
            kind, sum(t.numel() * t.element_size() for t, _ in sends), sum(t.numel() * t.element_size() for t, _ in recvs)
        )
        return reqs

    # -- transport helpers (ditsp.distributed.transport) --------------------------------

    def all_to_all_single_async(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        kind: str = "all_to_all",
    ):
        """Post a variable-split all-to-all into ``out`` (contiguous); returns the work handle to ``wait()``.

        Counted like :meth:`all_to_all_single` (one call, the bytes that cross ranks). One rank: a copy
        and ``None``.
        """
        input_splits = [int(s) for s in input_splits]
        output_splits = [int(s) for s in output_splits]
        work = None
        if self.world_size == 1:
            out.copy_(inp)
        else:
            work = dist.all_to_all_single(out, inp, output_splits, input_splits, group=self.group, async_op=True)
        sent = sum(input_splits) - input_splits[self.rank]
        recv = sum(output_splits) - output_splits[self.rank]
        self.stats.add(kind, _nbytes_rows(inp, sent), _nbytes_rows(inp, recv))
        return work

    def all_gather_ints(self, values: Sequence[int], kind: str = "transport_agree") -> list[list[int]]:
        """Every rank's list of ``len(values)`` int64 (the same length on every rank): one small all-gather."""
        if self.world_size == 1:
            return [[int(v) for v in values]]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        outs = self._all_gather(t)
        nbytes = t.numel() * t.element_size()
        self.stats.add(kind, nbytes * (self.world_size - 1), nbytes * (self.world_size - 1))
        return [o.tolist() for o in outs]

    def staging(self, delta: int) -> None:
        """Transport staging bytes: ``delta`` more (or fewer, when negative) are live; keeps the peak."""
        live = getattr(self, "_staging_live", 0) + int(delta)
        self._staging_live = live
        self._staging_peak = max(getattr(self, "_staging_peak", 0), live)

    def staging_peak(self, reset: bool = False) -> int:
        """The most transport staging bytes live at once on this rank (since the last reset)."""
        peak = getattr(self, "_staging_peak", 0)
        if reset:
            self._staging_peak = getattr(self, "_staging_live", 0)
        return peak
