"""Packed documents under SP (Ulysses, document-aware Ring, USP) against single-device per-document attention."""

from __future__ import annotations

import pytest
import torch

from ditsp.attention.packed import (PackedDocs, PackedDocsError, dispatch, doc_attention, packed_ring_attention,
                                    packed_ulysses_attention, packed_usp_attention, ring_schedule, shard_rows,
                                    unshard_rows, usp_rows)
from ditsp.config import ParallelConfig
from ditsp.distributed.agree import DisagreementError
from ditsp.distributed.comm import Comm
from ditsp.distributed.groups import build_sp_groups

# many short documents + one long; causal and bidirectional; one shorter than any SP degree
LENGTHS = [3, 40, 1, 9, 130, 5, 2, 17]
CAUSAL = [True, False, False, True, True, False, True, False]
TEXT = [0, 3, 0, 1, 4, 0, 2, 0]
H, HK, D = 4, 2, 8


def make(docs: PackedDocs, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n, t = docs.total, sum(docs.text_lens)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return r(n, H, D), r(n, HK, D), r(n, HK, D), r(t, HK, D), r(t, HK, D), r(n, H, D)


def reference(docs, seed=0, change_doc=None):
    q, k, v, tk, tv, g = make(docs, seed)
    if change_doc is not None:
        a, b = docs.cu_seqlens[change_doc], docs.cu_seqlens[change_doc + 1]
        for t in (q, k, v):
            t[a:b] += 1.0
    text = sum(docs.text_lens) > 0
    xs = [x.double().requires_grad_() for x in ((q, k, v, tk, tv) if text else (q, k, v))]
    out = doc_attention(*xs[:3], docs, *(xs[3:] if text else (None, None)))
    grads = torch.autograd.grad(out, xs, g.double())
    return out.detach(), grads


def _rank(ctx, docs, strategy, mode, skip=True, change_doc=None):
    q, k, v, tk, tv, g = make(docs)
    if change_doc is not None:
        a, b = docs.cu_seqlens[change_doc], docs.cu_seqlens[change_doc + 1]
        for t in (q, k, v):
            t[a:b] += 1.0
    text = sum(docs.text_lens) > 0
    if strategy.startswith("usp"):
        U = int(strategy[3:])
        cfg = ParallelConfig(ulysses_degree=U, ring_degree=ctx.world_size // U)
        groups = build_sp_groups(cfg, ctx.group)
        uc, rc = Comm.of(groups.ulysses), Comm.of(groups.ring)
        rows = torch.from_numpy(usp_rows(docs, U, ctx.world_size // U, mode)[rc.rank][uc.rank])
    else:
        comm = Comm.of(ctx.group)
        rows = torch.from_numpy(dispatch(docs, ctx.world_size, mode).rank_rows(ctx.rank))
    xs = [t.index_select(0, rows).requires_grad_() for t in (q, k, v)]
    txt = [t.clone().requires_grad_() for t in (tk, tv)] if text else [None, None]
    if strategy == "ring":
        out = packed_ring_attention(comm, *xs, docs, mode, *txt, skip=skip)
        stats = comm.stats.as_dict()
    elif strategy == "ulysses":
        out = packed_ulysses_attention(comm, *xs, docs, *txt, mode=mode)
        stats = comm.stats.as_dict()
    else:
        out = packed_usp_attention(uc, rc, *xs, docs, *txt, mode=mode, skip=skip)
        stats = {}
    ins = xs + [t for t in txt if t is not None]
    grads = torch.autograd.grad(out, ins, g.index_select(0, rows))
    return rows, out.detach(), grads, stats


def _assemble(results, docs, text):
    n = docs.total
    out = torch.zeros(n, H, D)
    gq, gk, gv = torch.zeros(n, H, D), torch.zeros(n, HK, D), torch.zeros(n, HK, D)
    gt = [0, 0]
    for rows, o, grads, _ in results:
        out[rows], gq[rows], gk[rows], gv[rows] = o, grads[0], grads[1], grads[2]
        if text:  # sum convention: a replicated input's gradient is the sum over ranks
            gt = [gt[0] + grads[3], gt[1] + grads[4]]
    return out, [gq, gk, gv] + (gt if text else [])


def check(results, docs, tol=2e-5):
    text = sum(docs.text_lens) > 0
    out, grads = _assemble(results, docs, text)
    ref, rgrads = reference(docs)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for a, b in zip(grads, rgrads[: len(grads)]):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)


DOCS = PackedDocs.from_lengths(LENGTHS, CAUSAL, TEXT)
DOCS_NOTEXT = PackedDocs.from_lengths(LENGTHS, CAUSAL)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("mode", ["area", "zigzag"])
def test_ring_exact(clusters, n, mode):
    check(clusters(n).run(_rank, DOCS, "ring", mode), DOCS)


def test_ring_contiguous_no_skip_exact(clusters):
    check(clusters(3).run(_rank, DOCS_NOTEXT, "ring", "contiguous", False), DOCS_NOTEXT)


@pytest.mark.parametrize("n,mode", [(2, "contiguous"), (4, "contiguous"), (3, "area")])
def test_ulysses_exact(clusters, n, mode):
    check(clusters(n).run(_rank, DOCS, "ulysses", mode), DOCS)


@pytest.mark.parametrize("U", [2])
def test_usp_exact(clusters, U):
    check(clusters(4).run(_rank, DOCS, f"usp{U}", "area"), DOCS)


def test_no_cross_contamination(clusters):
    """Changing one document's tokens changes only that document's output and gradients."""
    base = clusters(3).run(_rank, DOCS_NOTEXT, "ring", "area")
    changed = clusters(3).run(_rank, DOCS_NOTEXT, "ring", "area", True, 4)
    out0, g0 = _assemble(base, DOCS_NOTEXT, False)
    out1, g1 = _assemble(changed, DOCS_NOTEXT, False)
    a, b = DOCS_NOTEXT.cu_seqlens[4], DOCS_NOTEXT.cu_seqlens[5]
    keep = torch.ones(DOCS_NOTEXT.total, dtype=torch.bool)
    keep[a:b] = False
    assert not torch.equal(out0[~keep], out1[~keep])
    assert torch.equal(out0[keep], out1[keep])
    for x, y in zip(g0, g1):
        assert torch.equal(x[keep], y[keep])


def test_schedule_skips_pairs_and_bytes():
    """Whole short documents stay home: their K/V never travel; the schedule is cached."""
    docs = PackedDocs.from_lengths([8] * 12 + [512], [False] * 12 + [True])
    s = ring_schedule(docs, 4)
    base = ring_schedule(docs, 4, "contiguous", skip=False)
    assert s is ring_schedule(docs, 4)
    assert s.rows_moved() < base.rows_moved()
    assert s.dispatch.imbalance <= 1.05
    only_short = PackedDocs.from_lengths([8] * 16, True)
    s2 = ring_schedule(only_short, 4)
    assert s2.rows_moved() == 0 and s2.pairs_skipped() == 12
    assert dispatch(only_short, 4).imbalance <= 1.05


def test_docs_shorter_than_degree(clusters):
    docs = PackedDocs.from_lengths([1, 2, 1, 3], [True, False, True, True])
    check(clusters(4).run(_rank, docs, "ring", "zigzag"), docs)


def test_empty_document_rejected():
    with pytest.raises(PackedDocsError, match="document 1 is empty"):
        PackedDocs.make([0, 4, 4, 9])
    with pytest.raises(PackedDocsError, match="start at 0"):
        PackedDocs.make([1, 4])


def _mismatch(ctx):
    docs = PackedDocs.from_lengths([4, 4 + ctx.rank], True)
    comm = Comm.of(ctx.group)
    rows = dispatch(docs, ctx.world_size).rank_rows(ctx.rank)
    x = torch.zeros(rows.size, 2, 4)
    try:
        packed_ring_attention(comm, x, x, x, docs)
    except DisagreementError as e:
        return str(e)
    return None


def test_signature_mismatch_raises_everywhere(clusters):
    msgs = clusters(2).run(_mismatch)
    assert all(m and "cu_seqlens" in m for m in msgs)


def test_single_rank_shard_roundtrip():
    docs = DOCS
    d = dispatch(docs, 3)
    x = torch.arange(docs.total)
    parts = [shard_rows(x, d, r) for r in range(3)]
    assert torch.equal(unshard_rows(parts, d), x)
