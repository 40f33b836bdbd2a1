"""A worker's membership of an elastic SP group: formed per generation, dropped when a peer is lost.

The server hosts one TCPStore on 127.0.0.1; every group *generation*
rendezvouses under its own key prefix (``ditsp-gen<g>/``), so a new group
never sees a dead one's keys. Forming a group is: destroy the old default
process group (if any), then ``init_process_group`` over a
:class:`~torch.distributed.PrefixStore` with the new rank and world size. A
one-rank group needs no process group at all.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from .comm import Comm, CommStats
from .launcher import LOOPBACK, RankContext

STORE_PREFIX = "ditsp-gen"


class ElasticGroup:
    """One worker's view of its current group: joined per generation, dropped when a peer is lost."""

    def __init__(self, port: int, timeout_s: float):
        self.port, self.timeout_s = port, timeout_s
        self.store = None
        self.rank, self.world, self.gen = 0, 1, -1

    def drop(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group still has to go
                pass

    def form(self, gen: int, rank: int, world: int) -> dict:
        t0 = time.perf_counter()
        self.drop()
        self.rank, self.world, self.gen = rank, world, gen
        if world > 1:
            if self.store is None:
                self.store = dist.TCPStore(LOOPBACK, self.port, None, False,
                                           datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
            prefixed = dist.PrefixStore(f"{STORE_PREFIX}{gen}/", self.store)
            dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
            dist.barrier()
        return {"form_s": time.perf_counter() - t0, "gen": gen, "rank": rank, "world": world}

    def comm(self, stats: CommStats | None = None) -> Comm:
        """The counted collectives of the current group (the single-device Comm for one rank)."""
        return Comm.of(dist.group.WORLD if self.world > 1 else None, stats)

    def context(self):
        group = dist.group.WORLD if self.world > 1 else None
        return RankContext(self.rank, self.world, group, torch.device("cpu"))
