"""Packed Ulysses and packed USP: per-document attention after the sequence<->head all-to-all.

Ulysses: after :func:`~ditsp.attention.ulysses.to_heads` every rank holds the
whole stream for its heads, in the order of the ranks' shards. With the
default contiguous shards that is the global order, so ``cu_seqlens`` is
unchanged and attention runs per document (varlen: one SDPA call per
document, a causal or text-extended mask where needed); any other dispatch is
permuted to global order and back.

USP: the ring axis shards the stream with a :class:`~.dispatch.Dispatch` (area
or zigzag), each ring shard is split contiguously over its Ulysses group, the
Ulysses all-to-all rebuilds the ring shard for a head share, and the
document-aware ring (:mod:`.ring_packed`) runs over the ring axis with its
cached schedule.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...distributed.comm import Comm
from ...distributed.transport import Transport
from ..common import even_splits
from ..ulysses import head_plan, to_heads, to_seq
from .dispatch import dispatch
from .docs import PackedDocs, agree_docs
from .ring_packed import packed_ring_attention


def doc_attention(q, k, v, docs: PackedDocs, tk=None, tv=None, scale: float | None = None):
    """Single-device per-document attention of a whole stream (THD, global order); differentiable.

    ``q`` [N, H, D], ``k``/``v`` [N, Hkv, D]; ``tk``/``tv`` [sum(text_lens), Hkv, D] or None.
    """
    if q.shape[0] != docs.total:
        raise ValueError(f"stream has {q.shape[0]} rows, cu_seqlens says {docs.total}")
    h, hk = q.shape[1], k.shape[1]
    if h == 0:
        return q.new_zeros(q.shape[:2] + (v.shape[-1],))
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cu, to = docs.cu_seqlens, docs.text_offsets
    outs = []
    for d in range(docs.num_docs):
        a, b = cu[d], cu[d + 1]
        qd, kd, vd = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        t = docs.text_lens[d]
        mask, causal = None, docs.causal[d]
        if t:
            kd = torch.cat([kd, tk[to[d]:to[d + 1]].transpose(0, 1)], 1)
            vd = torch.cat([vd, tv[to[d]:to[d + 1]].transpose(0, 1)], 1)
            if causal:
                n = b - a
                pos = torch.arange(n, device=q.device)
                mask = torch.cat([pos[None, :] <= pos[:, None], torch.ones(n, t, dtype=torch.bool, device=q.device)], 1)
                causal = False
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=causal, scale=sc,
                                           enable_gqa=hk != h)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def packed_ulysses_attention(link: Transport | Comm, q, k, v, docs: PackedDocs, tk=None, tv=None,
                             scale: float | None = None, mode: str = "contiguous"):
    """Per-document attention of sequence-sharded ``q, k, v`` [s, H(kv), D] over a Ulysses group.

    Local rows follow ``dispatch(docs, P, mode)`` (default contiguous equal
    shares). ``tk``/``tv``: all documents' text K/V with all K/V heads,
    replicated. Returns [s, H, Dv]. ``link``: the caller's Transport (a Comm gets a fresh one per call).
    """
    link = Transport.of(link)
    comm = link.comm
    agree_docs(comm, docs, "the packed Ulysses documents")
    disp = dispatch(docs, comm.world_size, mode)
    lens = disp.rank_lens
    if q.shape[0] != lens[comm.rank]:
        raise ValueError(f"rank {comm.rank} holds {q.shape[0]} rows; the dispatch gives it {lens[comm.rank]}")
    plan = head_plan(q.shape[1], k.shape[1], comm.world_size)
    if comm.world_size > 1:
        qh, kh, vh = (t[0].transpose(0, 1) for t in to_heads(link, plan, lens, q[None], k[None], v[None]))
    else:
        qh, kh, vh = q, k, v
    order = np.concatenate([disp.rank_rows(r) for r in range(comm.world_size)])
    identity = bool((order == np.arange(order.size)).all())
    if not identity:  # gathered in shard order -> global order
        inv = torch.from_numpy(np.argsort(order)).to(q.device)
        qh, kh, vh = (t.index_select(0, inv) for t in (qh, kh, vh))
    klo, khi = plan.kv[comm.rank]
    tkh = tk[:, klo:khi] if tk is not None else None
    tvh = tv[:, klo:khi] if tv is not None else None
    o = doc_attention(qh, kh, vh, docs, tkh, tvh, scale)
    if not identity:
        o = o.index_select(0, torch.from_numpy(order).to(q.device))
    if comm.world_size == 1:
        return o
    return to_seq(link, plan, lens, o.transpose(0, 1)[None])[0]


def usp_rows(docs: PackedDocs, ulysses_degree: int, ring_degree: int, mode: str = "area") -> list[list[np.ndarray]]:
    """Global rows of every (ring rank, Ulysses rank): ring shards by dispatch, split contiguously."""
    disp = dispatch(docs, ring_degree, mode)
    out = []
    for j in range(ring_degree):
        rows = disp.rank_rows(j)
        o = [0]
        for s in even_splits(rows.size, ulysses_degree):
            o.append(o[-1] + s)
        out.append([rows[o[u]:o[u + 1]] for u in range(ulysses_degree)])
    return out


def packed_usp_attention(ulysses: Transport | Comm, ring: Comm, q, k, v, docs: PackedDocs, tk=None, tv=None,
                         scale: float | None = None, mode: str = "area", skip: bool = True):
    """Packed USP: Ulysses all-to-all inside each ring shard, document-aware ring across shards.

    Local rows: ``usp_rows(docs, U, R, mode)[ring.rank][ulysses.rank]``. Returns [s, H, Dv].
    ``ulysses``: the Ulysses axis' Transport (a Comm gets a fresh one per call).
    """
    link = Transport.of(ulysses)
    ulysses = link.comm
    agree_docs(ulysses, docs, "the packed USP documents (Ulysses axis)")
    rows = usp_rows(docs, ulysses.world_size, ring.world_size, mode)
    lens = [int(r.size) for r in rows[ring.rank]]
    if q.shape[0] != lens[ulysses.rank]:
        raise ValueError(f"rank holds {q.shape[0]} rows; the USP dispatch gives it {lens[ulysses.rank]}")
    plan = head_plan(q.shape[1], k.shape[1], ulysses.world_size)
    if ulysses.world_size > 1:
        qh, kh, vh = (t[0].transpose(0, 1) for t in to_heads(link, plan, lens, q[None], k[None], v[None]))
    else:
        qh, kh, vh = q, k, v
    klo, khi = plan.kv[ulysses.rank]
    tkh = tk[:, klo:khi] if tk is not None else None
    tvh = tv[:, klo:khi] if tv is not None else None
    o = packed_ring_attention(ring, qh.contiguous(), kh.contiguous(), vh.contiguous(), docs, mode, tkh, tvh,
                              scale, skip)
    if ulysses.world_size == 1:
        return o
    return to_seq(link, plan, lens, o.transpose(0, 1)[None])[0]
