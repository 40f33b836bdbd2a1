"""Preemption traces: when spot workers join and leave a run, read from a small text file.

The format, one event per line (blank lines and ``#`` comments are skipped)::

    # time_s  event  worker  [grace_s]
    0         join   spot0
    0         join   spot1
    4.5       leave  spot0   1.0
    9         join   spot0

``time_s`` is seconds from the start of the run (the moment the trainer starts
its first step), non-decreasing down the file. ``join`` starts a worker of that
name (a fresh process each time); ``leave`` preempts it as a spot provider
does: SIGTERM, then SIGKILL once ``grace_s`` (default :data:`DEFAULT_GRACE_S`)
has passed. A worker name is letters, digits, ``_`` or ``-``; a worker joins
only while it is out and leaves only while it is in. Every problem is one line
naming the file, the line and what is wrong (:class:`TraceError`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

EVENTS = ("join", "leave")
DEFAULT_GRACE_S = 2.0  # the warning a preempted worker gets before SIGKILL (clouds give 30 s-2 min; runs here are tiny)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class TraceError(ValueError):
    """A trace file that cannot be used, in one line: the file, the line number and what is wrong."""


@dataclass(frozen=True)
class Event:
    """One line of a trace."""

    time_s: float
    kind: str  # one of EVENTS
    worker: str
    grace_s: float = DEFAULT_GRACE_S  # for a leave: SIGTERM -> SIGKILL


@dataclass(frozen=True)
class Trace:
    """A validated list of events, in time order."""

    events: tuple[Event, ...]
    source: str = "<trace>"

    @property
    def workers(self) -> list[str]:
        """Every worker the trace names, in order of first appearance."""
        return list(dict.fromkeys(e.worker for e in self.events))

    def members_at(self, time_s: float) -> set[str]:
        """The workers in the run at ``time_s`` (events at exactly ``time_s`` applied)."""
        inside: set[str] = set()
        for e in self.events:
            if e.time_s > time_s:
                break
            (inside.add if e.kind == "join" else inside.discard)(e.worker)
        return inside

    def preemptions(self) -> int:
        return sum(e.kind == "leave" for e in self.events)


def _number(text: str, what: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} must be a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise TraceError(f"{where}: {what} must be a finite number of seconds >= 0, got {text!r}")
    return v


def parse(text: str, source: str = "<trace>") -> Trace:
    """The trace in ``text``; :class:`TraceError` on the first problem."""
    events: list[Event] = []
    inside: set[str] = set()
    last = 0.0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {n}"
        cols = line.split()
        if len(cols) < 3 or len(cols) > 4:
            raise TraceError(f"{where}: expected 'time_s event worker [grace_s]', got {line!r}")
        t = _number(cols[0], "the time", where)
        kind, worker = cols[1], cols[2]
        if kind not in EVENTS:
            raise TraceError(f"{where}: the event must be one of {', '.join(EVENTS)}, got {kind!r}")
        if not _NAME.fullmatch(worker):
            raise TraceError(f"{where}: a worker name is 1-64 letters, digits, '_' or '-', got {worker!r}")
        if t < last:
            raise TraceError(f"{where}: times must not decrease ({t:g} s after {last:g} s)")
        grace = DEFAULT_GRACE_S
        if len(cols) == 4:
            if kind != "leave":
                raise TraceError(f"{where}: only a leave takes a grace period, got {cols[3]!r} after a join")
            grace = _number(cols[3], "the grace period", where)
        if kind == "join" and worker in inside:
            raise TraceError(f"{where}: {worker} joins at {t:g} s but is already in the run")
        if kind == "leave" and worker not in inside:
            raise TraceError(f"{where}: {worker} leaves at {t:g} s but is not in the run")
        (inside.add if kind == "join" else inside.discard)(worker)
        events.append(Event(t, kind, worker, grace))
        last = t
    if not events:
        raise TraceError(f"{source}: the trace holds no event (each line: 'time_s event worker [grace_s]')")
    return Trace(tuple(events), source)


def load(path: str | Path) -> Trace:
    """The trace in the file at ``path``; :class:`TraceError` when it cannot be read or is invalid."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({type(e).__name__}: {e})") from None
    return parse(text, str(path))


def steady(workers: int) -> Trace:
    """``workers`` spot workers joining at the start and never leaving (a run without preemptions)."""
    if workers < 1:
        raise TraceError(f"a run needs at least one spot worker, got {workers}")
    return Trace(tuple(Event(0.0, "join", f"spot{i}") for i in range(workers)), f"{workers} steady workers")
