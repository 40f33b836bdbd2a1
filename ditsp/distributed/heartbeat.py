"""A rank's signs of life for its launcher, and the launcher's judgement of slow against stuck.

In a rank: a counter in shared memory that work bumps as it progresses
(:func:`beat`: collectives through :class:`ditsp.distributed.comm.CommStats`,
pipeline stages), and a second one that says when the rank is inside a wait
that burns CPU without progressing (:func:`waiting`: the shared-memory
all-gather's spin on its peers' counters). Outside a launched rank both do
nothing.

In the launcher: :class:`Progress`. A process progressed when its heartbeat
moved or when it used CPU time outside a wait (a rank computing for minutes
between two collectives is slow, not stuck); a rank blocked in a collective,
a lock or a sleep uses almost none (gloo's I/O thread: about 0.4% of a core).
CPU time is read from ``/proc/<pid>/stat``; where there is none (not Linux),
heartbeats alone say it.
"""

from __future__ import annotations

import os
from collections import deque
from contextlib import contextmanager

# A process whose CPU time outside waits grew by at least CPU_SHARE of the span (and at least CPU_FLOOR_S:
# the kernel counts CPU time in clock ticks, 10 ms here, and charges a tick to whatever runs when it falls)
# over the last CPU_SPAN_S seconds (or the whole window when shorter) is computing. A blocked rank uses
# 0.3-0.5% of a core; a computing one, even one of 20 runnable processes on 2 cores, about 10%.
CPU_SHARE = 0.02
CPU_FLOOR_S = 0.05
CPU_SPAN_S = 5.0

_slot = None  # (beats array, index, waits array or None) once installed in a launched rank


def install(array, index: int, waits=None) -> None:
    """Called by the launcher in each rank: ``beat()`` bumps ``array[index]`` from now on, and
    :func:`waiting` bumps ``waits[index]`` on entry and exit (odd: inside a wait)."""
    global _slot
    _slot = (array, index, waits)


def beat() -> None:
    """Progress was made (a collective completed, a stage ended): costs one shared-memory write."""
    if _slot is not None:
        a, i, _ = _slot
        a[i] += 1


@contextmanager
def waiting():
    """Wrap a wait that spins (burns CPU while it waits on other ranks): the CPU it uses is not progress,
    so a rank stuck there is still found stuck. Two shared-memory writes."""
    slot = _slot
    if slot is None or slot[2] is None:
        yield
        return
    _, i, w = slot
    w[i] += 1
    try:
        yield
    finally:
        w[i] += 1


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, every thread) process ``pid`` has used; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


try:
    _TICKS = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):
    _TICKS = 100


class _Seen:
    __slots__ = ("beat", "wait", "cpu", "used", "history", "last")

    def __init__(self, beat, wait, cpu, now: float, start: float):
        self.beat, self.wait, self.cpu = beat, wait, cpu
        self.used = 0.0  # CPU seconds outside waits since the first look
        self.history = deque([(now, 0.0)])  # (time, used) over the last span
        self.last = start  # when it last progressed


class Progress:
    """When each watched process last progressed, from what :meth:`look` is shown about twice a second.

    The launcher's stuck check: a call is stuck once none of its pending ranks progressed for its window.
    """

    def __init__(self, window_s: float, start: float):
        self.span_s = min(float(window_s), CPU_SPAN_S)
        self.need_s = max(CPU_FLOOR_S, CPU_SHARE * self.span_s)
        self.start = start
        self._seen: dict = {}

    def look(self, key, now: float, pid: int | None, beat: int, wait: int | None = None) -> float:
        """Record one look at process ``key`` (its pid, heartbeat and wait counters now); returns when it
        last progressed (``start`` until it first does)."""
        cpu = cpu_seconds(pid) if pid is not None else None
        s = self._seen.get(key)
        if s is None:
            self._seen[key] = _Seen(beat, wait, cpu, now, self.start)
            return self.start
        if beat != s.beat:
            s.last = now
        inside_one_wait = wait is not None and wait == s.wait and wait % 2 == 1  # the same wait at both looks
        if cpu is not None and s.cpu is not None and not inside_one_wait:
            s.used += max(0.0, cpu - s.cpu)
        s.beat, s.wait, s.cpu = beat, wait, cpu
        s.history.append((now, s.used))
        while len(s.history) > 1 and s.history[1][0] <= now - self.span_s:
            s.history.popleft()
        if s.used - s.history[0][1] >= self.need_s:
            s.last = now
        return s.last
