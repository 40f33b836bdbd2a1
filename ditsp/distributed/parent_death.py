"""The kernel's parent-death signal: a child process that ends when the thread that started it does.

Standard library only, so a process can arm it before importing torch (a server's worker spends seconds
on imports; killed meanwhile, its parent must not leave it behind).
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when the thread that started it ends


def arm_parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when this process's parent thread ends (Linux); False where it cannot
    (other systems, no prctl): the caller's watchdog must then cover it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
