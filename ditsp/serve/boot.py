"""A worker process's first steps, before it imports anything heavy: die with the server, then start.

A spawned worker spends seconds importing torch and the job's modules. The
kernel's parent-death signal is armed here first, and the parent checked, so a
server killed (even by SIGKILL) while its workers are still starting leaves
none behind: a starting worker ends at once instead of finishing its imports
as an orphan. This module imports only the standard library (and the package
``ditsp.serve``, whose ``__init__`` loads nothing).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when the thread that started it ends


def worker_entry(parent_pid: int, *args) -> None:
    """The target of a worker process: armed against orphaning, then :func:`.workers.worker_main`."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the worker's parent watchdog (die_with_parent) still ends it once its imports are done
    if os.getppid() != parent_pid:  # the server died before the signal was armed
        os._exit(1)
    from .workers import worker_main

    worker_main(*args, parent_pid=parent_pid)
