"""Adaptive block-sparse attention under Ulysses, with head migration and slack filling (forward only).

One call, on every rank of the SP group (``q``/``k``/``v`` ``[B, T+s, H, D]``:
replicated text joined to this rank's video shard, as every strategy in
:mod:`ditsp.attention` takes them):

1. Agreement: the sparsity config, grid and call signature are checked once
   per signature (:func:`ditsp.distributed.agree.agree`); a mismatch raises on every rank.
2. Sequence -> head all-to-all (:func:`ditsp.attention.ulysses.seq_to_head`):
   each rank holds its heads over the whole video; text heads are sliced
   locally. Per head the sequence is ``[text; video]`` in blocks (:mod:`.blocks`).
3. Routing (:mod:`.routing`) of this rank's heads: masks and per-row costs.
4. One all-gather of every head's per-row costs; every rank computes the same
   migration plan (:mod:`.balance`).
5. Migrated rows' q blocks, their head's K/V blocks and mask rows are posted
   over P2P (``Comm.batch_isend_irecv``) *before* local compute, so the
   transfer overlaps it.
6. Slack filling: a rank below the post-migration critical path adds its
   next-best blocks (rows that stay home) up to that path.
7. Local compute of the rows at home (:mod:`.block_sparse`); then the rows
   received are computed and their output returned over P2P.
8. Head -> sequence all-to-all for the video output; text heads all-gathered,
   so every rank returns the same text output.

``reports`` holds one dict per call (per layer when one object serves all
layers): density, imbalance before/after, rows and heads moved, bytes moved,
slack available and filled. Gradients are not supported: a call that would
need them raises.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ...distributed.agree import agree
from ...distributed.comm import Comm, CommStats
from ...distributed.transport import Transport
from ..common import gather_lens
from ..ulysses import head_plan, head_to_seq, seq_to_head
from .balance import MigrationPlan, plan_migrations
from .block_sparse import block_sparse_attention, sparse_rows
from .blocks import block_layout
from .config import SparseConfig
from .routing import augment, route

KIND = "sparse_migrate"


class SparseUlysses:
    """Adaptive sparse attention strategy (``attn=``) for a video of ``grid`` = (T, H, W) post-patch tokens."""

    def __init__(self, group, grid: Sequence[int], config: SparseConfig | None = None, name: str = "sparse-ulysses",
                 transport=None):
        self.stats = CommStats()
        self.comm = Comm.of(group, self.stats)
        self.transport = Transport(self.comm, transport)  # settings, config with a2a_* fields, or None (env)
        self.grid = tuple(int(g) for g in grid)
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"grid must be three positive extents (T, H, W), got {grid!r}")
        self.config = config or SparseConfig()
        self.name = name
        self.reports: list[dict] = []
        self._agreed: set[str] = set()

    # -- checks --------------------------------------------------------------

    def _agree(self, q, k, v, text_len, joint, seq_lens, scale) -> None:
        sig = {
            "config": self.config.as_dict(), "grid": list(self.grid), "world": self.comm.world_size,
            "shapes": [[int(n) for i, n in enumerate(x.shape) if i != 1] for x in (q, k, v)],
            "dtype": str(q.dtype), "text_len": int(text_len), "joint": joint,
            "seq_lens": None if seq_lens is None else [int(n) for n in seq_lens],
            "scale": None if scale is None else float(scale),
        }
        key = repr(sorted(sig.items()))
        if key not in self._agreed:
            agree(self.comm, f"{self.name} attention (sparsity config and call)", sig)
            self._agreed.add(key)

    @staticmethod
    def _check_local(q, k, v, text_len, joint):
        if joint not in ("front", "rear"):
            raise ValueError(f"joint must be 'front' or 'rear', got {joint!r}")
        if any(x.dim() != 4 for x in (q, k, v)) or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
            raise ValueError(f"q, k, v must be [B, L, H, D] with one length; got {[list(x.shape) for x in (q, k, v)]}")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"{q.shape[2]} query heads need a divisor as K/V head count, got {k.shape[2]}")
        if not 0 <= text_len <= q.shape[1]:
            raise ValueError(f"text_len {text_len} outside 0..{q.shape[1]}")

    # -- the call ------------------------------------------------------------

    def __call__(self, q, k, v, text_len: int = 0, joint: str = "front",
                 seq_lens: Sequence[int] | None = None, scale: float | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise RuntimeError(f"{self.name} attention is forward-only (inference): gradients were requested; "
                               "call it under torch.no_grad() / torch.inference_mode()")
        T = int(text_len)
        self._check_local(q, k, v, T, joint)
        self._agree(q, k, v, T, joint, seq_lens, scale)
        comm, cfg = self.comm, self.config
        P, me = comm.world_size, comm.rank
        B, _, H, D = q.shape
        Hk = k.shape[2]
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
        if joint == "front":
            (tq, vq), (tk, vk), (tv, vv) = [(x[:, :T], x[:, T:]) for x in (q, k, v)]
        else:
            L0 = q.shape[1] - T
            (tq, vq), (tk, vk), (tv, vv) = [(x[:, L0:], x[:, :L0]) for x in (q, k, v)]
        lens = [int(n) for n in seq_lens] if seq_lens is not None else self._lens(vq.shape[1])
        if len(lens) != P or lens[me] != vq.shape[1]:
            raise ValueError(f"rank {me} holds {vq.shape[1]} video tokens; seq_lens {lens}")
        if sum(lens) != math.prod(self.grid):
            raise ValueError(f"video of {sum(lens)} tokens does not fill grid {self.grid} ({math.prod(self.grid)})")
        hp = head_plan(H, Hk, P)
        (qlo, qhi), (klo, khi) = hp.q[me], hp.kv[me]
        h = qhi - qlo
        if P > 1:
            hq, hk, hv = seq_to_head(self.transport, [vq, vk, vv], [hp.q, hp.kv, hp.kv], lens)
        else:
            hq, hk, hv = (x.transpose(1, 2) for x in (vq, vk, vv))
        # Per local query head, its K/V head (GQA); then [h, B, tokens, D] with text first.
        kv_of = torch.tensor([(qlo + i) // (H // Hk) - klo for i in range(h)], dtype=torch.long)
        hk, hv = hk.index_select(1, kv_of), hv.index_select(1, kv_of)
        tk_, tv_ = (x.transpose(1, 2)[:, klo:khi].index_select(1, kv_of) for x in (tk, tv))
        tq_ = tq.transpose(1, 2)[:, qlo:qhi]
        layout = block_layout(self.grid, cfg.cube, T)
        xq, xk, xv = (torch.cat([t, x], 2).transpose(0, 1) for t, x in ((tq_, hq), (tk_, hk), (tv_, hv)))
        qb, kb, vb = (layout.to_blocks(x.contiguous()) for x in (xq, xk, xv))  # [h, B, nb, b, D]
        nb, b = layout.nblocks, layout.block
        R = B * nb

        routing = route(qb, kb, layout, cfg, scale)  # masks [h, B, nb, nb]
        rc = routing.row_cost.reshape(h, R)
        all_rc = torch.cat(comm.all_gather_rows(rc.contiguous(), [hi - lo for lo, hi in hp.q], kind="sparse_costs")) \
            if P > 1 else rc
        plan = plan_migrations(all_rc.numpy(), hp.q, cfg)

        before = self.stats.as_dict().get(KIND, {"bytes_sent": 0, "bytes_recv": 0})
        qf, kf, vf = (x.reshape(h * R, b, D) for x in (qb, kb, vb))
        pending, inbox, outbox = self._post_inputs(plan, qf, kf, vf, routing.mask.reshape(h * R, nb), qlo, B, nb, R)

        home = torch.zeros(h, R, dtype=torch.bool)
        for i in range(h):
            home[i, : plan.home_hi[qlo + i]] = True
        budget = plan.slack(me) if cfg.slack and P > 1 else 0.0
        added = augment(routing, layout, budget, rows=home.view(h, B, nb)) if budget > 0 else 0.0

        valid = layout.valid.repeat(h * B, 1)
        base = (torch.arange(h * B) * nb).repeat_interleave(nb)
        out = torch.zeros_like(qf)
        rows = torch.nonzero(home.reshape(-1)).reshape(-1)
        with torch.no_grad():
            out[rows] = sparse_rows(qf.index_select(0, rows), kf, vf, valid, routing.mask.reshape(h * R, nb)[rows],
                                    base[rows], scale, cfg.rows_per_step, cfg.kv_blocks_per_step, cfg.impl)
            for r in pending:
                r.wait()
            replies = [(self._compute_piece(m, buf, layout, nb, scale), m.src) for m, buf in inbox]
        back = comm.batch_isend_irecv(replies, [(buf, m.dst) for m, buf in outbox], kind=KIND) if (replies or outbox) else []
        for r in back:
            r.wait()
        for m, buf in outbox:
            lo = (m.head - qlo) * R
            out[lo + m.lo : lo + m.hi] = buf
        after = self.stats.as_dict().get(KIND, {"bytes_sent": 0, "bytes_recv": 0})

        o = layout.from_blocks(out.view(h, B, nb, b, D)).transpose(0, 1)  # [B, h, tokens, D]
        ot, ov = o[:, :, :T], o[:, :, T:]
        if P > 1:
            ov = head_to_seq(self.transport, [ov.contiguous()], [hp.q], lens, [H])[0]
            if T:
                ot = torch.cat(comm.all_gather_rows(ot.transpose(0, 1).contiguous(), [hi - lo for lo, hi in hp.q],
                                                    kind="text_heads")).transpose(0, 1)
        else:
            ov = ov.transpose(1, 2)
        self._report(plan, layout, B, H, budget, added, before, after)
        if not T:
            return ov
        ot = ot.transpose(1, 2)
        return torch.cat([ot, ov] if joint == "front" else [ov, ot], 1)

    # -- pieces --------------------------------------------------------------

    def _lens(self, n: int) -> list[int]:
        return gather_lens(self.comm, n)

    def _post_inputs(self, plan: MigrationPlan, qf, kf, vf, mask, qlo, B, nb, R):
        """Post the sends of migrated rows and the receives of rows to compute here (before local compute)."""
        me, b, D = self.comm.rank, qf.shape[1], qf.shape[2]
        sends, recvs, inbox, outbox = [], [], [], []
        for m in plan.moves:
            blo, bhi = m.lo // nb, (m.hi - 1) // nb + 1
            n = m.hi - m.lo
            if m.src == me:
                base = (m.head - qlo) * R
                kv = torch.stack([kf[base + blo * nb : base + bhi * nb], vf[base + blo * nb : base + bhi * nb]])
                sends += [(qf[base + m.lo : base + m.hi].contiguous(), m.dst), (kv, m.dst),
                          (mask[base + m.lo : base + m.hi].to(torch.uint8), m.dst)]
                outbox.append((m, qf.new_empty(n, b, D)))
            elif m.dst == me:
                buf = (qf.new_empty(n, b, D), qf.new_empty(2, (bhi - blo) * nb, b, D),
                       torch.empty(n, nb, dtype=torch.uint8))
                recvs += [(t, m.src) for t in buf]
                inbox.append((m, buf))
        reqs = self.comm.batch_isend_irecv(sends, recvs, kind=KIND) if (sends or recvs) else []
        # Keep the send buffers alive until waited on (gloo drops a send whose tensor is freed).
        self._send_keep = sends
        return reqs, inbox, outbox

    def _compute_piece(self, m, buf, layout, nb, scale):
        q, kv, mask = buf
        cfg = self.config
        blo = m.lo // nb
        g = torch.arange(m.lo, m.hi)
        base = (g // nb - blo) * nb
        valid = layout.valid.repeat(kv.shape[1] // nb, 1)
        return sparse_rows(q, kv[0], kv[1], valid, mask.bool(), base, scale, cfg.rows_per_step,
                           cfg.kv_blocks_per_step, cfg.impl)

    def _report(self, plan: MigrationPlan, layout, B, H, budget, added, before, after) -> None:
        total = float(H * B) * float(layout.tokens) ** 2
        self.reports.append({
            "layer": len(self.reports),
            "density": sum(plan.loads_before) / total if total else 0.0,
            "imbalance_before": plan.imbalance_before,
            "imbalance_after": plan.imbalance_after,
            "critical_before": plan.critical_before,
            "critical_after": plan.critical_after,
            "moves": len(plan.moves),
            "heads_moved": len({m.head for m in plan.moves}),
            "rows_moved": sum(m.hi - m.lo for m in plan.moves),
            "bytes_moved": (after["bytes_sent"] - before["bytes_sent"]) + (after["bytes_recv"] - before["bytes_recv"]),
            "slack_available": float(budget),
            "slack_filled": float(added),
            "loads_after": list(plan.loads_after),
            "plan": [(m.src, m.dst, m.head, m.lo, m.hi) for m in plan.moves],
        })
        self._send_keep = []
