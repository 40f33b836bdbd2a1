"""A step that fails on one rank while its peers wait for it in a collective: every rank learns of it at once,
the group is formed again and the next step runs on it (ditsp.distributed.recoverable).

Slow against stuck: the pooled ranks' collectives wait 600 s (the launcher's floor) and a call counts as stuck
only after 60 s in which no rank progressed, so peers that waited for the collective's timeout would fail the
test as stuck, with where each waits, long before that timeout; a recovery that works finishes in seconds.
"""

from __future__ import annotations

import time

import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.distributed.recoverable import RecoverableGroup

pytestmark = pytest.mark.timeout(240)


def _oom(e: Exception) -> dict | None:
    return {"error": str(e)} if isinstance(e, torch.OutOfMemoryError) else None


def _steps(comm: Comm, failing: int, where: str, calls: int) -> int:
    """``calls`` all-gathers (shared memory from the ninth on), then an all-to-all; rank ``failing`` stops
    before the ``where`` call ("gather": the last all-gather; "all_to_all") as if an allocation failed."""
    t = torch.full((4,), float(comm.rank))
    for i in range(calls):
        if comm.rank == failing and where == "gather" and i == calls - 1:
            raise torch.OutOfMemoryError(f"rank {comm.rank}: no memory for all-gather {i}")
        assert [float(x[0]) for x in comm.all_gather_rows(t, [4] * comm.world_size)] == list(range(comm.world_size))
    if comm.rank == failing and where == "all_to_all":
        raise torch.OutOfMemoryError(f"rank {comm.rank}: no memory for the all-to-all")
    n = comm.world_size
    out = comm.all_to_all_single(torch.arange(n, dtype=torch.float32) + 10 * comm.rank, [1] * n, [1] * n)
    return int(out.sum())


def _fail_then_go_on(ctx, failing: int, where: str) -> dict:
    group = RecoverableGroup(ctx.group)
    start = time.monotonic()
    first = group.attempt(lambda comm: _steps(comm, failing, where, calls=12), _oom)
    failed_s = time.monotonic() - start
    second = group.attempt(lambda comm: _steps(comm, -1, where, calls=12), _oom)
    group.close()
    return {"first": first, "second": second, "generation": group.generation, "failed_s": failed_s}


@pytest.mark.parametrize("sp", [2, 3])
@pytest.mark.parametrize("where", ["gather", "all_to_all"])
def test_a_failure_on_one_rank_reaches_every_rank_and_the_group_goes_on(clusters, sp, where):
    failing = sp - 1
    out = clusters(sp).run(_fail_then_go_on, failing, where)
    for r, o in enumerate(out):
        assert o["first"].failed and not o["second"].failed, (r, o)
        assert [f["error"] for f in o["first"].failures] == [f"rank {failing}: no memory for "
                                                             + ("all-gather 11" if where == "gather" else "the all-to-all")]
        assert o["generation"] == 1
        n = sp
        assert o["second"].result == sum(r + 10 * k for k in range(n))  # the new group's all-to-all is right
    # as a diagnosis only (the pass condition is that the call finished: module doc)
    assert max(o["failed_s"] for o in out) < 300, [o["failed_s"] for o in out]


def _rank0_fails_otherwise(comm: Comm) -> int:
    if comm.rank == 0:
        raise ValueError("not a memory error")
    return _steps(comm, -1, "all_to_all", calls=3)


def _raise_unrecoverable(ctx) -> None:
    group = RecoverableGroup(ctx.group)
    try:
        group.attempt(_rank0_fails_otherwise, _oom)
    finally:
        group.close()


def test_an_error_that_is_not_recoverable_is_raised_and_peers_do_not_hang(clusters):
    """Rank 0's own error is raised as it is; rank 1, waiting for it in a collective, fails once rank 0's group
    goes (an answer, not a rank the launcher had to give up on)."""
    from ditsp.distributed.launcher import RankError

    with pytest.raises(RankError) as e:
        clusters(2).run(_raise_unrecoverable)
    first = str(e.value).splitlines()[0]
    assert "rank 0: ValueError: not a memory error" in first, first
    assert "rank 1: " in first and "no answer" not in first and "no progress" not in first, first


def test_one_rank_needs_no_group():
    from ditsp.distributed.launcher import RankContext

    group = RecoverableGroup(None)
    ctx = RankContext(0, 1, None, torch.device("cpu"))
    a = group.attempt(lambda comm: _steps(comm, 0, "all_to_all", calls=2), _oom)
    assert a.failed and a.failures == ({"error": "rank 0: no memory for the all-to-all"},) and ctx.rank == 0
    assert group.attempt(lambda comm: comm.world_size, _oom).result == 1
    with pytest.raises(ValueError):
        group.attempt(lambda comm: int("x"), _oom)
