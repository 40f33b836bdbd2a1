"""USP: Ulysses (inner, head shards) inside Ring or AllGather-KV (outer) on a 2D mesh.

Every strategy is this one composition: Ulysses is ``U=P, R=1``, Ring is
``U=1, R=P``, AllGather-KV is ``U=1, R=P`` with the outer axis gathering K/V.
SP rank ``i = ring_pos * U + ulysses_pos`` (the mesh of
:func:`ditsp.dist.groups.build_sp_groups`) holds the i-th video shard, so the
Ulysses group at ring position j gathers one contiguous chunk of the sequence.

Joint text (replicated on every rank, in front of or behind the local video
shard): each rank takes its Ulysses heads of the text and, on the outer axis,
its share of the text *query rows*; the text K/V is attended once per rank as
a local block, never circulated. Text outputs are gathered back (rows over the
ring, heads over Ulysses), so every rank returns the same text output.
Gradients of replicated inputs follow the sum convention (see common.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import ParallelConfig
from ..dist.groups import SPGroups
from ..dist.comm import Comm, CommStats
from .allgather import allgather_attention
from .common import default_scale, even_splits, gather_lens, gather_rows, ranges
from .ring import ring_attention
from .ulysses import head_plan, to_heads, to_seq


def _comm(group, stats: CommStats) -> Comm:
    return Comm.of(group, stats)


class SPAttention:
    """Global attention over a sequence sharded on ``U x R`` ranks; takes and returns ``[B, L, H, D]``."""

    def __init__(self, ulysses_group=None, ring_group=None, sp_group=None, outer: str = "ring",
                 stacked: bool = True, strict: bool = False, name: str = "usp"):
        if outer not in ("ring", "allgather"):
            raise ValueError(f"outer must be 'ring' or 'allgather', got {outer!r}")
        self.stats = CommStats()
        self.u, self.r = _comm(ulysses_group, self.stats), _comm(ring_group, self.stats)
        self.sp = _comm(sp_group, self.stats)
        if self.sp.world_size != self.u.world_size * self.r.world_size:
            raise ValueError(f"SP group of {self.sp.world_size} ranks is not ulysses {self.u.world_size} x ring {self.r.world_size}")
        self.outer, self.stacked, self.strict, self.name = outer, stacked, strict, name

    @classmethod
    def from_config(cls, config: ParallelConfig, groups: SPGroups) -> "SPAttention":
        u, r = config.ulysses_degree, config.ring_degree
        outer = "allgather" if config.use_allgather else "ring"
        name = "ulysses" if r == 1 else (outer if u == 1 else f"usp-{outer}")
        return cls(groups.ulysses, groups.ring, groups.sp, outer, not config.ulysses_a2a_permute,
                   not config.advanced_uaa, name)

    def __call__(self, q, k, v, text_len: int = 0, joint: str = "front",
                 seq_lens: Sequence[int] | None = None, scale: float | None = None) -> torch.Tensor:
        """``q`` [B, T+s, H, D], ``k``/``v`` [B, T+s, Hkv, D]: replicated text (T rows) joined to the local video shard.

        ``seq_lens``: every SP rank's video length; gathered (one tiny all-gather) when omitted.
        """
        if joint not in ("front", "rear"):
            raise ValueError(f"joint must be 'front' or 'rear', got {joint!r}")
        T, U, R = int(text_len), self.u.world_size, self.r.world_size
        heads, kv_heads = q.shape[2], k.shape[2]
        if self.strict:  # the config's own check and message
            ParallelConfig(ulysses_degree=U, advanced_uaa=False).validate("global", U, heads)
        scale = default_scale(q, scale)
        if joint == "front":
            (tq, vq), (tk, vk), (tv, vv) = [(x[:, :T], x[:, T:]) for x in (q, k, v)]
        else:
            L = q.shape[1] - T
            (tq, vq), (tk, vk), (tv, vv) = [(x[:, L:], x[:, :L]) for x in (q, k, v)]
        lens = list(seq_lens) if seq_lens is not None else gather_lens(self.sp, vq.shape[1])
        j, me = self.r.rank, self.u.rank
        u_lens = lens[j * U : (j + 1) * U]

        # Ulysses: sequence shard -> head shard of this Ulysses group's chunk.
        plan = head_plan(heads, kv_heads, U)
        if U > 1:
            hq, hk, hv = to_heads(self.u, plan, u_lens, vq, vk, vv, self.stacked)
        else:
            hq, hk, hv = (x.transpose(1, 2) for x in (vq, vk, vv))
        (qlo, qhi), (klo, khi) = plan.q[me], plan.kv[me]
        tq, tk, tv = tq[:, :, qlo:qhi].transpose(1, 2), tk[:, :, klo:khi].transpose(1, 2), tv[:, :, klo:khi].transpose(1, 2)
        idx = plan.kv_index(me)
        if idx is not None:  # query heads straddle K/V groups: give each query head its own K/V head
            hk, hv, tk, tv = (x[:, idx] for x in (hk, hv, tk, tv))

        # Outer axis: ring (or all-gather) over chunks; text query rows split over the ring.
        r_lens = [sum(lens[i * U : (i + 1) * U]) for i in range(R)]
        t_rows = even_splits(T, R)
        tlo, thi = ranges(t_rows)[j]
        qcat = torch.cat([tq[:, :, tlo:thi], hq], 2)
        attend = ring_attention if self.outer == "ring" else allgather_attention
        o = attend(self.r, qcat, hk, hv, r_lens, scale, tk if T else None, tv if T else None)
        ot, ov = o[:, :, : thi - tlo], o[:, :, thi - tlo :]

        # Back: video to sequence shards, text gathered to every rank.
        if T:
            ot = gather_rows(ot, self.r, t_rows, dim=2, kind="text_rows")
        if U > 1:
            ov = to_seq(self.u, plan, u_lens, ov, self.stacked)
            if T:
                ot = gather_rows(ot, self.u, [b - a for a, b in plan.q], dim=1, kind="text_heads")
        else:
            ov = ov.transpose(1, 2)
        if not T:
            return ov
        ot = ot.transpose(1, 2)
        return torch.cat([ot, ov] if joint == "front" else [ov, ot], 1)


def Ulysses(group, stacked: bool = True, strict: bool = False) -> SPAttention:
    return SPAttention(group, None, group, "ring", stacked, strict, "ulysses")


def Ring(group) -> SPAttention:
    return SPAttention(None, group, group, "ring", name="ring")


def AllGatherKV(group) -> SPAttention:
    return SPAttention(None, group, group, "allgather", name="allgather")


def USP(config: ParallelConfig, groups: SPGroups) -> SPAttention:
    return SPAttention.from_config(config, groups)
