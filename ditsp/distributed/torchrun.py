"""Whether this process is one rank of a torchrun job (the one test every front door and launcher asks)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """True when torchrun started this process: it set RANK and WORLD_SIZE (the job's ranks are its world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
