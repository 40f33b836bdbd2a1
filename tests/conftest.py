"""Shared fixtures: a pool of local gloo ranks reused across tests (spawning costs seconds), and the
``ranks`` marker, applied automatically to every test that runs ranks in other processes, so that
``pytest -m "not ranks"`` is the fast loop."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from ditsp.distributed.launcher import LocalCluster

# A multi-rank call in a test is stuck, and fails with where each rank waits, once none of its ranks made
# progress (a heartbeat, CPU time outside waits: ditsp.distributed.heartbeat) for this many seconds. A
# rank that computes slowly on a busy machine is never cut by it.
RANK_TIMEOUT_S = 60.0
# The host memory every resource check plans against in the tests (ditsp.memory.AVAILABLE_ENV, GiB), set
# for this process and the ranks and programs it starts: whether a test runs never depends on what other
# processes hold at that instant (a busy machine refused `verify` on its shipped sets). Every test's work
# fits in it; the tests of the check itself set their own figure.
os.environ["DITSP_AVAILABLE_GIB"] = "16"
# At most this many pool ranks stay alive between tests (each is a process holding torch, ~0.35 GiB);
# asking for a size that would pass it closes the least recently used clusters first. 14 keeps the
# sizes most tests cycle through (2, 3, 4 and 5 ranks: ~5 GiB) alive together: with room for fewer,
# a test that walks the degrees respawned every cluster it used, and spawning was most of the
# multi-rank tests' time (a 4-degree matrix: 50-70 s respawning, 5-6 s reusing).
IDLE_RANKS = int(os.environ.get("DITSP_TEST_IDLE_RANKS", "14"))
# What in a test's own source means it starts ranks in other processes (besides the clusters fixture):
# local clusters, a multi-rank CLI run or dispatch, the server's workers, a subprocess.
_SPAWNS = ("LocalCluster(", '"--sp", "2"', '"--sp", "3"', '"--sp", "4"', "sp=2", "sp=3", "sp=4", "create_app(",
           "Worker(", "subprocess.", "ranks=")


def _spawns(item) -> bool:
    if "clusters" in getattr(item, "fixturenames", ()):
        return True
    fn = getattr(item, "function", None)
    try:
        src = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return False
    return any(s in src for s in _SPAWNS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _spawns(item):
            item.add_marker(pytest.mark.ranks)


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` -> a live LocalCluster of n CPU ranks, shared by the whole session.

    Run a module-level function on every rank with ``clusters(n).run(fn, *args)``;
    a rank that raises or hangs fails the test with its traceback.
    """
    pool: dict[int, LocalCluster] = {}  # insertion order = least recently used first

    def get(n: int) -> LocalCluster:
        c = pool.pop(n, None)
        if c is None or not c.alive:
            for m in list(pool):  # make room: the least recently used sizes go first
                if sum(pool) + n <= IDLE_RANKS:
                    break
                pool.pop(m).close()
            c = LocalCluster(n, timeout_s=RANK_TIMEOUT_S, threads=1)
        pool[n] = c
        return c

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

