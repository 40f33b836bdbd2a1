"""ditsp.distributed.shm_gather: the same tensors as gloo's all-gather, slots that grow, payloads too big for it
left to gloo, ranks that disagree all falling back, a peer that never comes is an error, nothing left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from ditsp.cpu import settings as cpu_settings
from ditsp.distributed import shm_gather
from ditsp.distributed.comm import Comm

pytestmark = pytest.mark.timeout(120)


def _payloads(rank: int):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 5, generator=g), torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),
            torch.randn(4, 6, generator=g).bfloat16().t(), torch.empty(0, 3), torch.randn(2, 3, 4, generator=g).double()]


def rank_equal_to_gloo(ctx):
    group = dist.new_group(list(range(ctx.world_size)))
    comm = Comm(group)
    for _ in range(shm_gather.AFTER_CALLS):  # a Comm's first all-gathers go through gloo
        comm.all_gather_ints([ctx.rank])
    assert comm._shm is None
    comm.all_gather_ints([ctx.rank])  # the next one sets the segment up
    assert isinstance(comm._shm, shm_gather.ShmGather)
    out = []
    for t in _payloads(ctx.rank):
        mine = comm._all_gather(t.contiguous())
        theirs = [torch.empty_like(t.contiguous()) for _ in range(ctx.world_size)]
        dist.all_gather(theirs, t.contiguous(), group=group)
        out.append(all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(mine, theirs)))
    uneven = [2, 0, 3][:ctx.world_size]
    rows = comm.all_gather_rows(torch.full((uneven[ctx.rank], 2), float(ctx.rank)), uneven)
    out.append(all(torch.equal(r, torch.full((uneven[p], 2), float(p))) for p, r in enumerate(rows)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_same_tensors_as_gloo(clusters, world):
    for rank in clusters(world).run(rank_equal_to_gloo):
        assert all(rank), rank


def rank_grows_then_falls_back(ctx, monkeypatch_max):
    group = dist.new_group(list(range(ctx.world_size)))
    comm = Comm(group)
    for _ in range(shm_gather.AFTER_CALLS + 1):
        comm.all_gather_ints([ctx.rank])
    gather = comm._shm
    first = gather.slot
    big = torch.full(((first // 4) + 10,), float(ctx.rank))  # a float32 payload just over the first slot
    got = gather.all_gather(big)
    grown = gather.slot
    small = gather.all_gather(torch.tensor([ctx.rank]))
    shm_gather.MAX_SLOT_BYTES, saved = monkeypatch_max, shm_gather.MAX_SLOT_BYTES
    try:
        over = comm._all_gather(torch.full((monkeypatch_max // 4 + 1,), float(ctx.rank)))  # over the cap: by gloo
    finally:
        shm_gather.MAX_SLOT_BYTES = saved
    return (first, grown, gather.slot, [float(g[0]) for g in got], [int(s) for s in small],
            [float(o[-1]) for o in over])


def test_a_slot_grows_for_a_bigger_payload_and_gloo_takes_what_is_over_the_cap(clusters):
    for first, grown, after, got, small, over in clusters(2).run(rank_grows_then_falls_back, 1 << 16):
        assert grown >= 2 * first and after == grown  # the cap's fallback left the segment alone
        assert got == [0.0, 1.0] and small == [0, 1] and over == [0.0, 1.0]


def rank_disagrees(ctx):
    with cpu_settings.use(shm_collectives=ctx.rank != 1):
        group = dist.new_group(list(range(ctx.world_size)))
        gather = shm_gather.open_for(group)
        comm = Comm(group)
        for _ in range(shm_gather.AFTER_CALLS + 1):
            outs = comm.all_gather_rows(torch.full((1,), float(ctx.rank)), [1] * ctx.world_size)
    return gather is None and comm._shm is False, [float(o) for o in outs]


def test_one_rank_switched_off_sends_every_rank_to_gloo(clusters):
    for off, got in clusters(2).run(rank_disagrees):
        assert off and got == [0.0, 1.0]


def rank_one_stays_away(ctx, dead_pid):
    group = dist.new_group(list(range(ctx.world_size)))
    gather = shm_gather.open_for(group)
    dist.barrier(group=group)  # rank 0 has returned from the set-up, which removes the name
    name_left = any(f.startswith("ditsp-gather-") for f in os.listdir(shm_gather.SHM_DIR))
    if ctx.rank == 1:
        return name_left, None, None
    errors = []
    gather.timeout_s = 0.5
    for pid in (gather.pids[1], dead_pid):  # rank 1 alive but away, then as if its process were gone
        gather.pids[1] = pid
        try:
            gather.all_gather(torch.zeros(4))
        except (TimeoutError, RuntimeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return name_left, *errors


def test_a_peer_that_never_comes_or_is_gone_is_an_error_naming_it_and_no_segment_is_left(clusters):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    (left0, stuck, gone), (left1, _, _) = clusters(2).run(rank_one_stays_away, child.pid)
    assert not left0 and not left1
    assert stuck.startswith("TimeoutError: rank 0") and "for rank 1 to write its rows" in stuck
    assert gone.startswith(f"RuntimeError: rank 0: rank 1 (pid {child.pid}) is gone")


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert shm_gather._alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while shm_gather._alive(child.pid):  # killed, not yet reaped: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert not shm_gather._alive(child.pid)


def rank_one_off_calls(ctx):
    comm = Comm(dist.new_group(list(range(ctx.world_size))))
    for _ in range(shm_gather.AFTER_CALLS):
        comm.all_gather_ints([ctx.rank])
    return comm._shm is None


def test_a_comm_of_few_all_gathers_sets_nothing_up(clusters):
    assert all(clusters(2).run(rank_one_off_calls))
