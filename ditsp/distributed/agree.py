"""Make every rank of a group agree on a value before collectives depend on it.

A rank with a different grid, schedule, dtype or config would otherwise issue
different collectives and hang its peers; here every rank learns of the
mismatch and raises the same clear error.
"""

from __future__ import annotations

import hashlib
import json

from .comm import Comm


class DisagreementError(RuntimeError):
    """Ranks of one group were given different values for something they must share."""


def fingerprint(value) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def agree(comm: Comm, what: str, value) -> None:
    """Raise :class:`DisagreementError` on every rank unless all ranks pass equal ``value``."""
    mine = (fingerprint(value), json.dumps(value, sort_keys=True, default=str)[:300])
    everyone = comm.all_gather_object(mine)
    if len({fp for fp, _ in everyone}) > 1:
        lines = [f"  rank {r}: {desc}" for r, (_, desc) in enumerate(everyone)]
        raise DisagreementError(f"ranks disagree on {what}:\n" + "\n".join(lines))
