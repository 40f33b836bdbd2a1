"""USP: Ulysses (inner, head shards) inside Ring or AllGather-KV (outer) on a 2D mesh.

Every strategy is this one composition: Ulysses is ``U=P, R=1``, Ring is
``U=1, R=P``, AllGather-KV is ``U=1, R=P`` with the outer axis gathering K/V.
SP rank ``i = ring_pos * U + ulysses_pos`` (the mesh of
:func:`ditsp.distributed.groups.build_sp_groups`) holds the i-th video shard, so the
Ulysses group at ring position j gathers one contiguous chunk of the sequence.

Joint text (replicated on every rank, in front of or behind the local video
shard): each rank takes its Ulysses heads of the text and, on the outer axis,
its share of the text *query rows*; the text K/V is attended once per rank as
a local block, never circulated. Text outputs are gathered back (rows over the
ring, heads over Ulysses), so every rank returns the same text output.
Gradients of replicated inputs follow the sum convention (see common.py).

Agreement: before its first collective for a new call signature (batch,
heads, K/V heads, head dims, dtypes, text length, joint side, given lengths,
scale, mesh), every SP rank exchanges its signature once (one small
all-gather of objects) and raises :class:`~ditsp.distributed.agree.DisagreementError`
on every rank when they differ, and ``ValueError`` on every rank when any
rank's inputs are malformed; a mismatch would otherwise crash gloo or hang the
peers. Signatures already agreed are cached, so steady-state calls add no
traffic. The signature also carries the attention backend each rank chose
(:mod:`ditsp.attention.kernels`: a fused kernel returning LSE, or the
pure-torch reference; ``backend=`` or ``DITSP_ATTENTION_BACKEND`` may request
one), so all ranks run the same kernel; ``SPAttention.backend`` names it and
``backend_reason`` says why a call fell back. Per-rank sequence lengths are not part of the signature (they may
legitimately differ); they are checked against ``seq_lens`` locally.
"""

from __future__ import annotations

import json
from typing import Sequence

import torch

from ..config import ParallelConfig
from ..distributed.groups import SPGroups
from ..distributed.agree import DisagreementError
from ..distributed.comm import Comm, CommStats
from ..distributed.transport import Transport
from .allgather import allgather_attention, joined
from .common import default_scale, even_splits, gather_lens, gather_rows, ranges
from .kernels import NAMES, Choice, choose, local_attention, requested_default, wants_contiguous
from .ring import ring_attention
from .ulysses import head_plan, to_heads, to_seq


def _comm(group, stats: CommStats) -> Comm:
    return Comm.of(group, stats)


_AGREED_MAX = 256  # cached signatures per SPAttention (cleared, on every rank alike, when full)


LAYOUTS = ("contiguous", "zigzag")


def _local_problem(q, k, v, text_len: int, joint: str, seq_lens, sp: Comm, causal: bool = False,
                   layout: str = "contiguous") -> str | None:
    """What is wrong with this rank's own inputs (None when nothing), without raising."""
    if causal and layout != "contiguous":
        return (f"causal attention needs contiguous shards in rank order; the {layout} layout is not "
                "supported with causal=True here (the packed path, ditsp.attention.packed with "
                "dispatch mode 'zigzag', handles zigzag causal shards)")
    if causal and text_len:
        return f"causal attention takes no joint text (text_len {text_len}); pass text_len=0"
    if joint not in ("front", "rear"):
        return f"joint must be 'front' or 'rear', got {joint!r}"
    if any(x.dim() != 4 for x in (q, k, v)):
        return f"q, k, v must be [B, L, H, D], got shapes {[list(x.shape) for x in (q, k, v)]}"
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        return (f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: k and v must have one shape, "
                "and q the batch, length and head dim of k")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads need a divisor as K/V head count, got {k.shape[2]}"
    if not 0 <= text_len <= q.shape[1]:
        return f"text_len {text_len} outside 0..{q.shape[1]} (the local token count)"
    if seq_lens is not None:
        if len(seq_lens) != sp.world_size or any(int(n) < 0 for n in seq_lens):
            return f"seq_lens {list(seq_lens)} must hold {sp.world_size} non-negative lengths (one per SP rank)"
        if int(seq_lens[sp.rank]) != q.shape[1] - text_len:
            return (f"rank {sp.rank} holds {q.shape[1] - text_len} video tokens but seq_lens says "
                    f"{int(seq_lens[sp.rank])}")
    return None


def _signature(attn: "SPAttention", q, k, v, text_len, joint, seq_lens, scale, backend: str,
               causal: bool = False) -> dict:
    """What every SP rank must pass alike (local lengths left out: shards may be uneven)."""
    four = all(x.dim() == 4 for x in (q, k, v))
    return {
        "batch": int(q.shape[0]) if four else None,
        "heads": int(q.shape[2]) if four else None,
        "kv_heads": int(k.shape[2]) if four else None,
        "head_dim": int(q.shape[-1]) if four else None,
        "dtype": str(q.dtype),
        "text_len": int(text_len), "joint": joint, "causal": bool(causal),
        "seq_lens": None if seq_lens is None else [int(n) for n in seq_lens],
        "scale": None if scale is None else float(scale),
        "mesh": [attn.u.world_size, attn.r.world_size], "outer": attn.outer, "stacked": attn.stacked,
        "strict": attn.strict, "backend": backend, "layout": attn.layout,
        # Last: the q, k, v shapes without the length dim (catches what the named fields do not).
        "shapes": [[int(n) for i, n in enumerate(x.shape) if i != 1] + [str(x.dtype)] for x in (q, k, v)],
    }


def _differences(sigs: list[dict]) -> str:
    """The fields that differ, by rank ("shapes" only when no named field does)."""
    keys = [key for key in sigs[0] if len({json.dumps(s.get(key), default=str) for s in sigs}) > 1]
    keys = [key for key in keys if key != "shapes"] or keys
    return "; ".join(f"{key}: " + ", ".join(f"rank {r} {s.get(key)}" for r, s in enumerate(sigs)) for key in keys)


class SPAttention:
    """Global attention over a sequence sharded on ``U x R`` ranks; takes and returns ``[B, L, H, D]``."""

    def __init__(self, ulysses_group=None, ring_group=None, sp_group=None, outer: str = "ring",
                 stacked: bool = False, strict: bool = False, name: str = "usp", backend: str | None = None,
                 layout: str = "contiguous", transport=None):
        if outer not in ("ring", "allgather"):
            raise ValueError(f"outer must be 'ring' or 'allgather', got {outer!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout  # how the caller's shards cut the sequence (causal needs contiguous)
        self.stats = CommStats()
        self.u, self.r = _comm(ulysses_group, self.stats), _comm(ring_group, self.stats)
        self.sp = _comm(sp_group, self.stats)
        # The Ulysses all-to-alls' transport: ``transport`` is a TransportSettings, a config with the a2a_*
        # fields, or None (the environment), whichever entry point built this object.
        self.transport = Transport(self.u, transport)
        if self.sp.world_size != self.u.world_size * self.r.world_size:
            raise ValueError(f"SP group of {self.sp.world_size} ranks is not ulysses {self.u.world_size} x ring {self.r.world_size}")
        self.outer, self.stacked, self.strict, self.name = outer, stacked, strict, name
        self.requested = backend or requested_default()
        if self.requested not in NAMES + ("auto",):
            raise ValueError(f"unknown attention backend {self.requested!r}; choose from auto, {', '.join(NAMES)}")
        self.backend: str | None = None  # the last call's backend (see ditsp.attention.kernels)
        self.backend_reason: str | None = None  # why it fell back to "reference" (None: a fused kernel)
        self._agreed: set[str] = set()

    def agree(self, q, k, v, text_len: int = 0, joint: str = "front",
              seq_lens: Sequence[int] | None = None, scale: float | None = None, causal: bool = False) -> Choice:
        """Make the SP ranks agree on this call's signature (once per signature; see the module doc).

        The signature includes the attention backend this rank would choose, so every rank runs the
        same one (returned). Raises :class:`DisagreementError` (signatures differ) or ``ValueError`` (some rank's
        inputs are malformed) on every rank alike.
        """
        choice = choose(q.device.type, q.dtype, int(q.shape[-1]) if q.dim() else 0, self.requested)
        self.backend, self.backend_reason = choice.name, choice.reason
        sig = _signature(self, q, k, v, text_len, joint, seq_lens, scale, choice.name, causal)
        problem = _local_problem(q, k, v, int(text_len), joint, seq_lens, self.sp, causal, self.layout)
        key = json.dumps(sig, sort_keys=True, default=str)
        if key in self._agreed:
            if problem:
                raise ValueError(f"{self.name} attention on rank {self.sp.rank}: {problem}")
            return choice
        everyone = self.sp.all_gather_object((key, sig, problem))
        if len({kk for kk, _, _ in everyone}) > 1:
            sigs = [sg for _, sg, _ in everyone]
            lines = [f"  rank {r}: {kk}" for r, (kk, _, _) in enumerate(everyone)]
            raise DisagreementError(
                f"ranks disagree on the {self.name} attention call: {_differences(sigs)}\n" + "\n".join(lines))
        bad = [(r, p) for r, (_, _, p) in enumerate(everyone) if p]
        if bad:
            first = bad[0]
            raise ValueError(f"{self.name} attention: bad input on rank {first[0]}: {first[1]}\n"
                             + "\n".join(f"  rank {r}: {p}" for r, p in bad))
        if len(self._agreed) >= _AGREED_MAX:
            self._agreed.clear()
        self._agreed.add(key)
        return choice

    @classmethod
    def from_config(cls, config: ParallelConfig, groups: SPGroups, backend: str | None = None,
                    layout: str = "contiguous") -> "SPAttention":
        u, r = config.ulysses_degree, config.ring_degree
        outer = "allgather" if config.use_allgather else "ring"
        name = "ulysses" if r == 1 else (outer if u == 1 else f"usp-{outer}")
        return cls(groups.ulysses, groups.ring, groups.sp, outer, config.ulysses_a2a_stacked,
                   not config.advanced_uaa, name, backend, layout, transport=config)

    def __call__(self, q, k, v, text_len: int = 0, joint: str = "front",
                 seq_lens: Sequence[int] | None = None, scale: float | None = None,
                 causal: bool = False) -> torch.Tensor:
        """``q`` [B, T+s, H, D], ``k``/``v`` [B, T+s, Hkv, D]: replicated text (T rows) joined to the local video shard.

        ``seq_lens``: every SP rank's video length; gathered (one tiny all-gather) when omitted.
        ``causal``: token i attends tokens 0..i of the whole sequence (shards in rank order; no text).
        """
        backend = self.agree(q, k, v, text_len, joint, seq_lens, scale, causal).name
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
            contiguous = wants_contiguous(backend, vq.dtype)  # this kernel reads contiguous shards faster
            hq, hk, hv = to_heads(self.transport, plan, u_lens, vq, vk, vv, self.stacked, contiguous)
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
        qcat = torch.cat([tq[:, :, tlo:thi], hq], 2) if thi > tlo else hq  # no copy without text rows
        if R == 1:  # plain Ulysses: one fused call over [text; video] keys, no LSE needed
            o = local_attention(backend, qcat, joined(tk, hk), joined(tv, hv), scale, causal)
        else:
            attend = ring_attention if self.outer == "ring" else allgather_attention
            o = attend(self.r, qcat, hk, hv, r_lens, scale, tk if T else None, tv if T else None, backend, causal)
        del qcat, hq, hk, hv  # without autograd the head shards go before the way back
        ot, ov = o[:, :, : thi - tlo], o[:, :, thi - tlo :]

        # Back: video to sequence shards, text gathered to every rank.
        if T:
            ot = gather_rows(ot, self.r, t_rows, dim=2, kind="text_rows")
        if U > 1:
            ov = to_seq(self.transport, plan, u_lens, ov, self.stacked)
            if T:
                ot = gather_rows(ot, self.u, [b - a for a, b in plan.q], dim=1, kind="text_heads")
        else:
            ov = ov.transpose(1, 2)
        if not T:
            return ov
        ot = ot.transpose(1, 2)
        return torch.cat([ot, ov] if joint == "front" else [ov, ot], 1)


def Ulysses(group, stacked: bool = False, strict: bool = False, backend: str | None = None,
            layout: str = "contiguous", transport=None) -> SPAttention:
    """``transport``: as for :class:`SPAttention` (``USP(config, ...)`` passes its config)."""
    return SPAttention(group, None, group, "ring", stacked, strict, "ulysses", backend, layout, transport)


def Ring(group, backend: str | None = None, layout: str = "contiguous") -> SPAttention:
    """``layout``: how the caller cut the sequence into shards, ``contiguous`` (rank order) or
    ``zigzag`` (rank r holds chunks r and 2P-1-r of 2P); causal attention refuses ``zigzag`` on every
    rank rather than mask by the wrong positions. Anything else raises."""
    return SPAttention(None, group, group, "ring", name="ring", backend=backend, layout=layout)


def AllGatherKV(group, backend: str | None = None, layout: str = "contiguous") -> SPAttention:
    return SPAttention(None, group, group, "allgather", name="allgather", backend=backend, layout=layout)


def USP(config: ParallelConfig, groups: SPGroups, backend: str | None = None,
        layout: str = "contiguous") -> SPAttention:
    """Ulysses x Ring (or AllGather-KV) of ``config``; ``layout`` as for :func:`Ring`."""
    return SPAttention.from_config(config, groups, backend, layout)
