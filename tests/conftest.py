"""Shared fixtures: a pool of local gloo ranks reused across tests (spawning costs seconds)."""

from __future__ import annotations

import pytest
import torch

from ditsp.distributed.launcher import LocalCluster

# Every collective in a test fails after this many seconds instead of hanging.
RANK_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` -> a live LocalCluster of n CPU ranks, shared by the whole session.

    Run a module-level function on every rank with ``clusters(n).run(fn, *args)``;
    a rank that raises or hangs fails the test with its traceback.
    """
    pool: dict[int, LocalCluster] = {}

    def get(n: int) -> LocalCluster:
        if n not in pool or not pool[n].alive:
            pool[n] = LocalCluster(n, timeout_s=RANK_TIMEOUT_S, threads=1)
        return pool[n]

    yield get
    for c in pool.values():
        c.close()


@pytest.fixture
def one_thread():
    """Run the test body like a rank: one compute thread (bitwise comparisons hold per thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

