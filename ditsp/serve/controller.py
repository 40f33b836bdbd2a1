"""The scheduler and the elastic SP group: one thread in the server process drives the workers.

Loop, between jobs:

1. **reap**: a member whose process ended is dropped (its sentinel fires, so
   detection costs no heartbeat period);
2. **admit**: spawned workers that finished starting are waiting to join;
3. **rebuild** when membership changed: every member re-forms a group of the
   new size under a fresh store prefix (:mod:`.workers`), weights go from the
   members that hold them to those that do not (one broadcast; storage only
   when no member holds them), and the window plans of recent grids are
   rebuilt for the new degree;
4. **pull**: the idle group claims the oldest queued job from the store and
   runs it on every member; rank 0 writes the output.

A member that dies mid-job fails the job's collectives on its peers; the job
goes back to the head of the queue and re-runs on the rebuilt group. The
pipeline's output does not depend on the SP degree, so the re-run writes the
same frames. Lost members are replaced by freshly spawned workers (when
``respawn``), which join between jobs and receive their weights from a peer.

Failures are bounded. A replacement starts at once after one loss, then after
a wait that doubles with each further failure in a row (up to
``RESPAWN_WAIT_S``); after ``max_failures`` in a row without the group standing
complete, no more are started. Weights that fail to load (a corrupt or
non-finite checkpoint) fail the same way on any worker, so that is not retried:
the controller stops. When it stops, or no rank is left and none can come, it
sets :attr:`Controller.error` and :attr:`Controller.failed` (`ditsp serve`
then exits with that one line), kills its workers, and the API refuses jobs
(503) instead of queueing work that would never run.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
from dataclasses import asdict, dataclass, field

from ..distributed.launcher import loopback_store
from .store import JobStore
from ..errors import one_line
from .inputs import release
from .handles import Worker, call
from .workers import WeightsLoadError
from .workers import request_grids
from ..models.seedvr2.job.request import UpscaleRequest
from ..models.seedvr2.job.restore import summarize

log = logging.getLogger("ditsp.serve")

MAX_ATTEMPTS = 3
RESPAWN_WAIT_S = (0.5, 30.0)  # wait before the 2nd replacement in a row (the 1st starts at once), and the longest


class _Stopping(Exception):
    pass


class _Fatal(Exception):
    """No group can form (weights that do not load, workers that keep dying): the controller stops."""


@dataclass
class Reconfiguration:
    """One rebuild of the group, with the time of each part (seconds)."""

    reason: str
    generation: int
    world: int
    noticed_at: float | None = None  # time.monotonic() the death was noticed (None: no death)
    form_s: float = 0.0  # every member in the new process group
    weights_s: float = 0.0  # weights to members without them
    replan_s: float = 0.0  # plans of recent grids at the new degree
    drain_s: float = 0.0  # noticed -> every survivor out of the interrupted job (part of total_s)
    total_s: float = 0.0  # noticed -> serving again
    weights_source: str = ""
    weights_bytes: int = 0
    at: float = field(default_factory=time.time)


class Controller:
    """Runs jobs from ``store`` on an elastic group of ``sp`` persistent workers."""

    def __init__(self, store: JobStore, spec, sp: int, metrics=None, timeout_s: float = 60.0, threads: int = 1,
                 respawn: bool = True, job_timeout_s: float = 3600.0, retention_s: float | None = None):
        if sp < 1:
            raise ValueError(f"--sp must be >= 1, got {sp}")
        self.store, self.spec, self.sp = store, spec, sp
        self.plan_job = None  # (job record, group size) -> UpscaleRequest: the front door's check, re-run
        self.metrics = metrics
        self.timeout_s, self.threads = timeout_s, threads
        self.respawn = respawn
        self.job_timeout_s = job_timeout_s
        self.retention_s = retention_s  # None: results are kept
        self._next_expiry = 0.0
        self._drain_s = 0.0
        self.members: list[Worker] = []
        self.joining: list[Worker] = []
        self.generation = 0
        self.reconfigurations: list[Reconfiguration] = []
        self.ready = threading.Event()
        self.failed = threading.Event()  # set once the controller gave up (``error`` says why)
        self.error: str | None = None
        self.max_failures = 2 * sp + 2  # worker failures in a row before no more are started
        self._failures = 0  # worker failures since the group last stood complete
        self._last_failure = ""
        self._owed = 0  # replacements to start at ``_spawn_at``
        self._spawn_at = 0.0
        self.current_job: str | None = None
        self._stop = threading.Event()
        self._next_index = 0
        self._deaths: list[float] = []  # monotonic times deaths were noticed, not yet rebuilt
        self._planner = None  # the SP path by the cost model unless a job names a planner
        self._failed_steps = 0
        self._grids: set = set()  # DiT grids of recent jobs: their plans are rebuilt with the group
        self._tcp = None
        self._thread = threading.Thread(target=self._main, name="ditsp-serve-controller", daemon=True)

    # -- public ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a server without workers never starts it)
            self._thread.join(timeout=30)
        for w in self.members + self.joining:
            w.stop()
        self.members, self.joining = [], []
        self._tcp = None

    def refusal(self) -> str | None:
        """Why a job cannot be accepted now, in one line (None: it can be queued)."""
        if self.error:
            return f"the server cannot run jobs: {self.error}"
        if self._failures and not self.members:
            return (f"no rank is up ({self._failures} worker failure(s) in a row, last: {self._last_failure}); "
                    f"retrying, try again later")
        return None

    def status(self) -> dict:
        members = list(self.members)
        return {
            "ready": self.ready.is_set(),
            "error": self.error,
            "ranks": len(members),
            "target_ranks": self.sp,
            "joining": len(self.joining),
            "failures_in_a_row": self._failures,
            "generation": self.generation,
            "workers": [{"rank": i, "pid": w.pid} for i, w in enumerate(members)],
            "current_job": self.current_job,
            "reconfigurations": [asdict(r) for r in self.reconfigurations[-10:]],
        }

    # -- loop -----------------------------------------------------------------

    def _spawn(self) -> Worker:
        w = Worker(self._next_index, self._port, self.timeout_s, self.threads)
        self._next_index += 1
        self.joining.append(w)
        return w

    def _main(self) -> None:
        try:
            self._tcp, (_, self._port) = loopback_store(1, self.timeout_s)
            for _ in range(self.sp):
                self._spawn()
            # every first worker started (a loaded machine may take minutes) or given up on
            while self._owed or not all(w.poll_ready(0.1) for w in self.joining):
                self._check_stop()
                self._reap()
                self._respawn_due()
                self._check_alive()
                self._idle(0.1)
            self._rebuild("start")
            self._check_alive()
            self.ready.set()
            while not self._stop.is_set():
                self._expire()
                self._reap()
                self._respawn_due()
                self._check_alive()
                self._admit()
                if self._needs_rebuild():
                    self._rebuild("rank lost" if self._deaths else "rank joined")
                    continue
                if not self.members:
                    self._idle(0.1)
                    continue
                job = self.store.claim_next()
                if job is None:
                    self._idle(0.1)
                    continue
                self._run(job)
        except _Stopping:
            pass
        except _Fatal as e:
            self._give_up(str(e))
        except BaseException as e:  # noqa: BLE001 - the server reports it in /healthz, and stops
            log.exception("controller failed")
            self._give_up(one_line(f"the scheduler failed: {type(e).__name__}: {e}"))

    def _give_up(self, reason: str) -> None:
        self.error = reason  # in /healthz and every refused job; `ditsp serve` exits with it
        for w in self.members + self.joining:
            w.kill()
        self.members, self.joining, self._owed = [], [], 0
        self.failed.set()
        self.ready.set()

    def _expire(self) -> None:
        """Every minute: delete results (and any upload left) of jobs finished more than ``retention_s`` ago."""
        if self.retention_s is None or time.monotonic() < self._next_expiry:
            return
        self._next_expiry = time.monotonic() + 60.0
        for job in self.store.expired(time.time() - self.retention_s):
            _remove(job["output_path"])
            _release_input(job)

    def _idle(self, timeout: float) -> None:
        """Wait for a member's death, a joiner's hello, a replacement's start time, or ``timeout``."""
        if self._owed:
            timeout = max(0.0, min(timeout, self._spawn_at - time.monotonic()))
        waitables = [w.proc.sentinel for w in self.members + self.joining]
        waitables += [w.answers for w in self.joining]
        if waitables:
            multiprocessing.connection.wait(waitables, timeout=timeout)
        else:
            self._stop.wait(timeout)

    def _reap(self) -> None:
        for w in list(self.members):
            if not w.alive:
                self._lost(w)
        for w in list(self.joining):
            if not w.alive:
                self.joining.remove(w)
                w.kill()  # reaped
                self._replace(f"worker {w.index} ended while starting (exit code {w.proc.exitcode})")

    def _lost(self, w: Worker) -> None:
        if w in self.members:
            self.members.remove(w)
            self._deaths.append(time.monotonic())
            log.warning("worker %d (pid %d) lost", w.index, w.pid)
        if w in self.joining:
            self.joining.remove(w)
        w.kill()
        self._replace(f"worker {w.index} lost (exit code {w.proc.exitcode})")

    def _replace(self, reason: str) -> None:
        """A worker is gone: owe a replacement, started at once the first time, then after a wait that
        doubles with each failure in a row; none past ``max_failures`` in a row."""
        self._last_failure = reason
        if not self.respawn:
            return
        self._failures += 1
        if self._failures > self.max_failures:
            if self._failures == self.max_failures + 1:
                log.warning("%d worker failures in a row (last: %s): no more workers are started",
                            self.max_failures, reason)
            return
        wait = 0.0 if self._failures == 1 else min(RESPAWN_WAIT_S[0] * 2 ** (self._failures - 2), RESPAWN_WAIT_S[1])
        self._owed += 1
        self._spawn_at = max(self._spawn_at, time.monotonic() + wait)

    def _respawn_due(self) -> None:
        if self._owed and time.monotonic() >= self._spawn_at:
            for _ in range(self._owed):
                self._spawn()
            self._owed = 0

    def _check_alive(self) -> None:
        """No member, no worker starting and none to come: no group can ever form."""
        if not self.members and not self.joining and not self._owed:
            why = f"{self._failures} worker failure(s) in a row" if self.respawn else "--no-respawn"
            raise _Fatal(f"no rank is left and none is started ({why}; last: {self._last_failure or 'none'})")

    def _admit(self) -> None:
        for w in self.joining:
            w.poll_ready(0)

    def _needs_rebuild(self) -> bool:
        ready = [w for w in self.joining if w.ready]
        return bool(self._deaths) or (ready and (len(self.members) < self.sp or not self.members))

    def _rebuild(self, reason: str) -> None:
        t0 = time.monotonic()
        noticed = self._deaths[0] if self._deaths else t0
        while True:
            room = self.sp - len(self.members)
            joiners = [w for w in self.joining if w.ready][:max(room, 0)]
            group = self.members + joiners
            if not group:
                self.members = []
                self._deaths.clear()
                return
            self.generation += 1
            rec = Reconfiguration(reason, self.generation, len(group))
            a = time.monotonic()
            ok = self._step(group, "form", [{"gen": self.generation, "rank": r, "world": len(group)}
                                            for r in range(len(group))], self.timeout_s)
            b = time.monotonic()
            ok = ok and self._step(group, "weights", [{"spec": self.spec}] * len(group), self.timeout_s * 10,
                                   rec)
            c = time.monotonic()
            payload = {"spec": self.spec, "planner": self._planner, "grids": sorted(self._grids)}
            ok = ok and self._step(group, "replan", [payload] * len(group), self.timeout_s)
            d = time.monotonic()
            if not ok:  # a member died or failed while rebuilding: rebuild again without it
                self.members = [w for w in self.members if w in group]
                continue
            break
        self._failed_steps = 0
        for w in joiners:
            self.joining.remove(w)
        self.members = group
        if len(group) == self.sp:  # complete again: failures start counting afresh
            self._failures = 0
        rec.form_s, rec.weights_s, rec.replan_s = b - a, c - b, d - c
        rec.noticed_at = noticed if self._deaths else None
        rec.drain_s, self._drain_s = (self._drain_s if self._deaths else 0.0), 0.0
        rec.total_s = d - noticed
        self._deaths.clear()
        self.reconfigurations.append(rec)
        log.info("group generation %d: %d rank(s) (%s), %.3f s", self.generation, len(group), reason, rec.total_s)
        if self.metrics is not None:
            self.metrics.reconfigured(rec, len(group))

    def _step(self, group: list[Worker], name: str, payloads: list[dict], timeout_s: float,
              rec: Reconfiguration | None = None) -> bool:
        results, errors, dead = call(group, name, payloads, timeout_s, on_wait=self._check_stop)
        if rec is not None and results:
            for r in results.values():
                if r.get("source") in ("peer", "storage", "sent"):
                    rec.weights_source = "peer" if r["source"] in ("peer", "sent") else "storage"
                    rec.weights_bytes = max(rec.weights_bytes, r.get("bytes", 0))
        if not errors:
            return True
        load = [e for e in errors.values() if e.startswith(WeightsLoadError.__name__ + ":")]
        if load and not results:  # the checkpoints themselves, and no rank holds weights: none ever will
            raise _Fatal("cannot load the weights: "
                         + one_line(load[0].splitlines()[0].removeprefix(WeightsLoadError.__name__ + ":").strip()))
        log.warning("%s failed: %s", name, "; ".join(e.splitlines()[0] for e in errors.values()))
        self._failed_steps += 1
        for w in list(group):
            hung = "did not answer" in errors.get(w.index, "")
            if not w.alive or hung or (w.index in errors and self._failed_steps >= MAX_ATTEMPTS):
                self._lost(w)  # dead, hung or failing again and again: a fresh worker replaces it
                group.remove(w)
        return False

    def _remember_grids(self, req) -> None:
        try:
            grids = request_grids(req)
        except Exception:  # noqa: BLE001 - only a warm-up hint
            return
        if len(self._grids) + len(grids) > 16:
            self._grids.clear()
        self._grids.update(grids)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopping()

    # -- jobs -----------------------------------------------------------------

    def _request(self, job: dict) -> UpscaleRequest:
        """The job's request, planned for the group as it is now (its size may have changed since submit)."""
        if self.plan_job is None:
            raise RuntimeError("the controller was started without a job planner")
        return self.plan_job(job, len(self.members))

    def _run(self, job: dict) -> None:
        job_id = self.current_job = job["id"]
        try:
            req = self._request(job)
        except (ValueError, OSError, MemoryError) as e:  # e.g. its input went away: this job fails, not the server
            self.current_job = None
            self.store.finish(job_id, "failed", error=one_line(f"the job cannot run: {e}", 500))
            _release_input(job)
            if self.metrics is not None:
                self.metrics.job_done(job, None, 0.0, "failed")
            return
        self._planner = req.plan.planner
        group = list(self.members)
        rank0 = group[0]
        last = [(-1, -1)]

        def on_wait():
            self._check_stop()
            done, total = rank0.progress[0], rank0.progress[1]
            if (done, total) != last[0]:
                last[0] = (done, total)
                self.store.progress(job_id, done, total)

        started = time.monotonic()
        try:
            results, errors, dead = call(group, "job", [{"req": req}] * len(group), self.job_timeout_s, on_wait,
                                         interrupt=True)
        except _Stopping:
            self.current_job = None
            raise  # the job stays 'running' in the store: the next start re-runs it
        self.current_job = None
        if not errors:
            self._remember_grids(req)
            summary = summarize([results[w.index] for w in group])
            summary.pop("samples", None)
            summary.pop("timeline", None)
            summary.pop("request", None)
            cancelled = self.store.cancel_requested(job_id)
            if cancelled:
                _remove(job["output_path"])
            self.store.finish(job_id, "cancelled" if cancelled else "done", report=_jsonable(summary),
                              world_size=len(group))
            _release_input(job)
            if self.metrics is not None:
                self.metrics.job_done(job, summary, time.monotonic() - started, "cancelled" if cancelled else "done")
            return
        hung = [w for w in group if "did not answer" in errors.get(w.index, "")]
        if dead or hung or _is_group_failure(errors):
            for w in group:
                if not w.alive or w in hung:
                    self._lost(w)  # survivors keep their weights and re-form without it
            seen = [w.noticed_at for w in dead if getattr(w, "noticed_at", None)]
            self._deaths.append(min(seen) if seen else time.monotonic())
            self._deaths.sort()
            self._drain_s = time.monotonic() - self._deaths[0]  # waiting for the survivors to leave the job
            if job["attempts"] >= MAX_ATTEMPTS:
                self.store.finish(job_id, "failed", error=f"the group broke {job['attempts']} times running this job")
                _release_input(job)
                if self.metrics is not None:
                    self.metrics.job_done(job, None, time.monotonic() - started, "failed")
            else:
                self.store.requeue(job_id)  # re-runs on the rebuilt group, same output
            return
        first = next(iter(errors.values()))
        msg = first.strip().splitlines()[0] if first.strip() else "the job failed"
        self.store.finish(job_id, "failed", error=msg[:500])
        _release_input(job)
        if self.metrics is not None:
            self.metrics.job_done(job, None, time.monotonic() - started, "failed")


def _is_group_failure(errors: dict) -> bool:
    """Errors that come from a broken process group rather than from the job itself."""
    keys = ("Connection closed", "Connection reset", "gloo", "Broken pipe", "timed out", "Timed out", "NCCL",
            "DistBackendError", "DistNetworkError")
    return any(any(k in e for k in keys) for e in errors.values())


def _release_input(job: dict) -> None:
    """A finished job's own input (its upload, or its pinned copy of a named one) is deleted: it can never
    run again. The file a job named is never touched."""
    if job.get("input_owned"):
        release(job["input_path"])


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
