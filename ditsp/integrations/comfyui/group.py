"""The persistent ranks of one loaded model: `ditsp serve`'s workers, driven from inside ComfyUI.

A :class:`RankGroup` owns the worker processes of one loaded model (the
server's :class:`~ditsp.serve.handles.Worker`, running
:func:`~ditsp.serve.workers.worker_main`) and the loopback store they meet on.
The first restoration starts them; each later one reuses them, so the weights
are loaded once per rank and kept across prompts. A job at another SP degree
re-forms the group at that size: ranks that join receive the weights from a
rank that holds them (the worker's ``weights`` command), ranks left over stop.

A job goes to every rank as the worker's ``job`` command
(:func:`~ditsp.models.seedvr2.job.restore.rank_upscale`; the request carries
its frames, which travel through shared memory, and rank 0's report carries
the restored ones back). While it runs, :meth:`RankGroup.run` reports rank 0's
progress and watches for an interrupt: the ranks are told to stop (the
workers' :data:`~ditsp.serve.workers.PEER_LOST_SIGNAL`, which ends a job at its
next step) and leave the job; one that has not within
:data:`STOP_GRACE_S` is killed, so no rank goes on computing a job nobody
waits for. A rank that failed or stopped has dropped its process group; the
next job re-forms it.

:meth:`RankGroup.close` stops every rank (ComfyUI unloading the model, or the
loaded model being dropped from its cache); a later job starts them again.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from typing import Callable

from ...distributed.launcher import loopback_store
from ...errors import one_line
from ...serve.handles import Worker, call
from ...serve.workers import PEER_LOST_SIGNAL

STOP_GRACE_S = 30.0  # after an interrupt, how long the ranks have to leave the job before they are killed
START_TIMEOUT_S = 600.0  # a worker's start (a fresh interpreter importing torch) on a loaded machine


class Interrupted(Exception):
    """The host asked the job to stop; the ranks have left it (or were killed)."""


class _Abandon(Exception):
    pass


@contextlib.contextmanager
def _main_not_rerun():
    """Workers are spawned: a fresh interpreter that, by default, re-runs the parent's main script first.
    Inside ComfyUI that script is ComfyUI's ``main.py`` (its argument parsing, its device set-up, every
    import); a worker needs none of it (its target is a module function), so the spawn is told the main
    module is ``__main__`` by name, which it skips."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    main.__spec__ = types.SimpleNamespace(name="__main__")
    try:
        yield
    finally:
        main.__spec__ = None


def _first_line(text: str) -> str:
    return one_line(text.strip().splitlines()[0] if text.strip() else "the rank failed")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class RankGroup:
    """The worker processes of one loaded model, kept between jobs (see the module's docstring)."""

    def __init__(self, threads: int = 1, timeout_s: float = 3600.0):
        self.threads, self.timeout_s = threads, timeout_s
        self.workers: list[Worker] = []
        self._store = None
        self._port = 0
        self._next_index = 0
        self._generation = 0
        self._formed = 0  # the world size the workers are formed at (0: not formed)
        self._weights = None  # the weights spec every formed rank holds

    # -- public ---------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def held_bytes(self) -> int:
        """Memory the ranks hold now (their weights, mostly): theirs to reuse for the next job."""
        return sum(_rss(w.pid) for w in self.workers if w.alive)

    def run(self, req, progress: Callable[[int, int], None] | None = None,
            interrupted: Callable[[], bool] = lambda: False) -> dict:
        """Run ``req`` (planned for ``req.sp`` ranks) on the group; rank 0's report. Raises
        :class:`Interrupted` when ``interrupted()`` turns true, RuntimeError (one line) when a rank fails."""
        self._ensure(req.sp, req.weights, interrupted)
        group = list(self.workers)
        rank0 = group[0]
        seen = [(-1, -1)]
        stop = {"at": None}

        def on_wait():
            if stop["at"] is None and interrupted():
                stop["at"] = time.monotonic()
            if stop["at"] is not None:
                if time.monotonic() - stop["at"] > STOP_GRACE_S:
                    raise _Abandon()
                self._signal(group)  # again each tick: a rank that had not entered the job yet
                return
            now = (rank0.progress[0], rank0.progress[1])
            if progress is not None and now != seen[0] and now[1] > 0:
                seen[0] = now
                progress(*now)

        try:
            results, errors, dead = call(group, "job", [{"req": req}] * len(group), self.timeout_s, on_wait,
                                         interrupt=True)
        except _Abandon:
            self._kill(group)  # ranks that did not leave the job in time: none goes on computing it
            raise Interrupted() from None
        if errors:
            self._formed = 0  # a rank that failed or stopped dropped its process group
            for w in group:
                if not w.alive or "did not answer" in errors.get(w.index, ""):
                    self._kill([w])
        if stop["at"] is not None:
            raise Interrupted()
        if errors:
            first = errors.get(rank0.index) or next(iter(errors.values()))
            raise RuntimeError(_first_line(first))
        return results[rank0.index]

    def close(self) -> None:
        """Stop every rank; the store goes with them. A later job starts the group again."""
        for w in self.workers:
            w.stop()
        self.workers = []
        self._formed, self._weights = 0, None
        self._store = None

    # -- the group ------------------------------------------------------------

    def _signal(self, group: list[Worker]) -> None:
        for w in group:
            try:
                os.kill(w.pid, PEER_LOST_SIGNAL)
            except OSError:
                pass

    def _kill(self, workers: list[Worker]) -> None:
        for w in workers:
            w.kill()
            if w in self.workers:
                self.workers.remove(w)
        self._formed = 0

    def _ensure(self, sp: int, spec, interrupted) -> None:
        """``sp`` live workers, formed as one group, every one holding ``spec``'s weights."""
        gone = [w for w in self.workers if not w.alive]
        if gone:
            self._kill(gone)
        if len(self.workers) > sp:  # the first ones hold the weights; the rest stop
            extra = self.workers[sp:]
            self.workers = self.workers[:sp]
            for w in extra:
                w.stop()
            self._formed = 0
        if self._store is None:
            self._store, (_, self._port) = loopback_store(1, self.timeout_s)
        while len(self.workers) < sp:
            with _main_not_rerun():
                self.workers.append(Worker(self._next_index, self._port, self.timeout_s, self.threads))
            self._next_index += 1
            self._formed = 0
        self._wait_started(interrupted)
        if self._formed != sp:
            self._generation += 1
            self._step("form", [{"gen": self._generation, "rank": r, "world": sp} for r in range(sp)], interrupted)
            self._formed, self._weights = sp, None
        if self._weights != spec:
            self._step("weights", [{"spec": spec}] * sp, interrupted)
            self._weights = spec

    def _wait_started(self, interrupted) -> None:
        start = time.monotonic()
        while not all(w.poll_ready(0.1) for w in self.workers):
            dead = [w for w in self.workers if not w.alive]
            if dead:
                self._kill(dead)
                raise RuntimeError(f"a rank ended while starting (exit code {dead[0].proc.exitcode})")
            if interrupted():
                self.close()
                raise Interrupted()
            if time.monotonic() - start > START_TIMEOUT_S:
                self.close()
                raise RuntimeError(f"the ranks did not start in {START_TIMEOUT_S:g} s")

    def _step(self, name: str, payloads: list[dict], interrupted) -> None:
        """One set-up command on every worker; any failure or an interrupt stops the group (a half-formed
        group, or half-loaded weights, is not worth keeping)."""
        def on_wait():
            if interrupted():
                raise _Abandon()

        try:
            _, errors, _ = call(self.workers, name, payloads, self.timeout_s, on_wait)
        except _Abandon:
            self.close()
            raise Interrupted() from None
        if errors:
            self.close()
            raise RuntimeError(f"the ranks could not {'load the weights' if name == 'weights' else 'form a group'}: "
                               f"{_first_line(next(iter(errors.values())))}")
