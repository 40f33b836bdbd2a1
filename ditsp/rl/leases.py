"""The request queue spot workers pull from: leases with an owner and a generation, and exactly-once commits.

A request is one prompt's work at one weights version: its *units* are its seeds (exploration scores each
candidate seed; a rollout samples each chosen one). A worker group takes a request by :meth:`lease`, which
records the group's name and generation (a generation is one formation of a group: a group that re-forms
gets a new one). Results come back one unit at a time by :meth:`commit`, keyed by (request id, seed):

- the first commit of a unit from the group holding the lease is kept;
- a commit of a unit already kept is a duplicate and changes nothing (the commit is idempotent);
- a commit from a group that no longer holds the lease (its generation ended, the request was returned and
  leased again) is stale and changes nothing.

:meth:`release` returns what a group had not finished to the queue (its committed units stay committed), so
a preempted group loses at most the unit in flight, and a request finishes exactly once, when every unit
is kept. Rollout requests are leased before exploration ones (they are on the trainer's critical path), and
audit requests (the stale-weight premise measured: off every path) last; within a kind, the oldest first. Every counter :meth:`audit` reports is what the exactly-once check reads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

KINDS = ("rollout", "explore", "audit")  # lease order: rollouts, then exploration, then the premise's audit


@dataclass(frozen=True)
class Request:
    """One prompt's work at one weights version: a unit per seed."""

    id: str
    kind: str  # one of KINDS
    version: int  # the weights version the units run with
    prompt: int
    seeds: tuple[int, ...]
    keep: bool = False  # send back each unit's whole rollout, not only its reward

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a request's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise ValueError(f"request {self.id}: its seeds must be distinct and at least one, got {self.seeds}")


@dataclass(frozen=True)
class Lease:
    request_id: str
    owner: str
    generation: int
    since: float


@dataclass
class _Entry:
    request: Request
    results: dict = field(default_factory=dict)  # seed -> result, each kept once
    lease: Lease | None = None
    finished_at: float | None = None


class RequestQueue:
    """Requests waiting, leased and finished; thread-safe (the scheduler's thread commits, the trainer waits)."""

    def __init__(self):
        self._entries: dict[str, _Entry] = {}
        self._waiting: list[str] = []
        self._cv = threading.Condition()
        self.counts = {"leases": 0, "units": 0, "duplicates": 0, "stale": 0, "returned": 0, "returned_units": 0}

    # -- producer -----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._cv:
            if request.id in self._entries:
                raise ValueError(f"request {request.id} was submitted twice")
            self._entries[request.id] = _Entry(request)
            self._waiting.append(request.id)
            self._cv.notify_all()

    # -- workers ------------------------------------------------------------------

    def lease(self, owner: str, generation: int) -> Request | None:
        """The next request for group ``owner`` of ``generation``, reduced to its unfinished seeds; None when
        nothing waits."""
        with self._cv:
            if not self._waiting:
                return None
            rid = min(self._waiting, key=lambda r: (KINDS.index(self._entries[r].request.kind),
                                                    self._waiting.index(r)))
            self._waiting.remove(rid)
            e = self._entries[rid]
            e.lease = Lease(rid, owner, generation, time.monotonic())
            self.counts["leases"] += 1
            todo = tuple(s for s in e.request.seeds if s not in e.results)
            return replace(e.request, seeds=todo)

    def commit(self, request_id: str, owner: str, generation: int, seed: int, result: Any) -> str:
        """Keep one unit's result: "kept", "duplicate" (kept before: nothing changes) or "stale" (the group
        no longer holds the lease: nothing changes)."""
        with self._cv:
            e = self._entries.get(request_id)
            if e is None or seed not in e.request.seeds:
                raise KeyError(f"no unit {request_id}/{seed} was submitted")
            if seed in e.results:
                self.counts["duplicates"] += 1
                return "duplicate"
            lease = e.lease
            if lease is None or (lease.owner, lease.generation) != (owner, generation):
                self.counts["stale"] += 1
                return "stale"
            e.results[seed] = result
            self.counts["units"] += 1
            if len(e.results) == len(e.request.seeds):
                e.finished_at = time.monotonic()
                e.lease = None
            self._cv.notify_all()
            return "kept"

    def release(self, owner: str, generation: int) -> list[str]:
        """Return the unfinished requests the group holds to the head of the queue; their ids."""
        with self._cv:
            back = [rid for rid, e in self._entries.items()
                    if e.lease is not None and (e.lease.owner, e.lease.generation) == (owner, generation)]
            for rid in back:
                e = self._entries[rid]
                e.lease = None
                self.counts["returned"] += 1
                self.counts["returned_units"] += len(e.request.seeds) - len(e.results)
            self._waiting[:0] = back
            if back:
                self._cv.notify_all()
            return back

    def done(self, request_id: str, owner: str, generation: int) -> None:
        """The group says it finished the request: any unit it did not commit goes back to the queue (a
        group must not drop a unit silently)."""
        with self._cv:
            e = self._entries[request_id]
            if e.finished_at is None and e.lease is not None and (e.lease.owner, e.lease.generation) == (
                    owner, generation):
                e.lease = None
                self.counts["returned"] += 1
                self.counts["returned_units"] += len(e.request.seeds) - len(e.results)
                self._waiting.insert(0, request_id)
                self._cv.notify_all()

    # -- consumer -----------------------------------------------------------------

    def pending(self) -> int:
        """Requests not finished (waiting or leased)."""
        with self._cv:
            return sum(e.finished_at is None for e in self._entries.values())

    def has_waiting(self) -> bool:
        with self._cv:
            return bool(self._waiting)

    def results(self, request_id: str) -> dict:
        """seed -> result of a finished request."""
        with self._cv:
            e = self._entries[request_id]
            if e.finished_at is None:
                raise RuntimeError(f"request {request_id} is not finished")
            return dict(e.results)

    def wait(self, request_ids, timeout_s: float, alive=None) -> None:
        """Block until every request of ``request_ids`` is finished. ``alive()`` (checked about twice a
        second) raises when the workers cannot finish them; past ``timeout_s`` without a unit committed,
        :class:`TimeoutError` in one line."""
        ids = list(request_ids)
        with self._cv:
            last, seen = time.monotonic(), self.counts["units"]
            while not all(self._entries[r].finished_at is not None for r in ids):
                if self.counts["units"] != seen:
                    last, seen = time.monotonic(), self.counts["units"]
                if time.monotonic() - last > timeout_s:
                    left = sum(self._entries[r].finished_at is None for r in ids)
                    raise TimeoutError(f"{left} request(s) made no progress for {timeout_s:g} s "
                                       f"(no unit committed by any spot worker)")
                self._cv.wait(0.5)
                if alive is not None:
                    self._cv.release()
                    try:
                        alive()
                    finally:
                        self._cv.acquire()

    def audit(self) -> dict:
        """The exactly-once check: every request submitted, how many finished with every unit kept once, and
        what was ignored or returned on the way."""
        with self._cv:
            entries = list(self._entries.values())
            units = sum(len(e.request.seeds) for e in entries)
            return {"requests": len(entries), "finished": sum(e.finished_at is not None for e in entries),
                    "units": units, "units_kept": sum(len(e.results) for e in entries), **self.counts}
