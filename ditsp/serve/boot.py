"""A worker process's first steps, before it imports anything heavy: die with the server, then start.

A spawned worker spends seconds importing torch and the job's modules. The
kernel's parent-death signal is armed here first, and the parent checked, so a
server killed (even by SIGKILL) while its workers are still starting leaves
none behind: a starting worker ends at once instead of finishing its imports
as an orphan. This module imports only the standard library (and the packages
``ditsp.serve`` and ``ditsp.distributed``, whose ``__init__`` files load nothing).
"""

from __future__ import annotations

import os

from ..distributed.parent_death import arm_parent_death_signal


def worker_entry(parent_pid: int, *args) -> None:
    """The target of a worker process: armed against orphaning, then :func:`.workers.worker_main`."""
    arm_parent_death_signal()  # where it cannot, the worker's watchdog (die_with_parent) ends it after its imports
    if os.getppid() != parent_pid:  # the server died before the signal was armed
        os._exit(1)
    from .workers import worker_main

    worker_main(*args, parent_pid=parent_pid)
