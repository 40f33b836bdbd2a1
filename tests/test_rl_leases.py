"""The spot workers' request queue (ditsp.rl.leases): leases with an owner and a generation, commits kept
exactly once per (request, seed), released work returned whole minus what was committed, rollouts first; and
the cost ledger (ditsp.rl.cost)."""

from __future__ import annotations

import threading

import pytest

from ditsp.rl.cost import CostLedger, Prices
from ditsp.rl.leases import Request, RequestQueue


def _queue(*reqs):
    q = RequestQueue()
    for r in reqs:
        q.submit(r)
    return q


def test_a_request_finishes_once_every_seed_is_kept_once():
    q = _queue(Request("a", "explore", 0, 3, (5, 6)))
    got = q.lease("g1", 1)
    assert got.seeds == (5, 6)
    assert q.commit("a", "g1", 1, 5, 0.5) == "kept"
    assert q.commit("a", "g1", 1, 5, 0.7) == "duplicate"
    assert q.pending() == 1
    assert q.commit("a", "g1", 1, 6, 0.1) == "kept"
    assert q.pending() == 0 and q.results("a") == {5: 0.5, 6: 0.1}
    assert q.commit("a", "g1", 1, 6, 9.9) == "duplicate"  # after it finished: nothing changes
    assert q.results("a") == {5: 0.5, 6: 0.1}
    a = q.audit()
    assert (a["finished"], a["units_kept"], a["duplicates"]) == (1, 2, 2)


def test_a_released_lease_returns_only_the_unfinished_seeds_and_fences_the_old_generation():
    q = _queue(Request("a", "explore", 0, 0, (1, 2, 3)))
    q.lease("w0", 7)
    q.commit("a", "w0", 7, 1, "one")
    assert q.release("w0", 7) == ["a"]
    again = q.lease("w1", 8)
    assert again.seeds == (2, 3)  # the committed unit is not redone
    assert q.commit("a", "w0", 7, 2, "late") == "stale"  # the preempted generation cannot commit any more
    assert q.commit("a", "w1", 8, 2, "two") == "kept"
    assert q.commit("a", "w1", 8, 3, "three") == "kept"
    assert q.results("a") == {1: "one", 2: "two", 3: "three"}
    a = q.audit()
    assert (a["returned"], a["returned_units"], a["stale"], a["leases"]) == (1, 2, 1, 2)


def test_rollouts_are_leased_before_exploration_and_returned_work_goes_first():
    q = _queue(Request("e1", "explore", 0, 0, (1,)), Request("e2", "explore", 0, 1, (1,)),
               Request("r1", "rollout", 1, 0, (1,)))
    assert q.lease("g", 1).id == "r1"
    assert q.lease("g", 1).id == "e1"
    q.release("g", 1)  # e1 (r1 too: neither finished) back to the head
    assert [q.lease("h", 2).id for _ in range(3)] == ["r1", "e1", "e2"]
    assert q.lease("h", 2) is None


def test_a_group_that_says_done_with_seeds_missing_gives_them_back():
    q = _queue(Request("a", "rollout", 0, 0, (1, 2)))
    q.lease("g", 1)
    q.commit("a", "g", 1, 1, 1.0)
    q.done("a", "g", 1)
    assert q.lease("g", 2).seeds == (2,)


def test_bad_requests_and_units_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        Request("a", "explore", 0, 0, (1, 1))
    with pytest.raises(ValueError, match="rollout, explore, audit"):
        Request("a", "train", 0, 0, (1,))
    q = _queue(Request("a", "explore", 0, 0, (1,)))
    with pytest.raises(ValueError, match="submitted twice"):
        q.submit(Request("a", "explore", 0, 0, (1,)))
    with pytest.raises(KeyError):
        q.commit("a", "g", 1, 99, 0.0)
    with pytest.raises(RuntimeError, match="not finished"):
        q.results("a")


def test_wait_returns_when_done_and_says_when_nothing_moves():
    q = _queue(Request("a", "explore", 0, 0, (1,)))
    q.lease("g", 1)
    t = threading.Timer(0.2, lambda: q.commit("a", "g", 1, 1, 0.0))
    t.start()
    q.wait(["a"], timeout_s=60)
    t.join()
    q.submit(Request("b", "explore", 0, 0, (1,)))
    with pytest.raises(TimeoutError, match="1 request\\(s\\) made no progress for 0.1 s"):
        q.wait(["b"], timeout_s=0.1)

    def broken():
        raise RuntimeError("the pool stopped")

    with pytest.raises(RuntimeError, match="the pool stopped"):
        q.wait(["b"], timeout_s=60, alive=broken)


def test_cost_counts_each_stretch_at_its_price():
    ledger = CostLedger(Prices(spot_fraction=0.3))
    ledger.join("trainer", "reserved", 0.0)
    ledger.join("spot0.0", "spot", 0.0)
    ledger.leave("spot0.0", 1800.0)  # preempted after half an hour
    ledger.join("spot0.1", "spot", 2700.0)
    rep = ledger.report(3600.0)  # the run ends at one hour; open stretches end with it
    assert rep["reserved_s"] == 3600.0 and rep["spot_s"] == 1800.0 + 900.0
    assert rep["cost_device_hours"] == pytest.approx(1.0 + 0.3 * 0.75)
    assert "0.3x on-demand" in rep["prices"]
    with pytest.raises(ValueError, match="joined twice"):
        ledger.join("trainer", "reserved", 5.0)
    with pytest.raises(ValueError, match="without having joined"):
        ledger.leave("nobody", 5.0)
    with pytest.raises(ValueError, match="reserved, spot"):
        ledger.join("x", "preemptible", 0.0)
