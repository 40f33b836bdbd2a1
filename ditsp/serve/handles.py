"""The server's side of the worker processes: a handle on each (start, command, stop), and one command to
several at once with the stuck-worker check (:func:`call`). What a worker runs is :mod:`.workers`; how it
starts, :mod:`.boot`."""

from __future__ import annotations

import multiprocessing.connection
import os
import time

import torch.multiprocessing as mp

from ..cpu import malloc as cpu_malloc
from .boot import worker_entry
from .workers import PEER_LOST_SIGNAL


class Worker:
    """One persistent worker process, spawned (a fresh interpreter) and started by :func:`.boot.worker_entry`."""

    def __init__(self, index: int, port: int, timeout_s: float = 60.0, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.index = index
        self.tasks = ctx.Queue()
        reader, writer = ctx.Pipe(duplex=False)
        self.answers = reader
        self.progress = ctx.Array("l", 2, lock=False)
        self.beats = ctx.Array("Q", 1, lock=False)
        self.proc = ctx.Process(target=worker_entry, name=f"ditsp-serve-worker-{index}", daemon=True,
                                args=(os.getpid(), index, port, timeout_s, threads, self.tasks, writer, self.progress,
                                      self.beats))
        with cpu_malloc.for_new_processes():
            self.proc.start()
        writer.close()
        self.ready = False
        self._ids = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """True once the process has started and answered its hello."""
        if not self.ready and self.answers.poll(timeout):
            try:
                cid, ok, _ = self.answers.recv()
            except (EOFError, OSError):  # it ended before its hello: the controller's reaper replaces it
                return False
            self.ready = ok and cid == 0
        return self.ready

    def send(self, name: str, payload: dict | None = None) -> int:
        self._ids += 1
        self.tasks.put((self._ids, name, payload or {}))
        return self._ids

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.tasks.put(None)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(timeout=3)
        self.kill()


def call(workers: list[Worker], name: str, payloads: list[dict], timeout_s: float,
         on_wait=None, interrupt: bool = False) -> tuple[dict, dict, list[Worker]]:
    """Send one command to each worker and collect the answers.

    Returns ``(results, errors, dead)``: answers by worker index, error texts
    by worker index, and the workers that died meanwhile. Once a worker dies or
    fails, the others get a short grace to answer (a survivor blocked in a
    collective with the dead one fails soon after); with ``interrupt`` they
    are told at once (:data:`PEER_LOST_SIGNAL`), so they stop their job
    instead of computing until their next collective fails. ``timeout_s`` is a
    stuck-worker check: a worker that has answered nothing and whose heartbeat
    (collectives, pipeline stages) has not moved for that long is stuck; a long
    job that progresses is not. ``on_wait()`` is called about twice a second
    while waiting (progress, cancellation).
    """
    ids = {w.index: w.send(name, p) for w, p in zip(workers, payloads)}
    results: dict = {}
    errors: dict = {}
    dead: list[Worker] = []
    grace = None
    pending = {w.index: w for w in workers}
    start = time.monotonic()
    seen = {w.index: w.beats[0] for w in workers}
    moved = {w.index: start for w in workers}
    while pending:
        now = time.monotonic()
        for w in pending.values():
            if w.beats[0] != seen[w.index]:
                seen[w.index], moved[w.index] = w.beats[0], now
        deadline = min(moved[i] for i in pending) + timeout_s
        limit = deadline if grace is None else min(deadline, grace)
        if now >= limit:
            break
        waitables = {}
        for w in pending.values():
            waitables[w.answers] = w
            waitables[w.proc.sentinel] = w
        ready = multiprocessing.connection.wait(list(waitables), timeout=min(0.5, limit - now))
        for w in {id(waitables[r]): waitables[r] for r in ready}.values():
            got = None
            try:
                while w.answers.poll():
                    cid, ok, payload = w.answers.recv()
                    if cid == ids[w.index]:
                        got = (ok, payload)
            except (EOFError, OSError):
                pass
            if got is not None:
                (results if got[0] else errors)[w.index] = got[1]
                pending.pop(w.index)
                if not got[0]:
                    grace = grace or time.monotonic() + 10.0
            elif not w.alive:
                w.noticed_at = time.monotonic()
                w.proc.join(timeout=1)
                dead.append(w)
                errors[w.index] = f"worker {w.index} (pid {w.pid}) died (exit code {w.proc.exitcode})"
                pending.pop(w.index)
                grace = grace or time.monotonic() + 10.0
                if interrupt:
                    for other in pending.values():
                        try:
                            os.kill(other.pid, PEER_LOST_SIGNAL)
                        except OSError:
                            pass
        if on_wait is not None:
            on_wait()
    for idx, w in pending.items():
        errors[idx] = f"worker {idx} did not answer {name!r} in time (no progress for {timeout_s:g} s)"
    return results, errors, dead
