"""The pull scheduler on elastic spot groups: spot workers come and go by a trace, form SP groups, and pull
exploration and rollout requests from the queue until the run ends.

One thread in the trainer's process drives everything (:class:`SpotPool`):

1. **trace**: at each event's time a ``join`` spawns a worker process (:mod:`.spot`; it dies with this
   process); a ``leave`` preempts one as a provider does: the grace period written where the worker reads
   it, SIGTERM, and SIGKILL once the grace is over;
2. **groups**: idle workers form groups of ``group_size`` (smaller ones of an allowed size when no other
   worker is on its way; small idle groups merge when enough workers are idle). Each formation is a new
   *generation*: a fresh process group under its own store prefix (:mod:`ditsp.distributed.elastic`);
3. **pull**: rank 0 of an idle group asks for work; the group leases the next request
   (:class:`~.leases.RequestQueue`: rollouts first) and every member runs its units, rank 0 committing each;
4. **loss**: when a member's process ends (preempted, killed or crashed), what the group's members had sent
   is committed first, then the group's lease is released (its unfinished units go back to the head of the
   queue), the survivors are told (:data:`~.spot.PEER_LOST`, which abandons the unit in flight) and drop the
   group, and they re-form with whoever is idle. Weights never travel with a group: every worker reads the
   version a request names from the trainer's published file (:mod:`.published`), so a re-formed group, a
   replacement worker included, needs nothing from the dead one.

Every request finishes exactly once (the queue's commits are keyed by request and seed). A task that fails
the same unit twice on intact groups stops the pool with that error in one line (:attr:`SpotPool.error`),
as does a run left with pending work, no worker and no join to come.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field

import torch.multiprocessing as mp

from ..cpu import malloc as cpu_malloc
from ..distributed.launcher import loopback_store
from ..errors import one_line
from .cost import CostLedger
from .leases import RequestQueue
from .spot import PEER_LOST, spot_main
from .trace import Trace

POLL_S = 0.02  # the loop's longest sleep: how late a queued request or a trace event may be seen
FAILURES = 2  # the same unit failing this often on intact groups stops the pool


@dataclass(frozen=True)
class Unit:
    """A unit a spot group's rank 0 finished (``seed``) or abandoned (``seed`` None: wasted work)."""

    request: str
    seed: int | None
    worker: str  # the process (name.incarnation)
    wall_s: float
    cpu_s: float  # of rank 0's main thread


@dataclass
class _Worker:
    name: str  # the trace's name
    key: str  # name and incarnation: one process
    proc: object
    conn: object
    grace: object  # shared double the worker reads on SIGTERM
    state: str = "starting"  # starting, idle, grouped, dropping
    group: "_Group | None" = None
    leaving_at: float | None = None  # SIGTERM sent (monotonic)
    kill_at: float | None = None


@dataclass
class _Group:
    generation: int
    members: list
    formed: set = field(default_factory=set)
    wants: bool = False  # rank 0 asked for work
    request: object = None  # the request leased
    broken: bool = False

    @property
    def owner(self) -> str:
        return "+".join(w.key for w in self.members)

    @property
    def ready(self) -> bool:
        return not self.broken and len(self.formed) == len(self.members)


class SpotError(RuntimeError):
    """The spot pool stopped (one line): a task failing on intact groups, or work left with no worker."""


class SpotPool:
    """Spot workers following ``trace``, pulling from ``queue`` and running ``task`` (see :mod:`.spot`).

    ``task`` is pickled to each worker; ``task.group_sizes(n)`` (optional) lists the group sizes up to ``n``
    the model can run at (default every size). The run's clock starts in :meth:`start` once every worker that
    joins at time 0 has started, so the trace's times count from a ready fleet. Worker-seconds go to
    ``ledger`` as spot, from spawn to exit.
    """

    def __init__(self, task, trace: Trace, queue: RequestQueue, group_size: int = 1, ledger: CostLedger | None = None,
                 timeout_s: float = 120.0):
        if group_size < 1:
            raise ValueError(f"a spot group has at least one worker, got {group_size}")
        self.task, self.trace, self.queue = task, trace, queue
        self.group_size, self.timeout_s = group_size, timeout_s
        sizes = task.group_sizes(group_size) if hasattr(task, "group_sizes") else range(1, group_size + 1)
        self.sizes = sorted({int(s) for s in sizes if 1 <= int(s) <= group_size})
        if not self.sizes:
            raise ValueError(f"the task runs at no group size up to {group_size}")
        self._task_blob = pickle.dumps(task)  # a task that does not pickle fails here, before any process
        self.ledger = ledger if ledger is not None else CostLedger()
        self.workers: list[_Worker] = []
        self.groups: list[_Group] = []
        self.events: list[dict] = []  # what happened, with the run's time
        self.units: list[Unit] = []  # every unit kept, and the CPU time of every unit abandoned
        self.error: str | None = None
        self._incarnations: dict[str, int] = {}
        self._next_event = 0
        self._generation = 0
        self._failures: dict[str, int] = {}
        self._t0: float | None = None
        self._serving = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._port = 0

    # -- public ---------------------------------------------------------------------

    def now(self) -> float:
        """Seconds of the run's clock (0 before :meth:`start` returns)."""
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    def start(self) -> None:
        """Spawn the workers that join at time 0, wait until they have started, then run the loop."""
        self._store, (_, self._port) = loopback_store(1, self.timeout_s)
        while self._next_event < len(self.trace.events) and self.trace.events[self._next_event].time_s == 0.0:
            self._apply(self.trace.events[self._next_event])
            self._next_event += 1
        deadline = time.monotonic() + max(self.timeout_s, 60.0)
        while any(w.state == "starting" for w in self.workers):
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"spot workers did not start within {max(self.timeout_s, 60.0):g} s")
            self._step(0.05)  # hellos and groups; no work is leased before the clock starts
        if not self.workers:
            self.close()
            raise RuntimeError(f"no spot worker started ({self._last_event()})")
        self._t0 = time.monotonic()
        self._serving = True
        self._thread = threading.Thread(target=self._main, name="ditsp-rl-spot-pool", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the pool's error (one line) if it stopped; the queue's waiters call it."""
        if self.error:
            raise SpotError(self.error)

    def close(self) -> None:
        """Stop the loop and every worker (asked, then killed); their paid time ends now."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        for w in self.workers:
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
        end = time.monotonic() + 5.0
        for w in self.workers:
            w.proc.join(timeout=max(0.0, end - time.monotonic()))
        for w in list(self.workers):
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)
            self._gone(w, "preempted" if w.leaving_at is not None else "stopped")
        self._store = None

    def live(self) -> int:
        """Workers started and not leaving."""
        return sum(w.state != "starting" and w.leaving_at is None for w in self.workers)

    # -- loop -----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                while (self._next_event < len(self.trace.events)
                       and self.trace.events[self._next_event].time_s <= self.now()):
                    self._apply(self.trace.events[self._next_event])
                    self._next_event += 1
                self._step(POLL_S)
                self._check_stranded()
        except BaseException as e:  # noqa: BLE001 - the waiting trainer reads it (check) and stops
            self.error = self.error or one_line(f"the spot scheduler failed: {type(e).__name__}: {e}")

    def _step(self, timeout: float) -> None:
        self._kill_overdue()
        self._regroup()
        self._serve()
        waitables = {}
        for w in self.workers:
            waitables[w.conn] = w
            waitables[w.proc.sentinel] = w
        if self._next_event < len(self.trace.events) and self._t0 is not None:
            timeout = max(0.0, min(timeout, self.trace.events[self._next_event].time_s - self.now()))
        ready = multiprocessing.connection.wait(list(waitables), timeout=timeout) if waitables else []
        if not waitables:
            time.sleep(timeout)
        for w in {id(waitables[r]): waitables[r] for r in ready}.values():
            self._drain(w)
            if not w.proc.is_alive():
                self._lost(w)

    def _apply(self, event) -> None:
        if event.kind == "join":
            self._spawn(event.worker)
            self._log("join", event.worker)
            return
        w = next((w for w in self.workers if w.name == event.worker and w.leaving_at is None), None)
        if w is None:  # it died earlier (a crash): nothing left to preempt
            self._log("leave", event.worker, note="already gone")
            return
        w.grace.value = event.grace_s
        w.leaving_at, w.kill_at = time.monotonic(), time.monotonic() + event.grace_s
        busy = w.group is not None and w.group.request is not None
        self._log("leave", w.name, grace_s=event.grace_s, busy=busy)
        try:
            os.kill(w.proc.pid, signal.SIGTERM)
        except OSError:
            pass

    def _spawn(self, name: str) -> None:
        n = self._incarnations.get(name, 0)
        self._incarnations[name] = n + 1
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        grace = ctx.Value("d", 0.0, lock=False)
        key = f"{name}.{n}"
        proc = ctx.Process(target=spot_main, name=f"ditsp-rl-{key}", daemon=True,
                           args=(os.getpid(), name, self._port, self.timeout_s, self._task_blob, theirs, grace))
        with cpu_malloc.for_new_processes():
            proc.start()
        theirs.close()
        self.workers.append(_Worker(name, key, proc, ours, grace))
        self.ledger.join(key, "spot", time.monotonic())

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.kill_at is not None and now >= w.kill_at and w.proc.is_alive():
                w.proc.kill()
                self._log("kill", w.name, note="grace period over")
                w.kill_at = None

    # -- messages -------------------------------------------------------------------

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _handle(self, w: _Worker, msg) -> None:
        kind = msg[0]
        g = w.group
        if kind == "hello":
            w.state = "idle"
        elif kind == "formed":
            if g is not None and g.generation == msg[1]:
                g.formed.add(w.key)
        elif kind == "pull":
            if g is not None and g.generation == msg[1]:
                g.wants = True  # served once every member has formed
        elif kind == "unit":
            _, rid, gen, seed, result, wall_s, cpu_s = msg
            if g is not None and g.generation == gen:
                if self.queue.commit(rid, g.owner, gen, seed, result) == "kept":
                    self.units.append(Unit(rid, seed, w.key, float(wall_s), float(cpu_s)))
        elif kind == "done":
            if g is not None and g.generation == msg[2]:
                self.queue.done(msg[1], g.owner, msg[2])
                g.request = None
        elif kind in ("aborted", "failed"):
            _, rid, gen, why, cpu_s = msg
            if rid is not None and cpu_s > 0:
                self.units.append(Unit(rid, None, w.key, 0.0, float(cpu_s)))
            if g is not None and g.generation == gen and not g.broken:
                if kind == "failed" and all(m.proc.is_alive() and m.leaving_at is None for m in g.members):
                    n = self._failures[rid] = self._failures.get(rid, 0) + 1
                    self._log("failed", w.name, request=rid, error=why)
                    if n >= FAILURES:
                        self.error = one_line(f"spot workers failed request {rid} {n} times: {why}")
                self._break(g, f"{kind}: {why}")
        elif kind == "idle":
            w.state, w.group = "idle", None

    def _lost(self, w: _Worker) -> None:
        """``w``'s process ended: commit what its group sent, release the group's lease, tell the survivors."""
        if w not in self.workers:
            return
        g = w.group
        if g is not None:
            for m in g.members:
                self._drain(m)  # may break the group itself (a member's "aborted"): _break is idempotent
            self._break(g, f"{w.key} ended")
        note = "preempted" if w.leaving_at is not None else f"died (exit code {w.proc.exitcode})"
        self._gone(w, note)

    def _gone(self, w: _Worker, note: str) -> None:
        if w in self.workers:
            self.workers.remove(w)
            self.ledger.leave(w.key, time.monotonic())
            self._log("exit", w.name, note=note, exit_code=w.proc.exitcode)

    def _break(self, g: _Group, why: str) -> None:
        if g.broken:
            return
        g.broken = True
        back = self.queue.release(g.owner, g.generation)
        if back or g.request is not None:
            self._log("returned", g.owner, requests=back, why=why)
        g.request = None
        if g in self.groups:
            self.groups.remove(g)
        for m in g.members:
            m.group = None
            if not m.proc.is_alive():
                continue
            m.state = "dropping"
            try:
                os.kill(m.proc.pid, PEER_LOST)
                m.conn.send(("drop",))
            except OSError:
                pass

    # -- groups and work ------------------------------------------------------------

    def _regroup(self) -> None:
        idle = [w for w in self.workers if w.state == "idle" and w.leaving_at is None]
        small = [g for g in self.groups if g.ready and g.request is None and len(g.members) < self.group_size
                 and g.wants]
        if small and (idle or len(small) > 1):  # merge: idle small groups (and idle workers) into a larger one
            pool = len(idle) + sum(len(g.members) for g in small)
            if self._size(pool) > max(len(g.members) for g in small):
                for g in small:
                    self._break(g, "merging into a larger group")
                return
        starting = any(w.state in ("starting", "dropping") for w in self.workers)
        while idle:
            if len(idle) < self.group_size and starting:
                break  # more workers are on their way: wait for them before forming a small group
            size = self._size(len(idle))
            members, idle = idle[:size], idle[size:]
            self._form(members)

    def _size(self, n: int) -> int:
        return max(s for s in self.sizes if s <= max(n, 1))

    def _form(self, members: list) -> None:
        self._generation += 1
        g = _Group(self._generation, members)
        self.groups.append(g)
        for r, w in enumerate(members):
            w.state, w.group = "grouped", g
            w.conn.send(("form", g.generation, r, len(members)))
        self._log("form", g.owner, generation=g.generation, world=len(members))

    def _serve(self) -> None:
        if not self._serving:
            return
        for g in list(self.groups):
            if not (g.ready and g.wants and g.request is None):
                continue
            if any(m.leaving_at is not None for m in g.members):
                continue  # a preempted member: the group takes no new work
            req = self.queue.lease(g.owner, g.generation)
            if req is None:
                return
            g.wants, g.request = False, req
            for m in g.members:
                try:
                    m.conn.send(("run", req, g.generation))
                except OSError:
                    pass  # it is dying: its sentinel breaks the group

    def _check_stranded(self) -> None:
        if self.workers or self._next_event < len(self.trace.events) or not self.queue.pending():
            return
        self.error = self.error or (f"{self.queue.pending()} request(s) pending and no spot worker left "
                                    f"(the trace has no join after {self._last_event()})")

    def _last_event(self) -> str:
        e = self.trace.events[max(0, self._next_event - 1)]
        return f"{e.kind} {e.worker} at {e.time_s:g} s"

    def _log(self, event: str, who: str, **info) -> None:
        self.events.append({"t": round(self.now(), 4), "event": event, "who": who, **info})
