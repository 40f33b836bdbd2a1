"""ditsp.distributed.transport: chunked vs off (bitwise, forward and gradients), capacity, agreement and fallbacks."""

from __future__ import annotations

import pytest
import torch

from ditsp.config import ParallelConfig, ParallelConfigError
from ditsp.distributed import transport as tp
from ditsp.distributed.comm import Comm

pytestmark = pytest.mark.timeout(120)


def _splits(rank: int, n: int, seed: int, empty: bool):
    """A consistent random count matrix (rows r -> p); with ``empty``, rank n-1 sends and receives nothing."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 9, (n, n), generator=g)
    if empty:
        m[n - 1, :] = 0
        m[:, n - 1] = 0
    return m, [int(v) for v in m[rank]], [int(v) for v in m[:, rank]]


def rank_rows(ctx, seed, empty, dtype, capacity, recv_perm):
    """One exchange of rows under off and chunked: outputs, input gradients, staging peaks, counts."""
    torch.manual_seed(100 + ctx.rank)
    n = ctx.world_size
    m, ins, outs = _splits(ctx.rank, n, seed, empty)
    rows, width = sum(ins), 5
    x = torch.randn(rows + 3, width).to(dtype)  # 3 rows never sent
    index = torch.randperm(rows + 3)[:rows]
    order = torch.randperm(sum(outs)) if recv_perm else None
    w = torch.randn(sum(outs), width).to(dtype)
    res = {}
    for policy in ("off", "chunked"):
        comm = Comm(ctx.group)
        link = tp.Transport(comm, tp.TransportSettings(policy=policy, capacity_bytes=capacity))
        xg = x.clone().requires_grad_(True)
        out = link.all_to_all(tp.Rows(xg, index), ins, outs, "t", place=(tp.Placement(order) if order is not None else None), key=tp.matrix_key(m))
        (out.float() * w.float()).sum().backward()
        peak = comm.staging_peak()
        nograd = link.all_to_all(tp.Rows(x, index), ins, outs, "t", place=(tp.Placement(order) if order is not None else None), key=tp.matrix_key(m))
        res[policy] = {"out": out.detach(), "grad": xg.grad, "nograd": nograd, "report": link.report(),
                       "peak": max(peak, comm.staging_peak()), "stats": comm.stats.as_dict()}
    return res


@pytest.mark.parametrize("n,seed,empty,dtype,capacity,perm", [
    (2, 6, False, torch.float32, 100, False),
    (3, 1, True, torch.bfloat16, 40, True),
    (3, 2, False, torch.float32, 200, True),
    (3, 3, True, torch.bfloat16, 40, False),
])
def test_chunked_rows_bitwise_equal_off_with_grads(clusters, n, seed, empty, dtype, capacity, perm):
    for r in clusters(n).run(rank_rows, seed, empty, dtype, capacity, perm):
        off, ch = r["off"], r["chunked"]
        assert torch.equal(off["out"], ch["out"]) and torch.equal(off["nograd"], ch["nograd"])
        assert torch.equal(off["grad"], ch["grad"])
        assert ch["report"]["policy"] == "chunked" and ch["report"]["chunks"] > 1
        assert ch["peak"] <= capacity  # staging never exceeds the capacity
        assert off["report"]["policy"] == "off"
        # the same bytes; more calls
        assert off["stats"]["t"]["bytes_sent"] == ch["stats"]["t"]["bytes_sent"]
        assert ch["stats"]["t"]["calls"] > off["stats"]["t"]["calls"]


def rank_ulysses(ctx, lens, heads, kv_heads, dtype, policy, capacity):
    from ditsp.attention.ulysses import head_plan, to_heads, to_seq

    torch.manual_seed(7 + ctx.rank)
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy=policy, capacity_bytes=capacity))
    s = lens[ctx.rank]
    q = torch.randn(2, s, heads, 8).to(dtype).requires_grad_(True)
    k = torch.randn(2, s, kv_heads, 8).to(dtype).requires_grad_(True)
    v = torch.randn(2, s, kv_heads, 8).to(dtype).requires_grad_(True)
    plan = head_plan(heads, kv_heads, ctx.world_size)
    hq, hk, hv = to_heads(link, plan, lens, q, k, v)
    mixed = hq * 1.5 + (hk.sum() + hv.sum()) * 0.25
    out = to_seq(link, plan, lens, mixed)
    out.float().pow(2).sum().backward()
    return {"out": out.detach(), "grads": [t.grad for t in (q, k, v)], "report": link.report(),
            "peak": comm.staging_peak(), "calls": comm.stats.as_dict()["ulysses_a2a"]["calls"]}


@pytest.mark.parametrize("n,lens,heads,kv_heads,dtype", [
    (2, [33, 31], 4, 2, torch.float32),
    (3, [20, 0, 17], 5, 5, torch.bfloat16),  # an empty rank, heads not dividing the degree
])
def test_ulysses_chunked_bitwise_equal_off(clusters, n, lens, heads, kv_heads, dtype):
    off = clusters(n).run(rank_ulysses, lens, heads, kv_heads, dtype, "off", 1 << 30)
    capacity = 2048
    ch = clusters(n).run(rank_ulysses, lens, heads, kv_heads, dtype, "chunked", capacity)
    for a, b in zip(off, ch):
        assert torch.equal(a["out"], b["out"])
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
        assert b["peak"] <= capacity and b["calls"] > a["calls"] == 4  # Q, K, V in one each, the output back
        assert b["report"]["policy"] == "chunked"


def rank_ownership(ctx):
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy="chunked", capacity_bytes=64))
    splits = [6, 6]
    a = link.all_to_all(torch.full((12, 2), float(ctx.rank)), splits, splits, key="k")
    keep = a.clone()
    b = link.all_to_all(torch.full((12, 2), 9.0), splits, splits, key="k")
    return torch.equal(a, keep), a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_outputs_own_their_storage(clusters):
    assert clusters(2).run(rank_ownership) == [(True, True)] * 2


def rank_tiny_capacity(ctx, policy):
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy=policy, capacity_bytes=8))  # < 3 rows of 4 floats
    x = torch.ones(4, 4)
    try:
        out = link.all_to_all(x, [2, 2], [2, 2], key="tiny")
    except tp.TransportError as e:
        return "error", str(e)
    return link.report()["policy"], torch.equal(out, x)


def test_capacity_below_one_row_per_peer(clusters):
    res = clusters(2).run(rank_tiny_capacity, "chunked")
    assert all(kind == "error" and "below one row per peer" in msg for kind, msg in res)  # every rank raises
    assert clusters(2).run(rank_tiny_capacity, "auto") == [("off", True)] * 2  # auto keeps the original path


def rank_disagree(ctx):
    """Rank 1 asks for another capacity, then a rank cannot chunk: every rank falls back to off; then recover."""
    comm = Comm(ctx.group)
    link = tp.Transport(comm)
    x = torch.arange(40.0).reshape(20, 2) + 100 * ctx.rank
    seen = []

    def call():
        out = link.all_to_all(x, [10, 10], [10, 10], key="d")
        seen.append((link.report()["policy"], link.report()["reason"].split(":")[0]))
        return out

    link.configure(tp.TransportSettings(policy="chunked", capacity_bytes=64 if ctx.rank else 96))
    ref = call()
    link.configure(tp.TransportSettings(policy="chunked", capacity_bytes=64))  # both agree now
    same = torch.equal(call(), ref)
    link.capable = ctx.rank == 0
    link.configure(link.settings)  # clears the agreed plans
    call()
    link.capable = True
    call()
    link.configure(tp.TransportSettings(policy="off" if ctx.rank else "chunked", capacity_bytes=64))
    call()
    return seen, same


def test_disagreement_falls_back_on_every_rank_then_recovers(clusters):
    for seen, same in clusters(2).run(rank_disagree, timeout_s=30):
        assert same
        assert [p for p, _ in seen] == ["off", "chunked", "off", "chunked", "off"]
        assert seen[0][1].startswith("ranks disagree on transport settings")
        assert "cannot run the chunked transport" in seen[2][1]


def rank_geometry(ctx):
    comm = Comm(ctx.group)
    link = tp.Transport(comm)
    x = torch.zeros(5 if ctx.rank else 4, 2)
    splits = [2, 3] if ctx.rank else [2, 2]
    try:
        link.all_to_all(x, splits, [2, 2], key="g")
    except tp.TransportError as e:
        return str(e)
    return "no error"


def test_geometry_disagreement_raises_on_every_rank(clusters):
    assert all("disagree on split sizes" in m for m in clusters(2).run(rank_geometry, timeout_s=30))


def rank_cached(ctx):
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy="chunked", capacity_bytes=256))
    x = torch.ones(40, 2)
    for _ in range(3):
        link.all_to_all(x, [20, 20], [20, 20], key="c")
    keyed = link.agreements
    for _ in range(2):
        link.all_to_all(x, [20, 20], [20, 20])  # no key: agree every call
    return keyed, link.agreements, comm.stats.as_dict()["transport_agree"]["calls"]


def test_agreement_cached_per_key(clusters):
    assert clusters(2).run(rank_cached) == [(1, 3, 3)] * 2


def test_env_vs_config_precedence():
    env = {tp.ENV_POLICY: "chunked", tp.ENV_LONG: "chunked", tp.ENV_CAPACITY: "4096"}
    s = tp.TransportSettings.resolve(None, env)
    assert (s.policy, s.long_training, s.capacity_bytes) == ("chunked", "chunked", 4096)
    assert dict(s.sources) == {"policy": "env", "long_training": "env", "capacity_bytes": "env", "agree": "default"}
    cfg = ParallelConfig(a2a_policy="off", a2a_capacity_bytes=123)
    s = tp.TransportSettings.resolve(cfg, env)
    assert (s.policy, s.long_training, s.capacity_bytes) == ("off", "chunked", 123)
    assert dict(s.sources)["policy"] == "config" and dict(s.sources)["long_training"] == "env"
    s = tp.TransportSettings.resolve(None, {})
    assert (s.policy, s.long_training, s.capacity_bytes) == ("auto", "auto", tp.DEFAULT_CAPACITY)
    with pytest.raises(ValueError, match="policy from env"):
        tp.TransportSettings.resolve(None, {tp.ENV_POLICY: "fast"})
    with pytest.raises(ValueError, match="DITSP_A2A_CAPACITY_BYTES"):
        tp.TransportSettings.resolve(None, {tp.ENV_CAPACITY: "lots"})
    with pytest.raises(ParallelConfigError, match="a2a_policy"):
        ParallelConfig(a2a_policy="fast")
    with pytest.raises(ParallelConfigError, match="a2a_capacity_bytes"):
        ParallelConfig(a2a_capacity_bytes=0)


def _vectors(policy, long, grad, rows, capacity, threshold=1000, row_bytes=4):
    s = tp.TransportSettings(policy=policy, long_training=long, capacity_bytes=capacity,
                             grad_threshold_bytes=threshold)

    class Src:
        row_shape, dtype, planes = (row_bytes // 4,), torch.float32, 1

    return [tp._vector(s, True, Src, [rows, rows], [rows, rows], grad) for _ in range(2)]


def test_long_training_threshold():
    # 600 rows x 4 B x 2 peers = 4800 B per plane > threshold 1000 B; capacity forces chunks.
    assert tp.decide(_vectors("auto", "auto", False, 600, 4000)).policy == "chunked"  # no grad: tuned
    p = tp.decide(_vectors("auto", "auto", True, 600, 4000))
    assert p.policy == "off" and "grad-tracked" in p.reason  # conservative default
    assert tp.decide(_vectors("auto", "chunked", True, 600, 4000)).policy == "chunked"  # opt-in
    assert tp.decide(_vectors("auto", "auto", True, 100, 4000)).policy == "off"  # fits: one call
    assert tp.decide(_vectors("auto", "auto", True, 200, 1200, threshold=10**6)).policy == "chunked"  # below
    assert tp.decide(_vectors("chunked", "auto", True, 600, 4000)).policy == "chunked"  # explicit policy


def test_chunk_plan_fits_capacity():
    for ins, outs, cap in [([100, 3, 0], [7, 50, 9], 300), ([1, 1], [1, 1], 16), ([0, 0], [0, 0], 4)]:
        k = tp.chunks_needed(ins, outs, 4, cap)
        assert k >= 1 and tp.staging_bytes(ins, outs, 4, k) <= cap
        exact = tp.chunk_rows(ins, k)
        assert [sum(c[p] for c in exact) for p in range(len(ins))] == ins
    assert tp.chunks_needed([5, 5], [5, 5], 4, 8) == -1 and tp.chunks_needed([1, 1], [1, 1], 4, 12) == -1
    # rows received in place need no receive stage: fewer chunks for the same capacity
    k_staged, k_direct = tp.chunks_needed([0, 40], [0, 40], 4, 100), tp.chunks_needed([0, 40], [0, 40], 4, 100, False)
    assert k_direct < k_staged and tp.staging_bytes([0, 40], [0, 40], 4, k_direct, False) <= 100
    assert tp.receives_in_place(None, [3, 0, 4], 0) and not tp.receives_in_place(None, [3, 2, 4], 0)


def rank_one_chunk(ctx):
    comm = Comm(ctx.group)
    link = tp.Transport(comm)
    x = torch.randn(7, 3) + ctx.rank
    ins, outs = ([3, 4], [3, 5]) if ctx.rank == 0 else ([5, 2], [4, 2])
    got = {}
    for policy in ("off", "chunked"):
        link.configure(tp.TransportSettings(policy=policy))
        got[policy] = link.all_to_all(x, ins, outs, key="one")
    return torch.equal(got["off"], got["chunked"]), link.report()["chunks"], comm.staging_peak()


def test_one_chunk_receives_into_the_output(clusters):
    for same, chunks, peak in clusters(2).run(rank_one_chunk):
        assert same and chunks == 1 and peak <= 7 * 3 * 4  # the send stage only


def test_ulysses_wire_blocks_copy_any_element_range():
    """The Ulysses send buffer packed on demand: any element range equals the whole packed buffer's."""
    from ditsp.attention.ulysses import WireBlocks, head_plan

    torch.manual_seed(0)
    plan = head_plan(6, 3, 4)
    xs = [torch.randn(2, 5, 6, 3), torch.randn(2, 5, 3, 3), torch.randn(2, 5, 3, 3)]
    wire = WireBlocks(xs, [plan.q, plan.kv, plan.kv], 4)
    whole = wire.materialize()
    # whole equals the documented layout: peer p's block [s, B, W_p], tensors' p-shares side by side
    o = 0
    for p in range(4):
        parts = [x[:, :, lo:hi].transpose(0, 1).reshape(5, 2, -1) for x, (lo, hi) in zip(xs, (plan.q[p], plan.kv[p],
                                                                                          plan.kv[p]))]
        blk = torch.cat(parts, dim=2).reshape(-1)
        assert torch.equal(whole[o : o + blk.numel()], blk)
        o += blk.numel()
    assert o == wire.rows
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        a, b = sorted(torch.randint(0, wire.rows + 1, (2,), generator=g).tolist())
        dst = torch.full((b - a,), float("nan"))
        wire.copy_rows(a, b, dst)
        assert torch.equal(dst, whole[a:b])


def rank_contiguous_chunks(ctx):
    comm = Comm(ctx.group)
    link = tp.Transport(comm)
    x = torch.randn(40, 3) + ctx.rank
    ins = [15, 25] if ctx.rank == 0 else [10, 30]
    outs = [ins[0], 10] if ctx.rank == 0 else [25, 30]
    got = {}
    for policy in ("off", "chunked"):
        link.configure(tp.TransportSettings(policy=policy, capacity_bytes=64))
        comm.staging_peak(reset=True)
        got[policy] = (link.all_to_all(x, ins, outs, key="contig"), comm.staging_peak(), link.report())
    return got


def test_contiguous_rows_are_never_staged(clusters):
    """Two ranks, a plain tensor: every chunk goes straight from the source into the output."""
    for got in clusters(2).run(rank_contiguous_chunks):
        (off, off_peak, _), (ch, ch_peak, rep) = got["off"], got["chunked"]
        assert torch.equal(off, ch) and rep["chunks"] > 1
        assert off_peak == 0 and ch_peak == 0


def rank_ulysses_long(ctx, tokens, policy, capacity):
    """Ulysses transport in and out (and back in backward) at a long length; digests of the result."""
    import hashlib

    from ditsp.attention.ulysses import head_plan, to_heads, to_seq

    lens = [tokens // 2 + tokens % 2, tokens // 2]
    torch.manual_seed(11 + ctx.rank)
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy=policy, capacity_bytes=capacity))
    q, k, v = (torch.randn(1, lens[ctx.rank], h, 8).to(torch.bfloat16).requires_grad_(True) for h in (4, 2, 2))
    plan = head_plan(4, 2, 2)
    hq, hk, hv = to_heads(link, plan, lens, q, k, v)
    out = to_seq(link, plan, lens, hq * 1.5 + hk.repeat_interleave(2, 1) * hv.repeat_interleave(2, 1))
    out.float().pow(2).sum().backward()

    def digest(t):
        return hashlib.sha256(t.detach().contiguous().view(torch.int16).numpy().tobytes()).hexdigest()

    calls = sum(c["calls"] for kind, c in comm.stats.as_dict().items() if kind.startswith("ulysses_a2a"))
    return [digest(t) for t in (out, q.grad, k.grad, v.grad)], comm.staging_peak(), calls


@pytest.mark.parametrize("tokens", [32768, 131072, 250000])
def test_ulysses_long_sequences_exact_gradients(clusters, tokens):
    """The validation gate: chunked is bit-identical to off, forward and gradients, at 32k-250k tokens."""
    off = clusters(2).run(rank_ulysses_long, tokens, "off", 1 << 30)
    capacity = 256 << 10
    ch = clusters(2).run(rank_ulysses_long, tokens, "chunked", capacity)
    for (d_off, _, calls_off), (d_ch, peak, calls) in zip(off, ch):
        assert d_off == d_ch
        assert peak <= capacity and calls > calls_off == 8  # 4 exchanges each way; chunked: more, smaller


def _case_data(seed: int, rank: int, n: int, width: int, dtype):
    """Rank ``rank``'s source rows and send index of random case ``seed`` (any rank can rebuild them)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    m = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 31, (n, n), generator=m) * (torch.rand(n, n, generator=m) > 0.25)
    rows = int(counts[rank].sum())
    x = torch.randn(rows + 2, width, generator=g).to(dtype)
    index = torch.randperm(rows + 2, generator=g)[:rows]
    return counts, x, index


def rank_random(ctx, seed, width, dtype, policy, capacity, use_index, use_place):
    """One random exchange against the rows every rank can predict from the case's seed."""
    n, me = ctx.world_size, ctx.rank
    counts, x, index = _case_data(seed, me, n, width, dtype)
    ins, outs = [int(v) for v in counts[me]], [int(v) for v in counts[:, me]]
    expected = []
    for s in range(n):  # what rank s packs for me: its rows [offset of peer me, + count) in send order
        _, xs, idx = _case_data(seed, s, n, width, dtype)
        lo = int(counts[s, :me].sum())
        rows = idx[lo : lo + int(counts[s, me])] if use_index else torch.arange(lo, lo + int(counts[s, me]))
        expected.append(xs[rows])
    expected = torch.cat(expected)
    place = None
    if use_place:
        perm = torch.randperm(sum(outs), generator=torch.Generator().manual_seed(seed + 7 * me))
        place = tp.Placement(perm)
        placed = torch.empty_like(expected)
        placed[perm] = expected
        expected = placed
    comm = Comm(ctx.group)
    link = tp.Transport(comm, tp.TransportSettings(policy=policy, capacity_bytes=capacity))
    if use_index:
        send = tp.Rows(x, index)
    else:
        send = x[: sum(ins)]
    try:
        out = link.all_to_all(send, ins, outs, "rnd", place=place, key=("rnd", seed))
    except tp.TransportError as e:
        return "error", str(e)
    return torch.equal(out, expected), comm.staging_peak() <= capacity or policy == "off", link.report()["chunks"]


@pytest.mark.parametrize("seed", range(12))
def test_random_exchanges_deliver_every_row(clusters, seed):
    """Random count matrices (zeros, empty ranks), sources, placements, widths, dtypes and capacities:
    every rank receives exactly the predicted rows, within its capacity."""
    g = torch.Generator().manual_seed(1000 + seed)
    n = 2 + seed % 3
    width = int(torch.randint(1, 6, (1,), generator=g))
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    policy = ("chunked", "off", "auto")[seed % 3 if seed % 4 else 0]
    capacity = int(torch.randint(6, 40, (1,), generator=g)) * width * (4 if dtype == torch.float32 else 2)
    use_index, use_place = bool(seed & 1), bool(seed & 2)
    for res in clusters(n).run(rank_random, seed, width, dtype, policy, capacity, use_index, use_place):
        if res[0] == "error":  # a capacity below one row per peer: refused on every rank alike
            assert "below one row per peer" in res[1]
            continue
        assert res[:2] == (True, True)


def rank_gather_rows(ctx):
    """all_gather_rows with uneven shares (padded), even shares (sent as they are) and a strided input."""
    comm = Comm(ctx.group)
    n, r = ctx.world_size, ctx.rank
    uneven = [2, 0, 3][:n]
    mine = torch.arange(uneven[r] * 4, dtype=torch.float32).view(-1, 4) + 100 * r
    even = (torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * r).t()  # (3, 4), not contiguous
    return comm.all_gather_rows(mine, uneven), comm.all_gather_rows(even, [3] * n), even


def test_all_gather_rows_even_uneven_and_strided(clusters):
    for world in (2, 3):
        results = clusters(world).run(rank_gather_rows)
        for uneven, even, _ in results:
            for p, part in enumerate(uneven):
                assert torch.equal(part, torch.arange(part.shape[0] * 4, dtype=torch.float32).view(-1, 4) + 100 * p)
            for p, part in enumerate(even):
                assert torch.equal(part, results[p][2])
