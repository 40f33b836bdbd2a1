"""Start ranks: join a ``torchrun`` job, or spawn N gloo ranks on this machine.

:class:`LocalCluster` keeps N spawned ranks alive and runs functions on all of
them, so tests and benchmarks pay the start-up once. Every call has a
deadline: a rank that raises or hangs ends the call with its traceback
(:class:`RankError`), and the cluster is torn down instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


@dataclass(frozen=True)
class RankContext:
    """What a function run on a rank receives: its rank and the SP group handle."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup
    device: torch.device


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> RankContext:
    """Join the job ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR...).

    NCCL when CUDA is available, else gloo. The returned group is WORLD, passed
    on explicitly; build sub-groups with :mod:`ditsp.config`.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("init_from_env needs torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables")
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device("cpu")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, threads: int, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        ctx = RankContext(rank, world, dist.group.WORLD, torch.device("cpu"))
        results.put((rank, -1, True, None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        results.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        call_id, fn, args, kwargs = item
        try:
            out = fn(ctx, *args, **kwargs)
            results.put((rank, call_id, True, out))
        except BaseException:  # noqa: BLE001
            results.put((rank, call_id, False, traceback.format_exc()))
    dist.destroy_process_group()


class LocalCluster:
    """N gloo ranks on this machine, reused across calls.

    ``timeout_s`` bounds every call (and every collective inside it, through
    the process group's timeout); ``threads`` is each rank's compute threads.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, threads: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.threads = threads
        self._procs: list = []
        self._calls = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.timeout_s, self.threads, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(-1, time.monotonic() + max(60.0, self.timeout_s), "start-up")

    def _collect(self, call_id: int, deadline: float, what: str) -> list:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        grace = None  # once a rank failed, peers get a few seconds to report theirs
        while len(out) + len(errors) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace is None else min(deadline, grace)
            if now >= limit:
                break
            try:
                rank, cid, ok, payload = self._results.get(timeout=min(limit - now, 0.5))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if not p.is_alive() and r not in out and r not in errors:
                        errors[r] = f"rank {r} died (exit code {p.exitcode})"
                if errors and grace is None:
                    grace = time.monotonic() + 5.0
                continue
            if cid != call_id:
                continue  # a late answer from an earlier, failed call
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
                grace = grace or time.monotonic() + 5.0
        if errors or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in errors]
            self.close(force=True)
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"ranks {missing} did not answer within the deadline of {what}")
            raise RankError(f"{what} failed on {self.world_size} ranks:\n" + "\n".join(parts))
        return [out[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; the per-rank results in rank order.

        ``fn`` must be importable by name (a module-level function).
        """
        if not self.alive:
            self.close(force=True)
            self._start()
        self._calls += 1
        for q in self._tasks:
            q.put((self._calls, fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        return self._collect(self._calls, deadline, getattr(fn, "__name__", "call"))

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(fn: Callable, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1, **kwargs) -> list:
    """Spawn ``world_size`` local gloo ranks, run ``fn(ctx, *args)`` once, return per-rank results."""
    with LocalCluster(world_size, timeout_s=timeout_s, threads=threads) as cluster:
        return cluster.run(fn, *args, **kwargs)
