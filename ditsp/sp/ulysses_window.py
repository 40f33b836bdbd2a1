"""The Ulysses baseline for window models: contiguous token shards, heads moved by all-to-all.

This is how the SeedVR2 reference parallelises its DiT, kept as a baseline to
compare window-aligned SP against. Tokens are sharded contiguously in
canonical order (uneven shares, no padding). Around each window attention one
all-to-all turns sequence shards into head shards (every rank then holds all
tokens for its heads and attends every window), and one turns them back.
Heads are split into balanced uneven shards, so any head count runs at any
degree (the reference needs heads % SP == 0). Text stays replicated; each
rank's text output covers its heads and is all-gathered over heads.

The transport is :mod:`ditsp.attention.ulysses` (the same codec global
attention uses); the head and row shares are
:func:`ditsp.attention.common.even_splits`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..attention.common import even_splits
from ..attention.ulysses import head_plan, head_to_seq, seq_to_head
from ..attention.window import WindowPack, window_attention
from ..distributed.agree import agree
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from ..windows.geometry import NUM_WINDOWS, canonical_method, short_name
from ..windows.schedule import plan_schedule
from ..windows.ownership import RowOwnership
from .handoff import rows_to_tokens, tokens_to_rows
from .protocol import RopeFn, ScheduleRuntime


class UlyssesWindowRuntime(ScheduleRuntime):
    """Contiguous token shards + head-sharded window attention; implements :class:`SPRuntime`."""

    def __init__(self, grid: Sequence[int], layer_methods: Sequence[str], heads: int, comm: Comm,
                 num_windows: Sequence[int] = NUM_WINDOWS, dtype: torch.dtype = torch.float32, transport=None):
        self.comm, self.rank, self.world_size, self.dtype = comm, comm.rank, comm.world_size, dtype
        self.transport = Transport(comm, transport)  # the head all-to-alls' and handoffs' settings
        methods = [canonical_method(m) for m in layer_methods]
        agree(comm, "the Ulysses window request (grid, schedule, heads, world size)",
              {"grid": list(grid), "schedule": [short_name(m) for m in methods], "heads": heads,
               "world_size": comm.world_size, "dtype": str(dtype)})
        # Every rank attends every window: plan the schedule for one "rank".
        self.schedule = plan_schedule(grid, methods, 1, "lpt", num_windows)
        self.rows = even_splits(self.schedule.num_tokens, self.world_size)
        self.row_start = sum(self.rows[: self.rank])
        self.heads = head_plan(heads, heads, self.world_size)
        self.current: str | None = None
        self._orders: dict = {}  # (method, device) -> canonical rows in window order; "own" -> the shards

    @property
    def head_shares(self) -> list[int]:
        return [hi - lo for lo, hi in self.heads.q]

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        lay = self.schedule.layer_plan(layer).layout
        return [lay.window_shape(i) for i in range(len(lay))]

    def num_windows(self, layer: int) -> int:
        return len(self.schedule.layer_plan(layer).layout)

    def scatter(self, x_canonical: torch.Tensor, layer: int = 0) -> torch.Tensor:
        self.current = self.schedule.layer_methods[layer]
        return x_canonical[self.row_start : self.row_start + self.rows[self.rank]]

    def scatter_rows(self, x_rows: torch.Tensor, src: RowOwnership, patch) -> torch.Tensor:
        """This rank's rows of ``src`` -> its contiguous patched shard, one exchange."""
        self.current = self.schedule.layer_methods[0]
        return rows_to_tokens(x_rows, src, self._ownership(), patch, self.transport)

    def gather_rows(self, y_local: torch.Tensor, dst: RowOwnership, patch) -> torch.Tensor:
        return tokens_to_rows(y_local, self._ownership(), dst, patch, self.transport)

    def _ownership(self) -> RowOwnership:
        if "own" not in self._orders:
            self._orders["own"] = RowOwnership.contiguous(self.grid, self.rows, "contiguous shards")
        return self._orders["own"]

    def enter_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        self.current = self.schedule.layer_methods[layer]
        return x  # rows never move between layers; attention moves heads instead

    def reduce_text(self, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
        return txt_sum / self.num_windows(layer)  # already summed over every window, all heads

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.comm.all_gather_rows(y_local, self.rows, kind="output_gather"))

    def report(self, heads: int | None = None) -> str:
        shares = "/".join(map(str, self.head_shares))
        return f"Ulysses (reference path), contiguous token shards, SP={self.world_size}, heads per rank {shares}"

    def attend(self, q, k, v, tq, tk, tv, pack: WindowPack, rope: RopeFn | None = None):
        """Sequence shards -> head shards, window attention over all windows, and back."""
        h0, h1 = self.heads.q[self.rank]
        ranges = [self.heads.q] * 3
        q_, k_, v_ = (t[0].transpose(0, 1) for t in seq_to_head(
            self.transport, [q[None], k[None], v[None]], ranges, self.rows, kind="ulysses_qkv"))
        order = self._order(self.current, q_.device)
        q_, k_, v_ = (t.index_select(0, order) for t in (q_, k_, v_))
        heads = slice(h0, h1)
        out, tsum = window_attention(q_, k_, v_, None if tq is None else tq[:, heads], tk[:, heads], tv[:, heads],
                                     pack, rope)
        canonical = torch.empty_like(out)
        canonical[order] = out
        out = head_to_seq(self.transport, [canonical.transpose(0, 1)[None]], [self.heads.q], self.rows,
                          [self.heads.heads], kind="ulysses_out")[0][0]
        if tsum is not None:  # (L, h, D) of my heads -> (L, H, D)
            parts = self.comm.all_gather_rows(tsum.transpose(0, 1).contiguous(), self.head_shares, kind="text_heads")
            tsum = torch.cat(parts).transpose(0, 1)
        return out, tsum

    def _order(self, method: str, device) -> torch.Tensor:
        """Canonical rows -> all windows of ``method``'s layout back to back (cached per device: an index
        on the rows' device, copied there once, not in every layer)."""
        key = (method, str(device))
        if key not in self._orders:
            self._orders[key] = torch.from_numpy(self.schedule.plans[method].layout.token_ids.copy()).to(device)
        return self._orders[key]
