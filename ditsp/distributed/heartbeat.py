"""A rank's sign of life for its launcher: a counter in shared memory that work bumps as it progresses.

The launcher's deadline is a stuck-rank check, not a limit on the whole call:
a rank is stuck when its counter has not moved for the timeout. Collectives
(:class:`ditsp.distributed.comm.CommStats`) and pipeline stages call :func:`beat`;
outside a launched rank it does nothing.
"""

from __future__ import annotations

_slot = None  # (shared array, index) once installed in a launched rank


def install(array, index: int) -> None:
    """Called by the launcher in each rank: ``beat()`` bumps ``array[index]`` from now on."""
    global _slot
    _slot = (array, index)


def beat() -> None:
    """Progress was made (a collective completed, a stage ended): costs one shared-memory write."""
    if _slot is not None:
        a, i = _slot
        a[i] += 1
