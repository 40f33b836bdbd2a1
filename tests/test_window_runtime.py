"""Window-aligned SP runtime on real gloo ranks: exchange, text reduction, gather, agreement."""

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ditsp.distributed.agree import DisagreementError
from ditsp.distributed.comm import Comm
from ditsp.distributed.launcher import RankError
from ditsp.windows.geometry import window_layout
from ditsp.sp import WindowRuntime
from ditsp.windows.schedule import plan_schedule

pytestmark = pytest.mark.timeout(180)

WORLD_SIZES = [1, 2, 3, 4]
GRID = (5, 20, 36)  # 12 regular, 12 shifted windows (the reference vectors' grid)
TINY_GRID = (1, 8, 8)  # one window per layout: more ranks than windows
DIM = 8


def canonical_input(grid, dim=DIM, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(math.prod(grid), dim, generator=g).to(dtype)


# ----------------------------------------------------------------- rank-side


def walk_schedule(ctx, grid, schedule, dtype_name):
    """Distribute, walk the schedule with ids as payload, gather; report bytes per transition."""
    dtype = getattr(torch, dtype_name)
    rt = WindowRuntime(grid, schedule, Comm(ctx.group), dtype=dtype)
    n = math.prod(grid)
    x = torch.arange(n)[:, None].repeat(1, 3).to(dtype)  # canonical ids as payload
    local = rt.scatter(x, 0)
    per_transition = []
    for layer in range(len(schedule)):
        before = rt.comm.stats.kinds["window_exchange"].bytes_sent, rt.comm.stats.kinds["window_exchange"].bytes_recv
        local = rt.enter_layer(local, layer)
        after = rt.comm.stats.kinds["window_exchange"].bytes_sent, rt.comm.stats.kinds["window_exchange"].bytes_recv
        assert torch.equal(local, x[rt.local_token_ids(layer)]), f"layer {layer}: rows out of place"
        per_transition.append((after[0] - before[0], after[1] - before[1]))
    out = rt.gather(local)
    return torch.equal(out, x), per_transition, rt.comm.stats.kinds["window_exchange"].calls


def window_model(rt, x_canonical, txt, layers):
    """A weight-free window model: per-window softmax attention over [window, text], then the text mean."""
    x = rt.scatter(x_canonical, 0)
    scale = 1.0 / math.sqrt(x.shape[1])
    for layer in range(layers):
        x = rt.enter_layer(x, layer)
        lengths = [math.prod(s) for s in rt.local_window_shapes(layer)]
        outs, txt_sum = [], torch.zeros_like(txt)
        for seg in x.split(lengths):
            z = torch.cat([seg, txt])
            a = torch.softmax((z @ z.T) * scale, dim=-1) @ z
            outs.append(a[: seg.shape[0]])
            txt_sum = txt_sum + a[seg.shape[0]:]
        x = x + (torch.cat(outs) if outs else torch.zeros_like(x))
        txt = txt + rt.reduce_text(txt_sum, layer)
    return rt.gather(x), txt


def run_window_model(ctx, grid, schedule, dtype_name):
    dtype = getattr(torch, dtype_name)
    rt = WindowRuntime(grid, schedule, Comm(ctx.group), dtype=dtype)
    x = canonical_input(grid, dtype=dtype)
    txt = canonical_input((3, 1, 1), dtype=dtype, seed=1)
    vid, txt = window_model(rt, x, txt, len(schedule))
    return vid, txt, rt.comm.stats.as_dict(), rt.plan(0).rank_windows[ctx.rank]


def mismatched_grid(ctx):
    grid = (5, 20, 36) if ctx.rank != 1 else (5, 20, 37)
    t0 = time.monotonic()
    try:
        WindowRuntime(grid, ["regular", "shifted"], Comm(ctx.group))
    except DisagreementError as e:
        return "disagree", str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def rank_fails(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("deliberate failure on the last rank")
    torch.distributed.barrier(group=ctx.group)


# ----------------------------------------------------------------- tests


def on_ranks(clusters, world, fn, *args):
    """``fn`` on ``world`` pooled ranks; world 1 runs in this process without a group."""
    if world == 1:
        return [fn(SimpleNamespace(rank=0, world_size=1, group=None), *args)]
    return clusters(world).run(fn, *args)


def single_reference(grid, schedule, dtype=torch.float32):
    rt = WindowRuntime.single(grid, schedule, dtype=dtype)
    x = canonical_input(grid, dtype=dtype)
    txt = canonical_input((3, 1, 1), dtype=dtype, seed=1)
    return window_model(rt, x, txt, len(schedule))


def random_schedules(n=3, seed=7):
    rng = np.random.default_rng(seed)
    out = [["regular", "shifted"] * 3, ["regular", "regular", "shifted", "shifted", "regular"]]
    for _ in range(n):
        out.append(list(rng.choice(["regular", "shifted"], size=int(rng.integers(1, 7)))))
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_walk_schedule_is_identity_and_bytes_match_plan(clusters, world):
    schedules = random_schedules()
    for schedule in schedules:
        results = on_ranks(clusters, world, walk_schedule, GRID, schedule, "float32")
        plan = plan_schedule(GRID, schedule, world)
        transitions = dict(plan.transitions())
        row_bytes = 3 * 4
        for rank, (identity, per_layer, calls) in enumerate(results):
            assert identity
            for layer, (sent, recv) in enumerate(per_layer):
                t = transitions.get(layer)
                want = (0, 0) if t is None else (int(t.rank_send[rank]) * row_bytes, int(t.rank_recv[rank]) * row_bytes)
                assert (sent, recv) == want, f"layer {layer} rank {rank}"
            # a collective per transition on every rank, or none at all when nothing crosses ranks
            assert calls == sum(1 for t in transitions.values() if t.exchange_required)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_more_ranks_than_windows(clusters, world):
    results = clusters(world).run(walk_schedule, TINY_GRID, ["regular", "shifted", "regular"], "float32")
    assert all(identity for identity, _, _ in results)


@pytest.mark.bitwise
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("grid", [GRID, TINY_GRID], ids=["12win", "1win"])
def test_window_model_matches_single_device(clusters, world, grid):
    schedule = ["regular", "shifted", "shifted", "regular"]
    ref_vid, ref_txt = single_reference(grid, schedule)
    results = on_ranks(clusters, world, run_window_model, grid, schedule, "float32")
    scale = ref_vid.abs().max()
    for vid, txt, stats, _ in results:
        assert (vid - ref_vid).abs().max() <= 1e-5 * scale
        assert (txt - ref_txt).abs().max() <= 1e-5 * ref_txt.abs().max()
        if world > 1:
            assert stats["text_all_reduce"]["calls"] == len(schedule)
            assert stats["output_gather"]["calls"] == 1


def test_text_output_is_the_plain_mean_over_windows(clusters):
    """One layer: the distributed text update equals the unweighted mean of per-window outputs."""
    txt0 = canonical_input((3, 1, 1), seed=1)
    x = canonical_input(GRID)
    lay = window_layout(GRID, "regular")
    per_window = []
    for i in range(len(lay)):
        z = torch.cat([x[torch.from_numpy(lay.window_token_ids(i).copy())], txt0])
        a = torch.softmax((z @ z.T) / math.sqrt(DIM), dim=-1) @ z
        per_window.append(a[-3:])
    want = txt0 + torch.stack(per_window).mean(0)
    weighted = txt0 + sum(p * int(c) for p, c in zip(per_window, lay.token_counts)) / lay.num_tokens
    for _, txt, _, _ in clusters(3).run(run_window_model, GRID, ["regular"], "float32"):
        assert torch.allclose(txt, want, atol=1e-6)
        assert not torch.allclose(txt, weighted, atol=1e-6)  # the test can tell the two means apart


@pytest.mark.bitwise
def test_empty_rank_path_in_bf16(clusters):
    schedule = ["regular", "shifted"]
    ref_vid, ref_txt = single_reference(TINY_GRID, schedule, torch.bfloat16)
    results = clusters(3).run(run_window_model, TINY_GRID, schedule, "bfloat16")
    assert sum(1 for *_, windows in results if not windows) == 2  # two ranks own nothing
    for vid, txt, _, _ in results:
        assert vid.dtype == torch.bfloat16 and txt.dtype == torch.bfloat16
        assert torch.equal(vid, ref_vid) and torch.equal(txt, ref_txt)


def test_mismatched_geometry_raises_on_every_rank(clusters):
    results = clusters(3).run(mismatched_grid)
    for status, message, _ in results:
        assert status == "disagree"
        assert "grid" in message and "rank 1" in message


def test_failing_rank_ends_the_call_with_its_traceback(clusters):
    # an hour's no-progress window, far past the test's timeout: the failure ends the call, not the window
    with pytest.raises(RankError, match="deliberate failure on the last rank"):
        clusters(2).run(rank_fails, timeout_s=3600)
    assert clusters(2).run(walk_schedule, GRID, ["regular"], "float32")[0][0]  # the pool recovers
