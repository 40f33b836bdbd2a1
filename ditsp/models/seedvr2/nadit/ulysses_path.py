"""The SeedVR2 reference's own SP path for NaDiT, as a baseline: Ulysses around window attention.

Tokens are sharded contiguously in canonical order (uneven shares, no
padding). Around each window attention one all-to-all turns sequence shards
into head shards (every rank then holds all tokens for its heads and
attends every window), and one turns them back. Heads are split into
balanced uneven shards, so any head count runs at any degree (the
reference needs heads % SP == 0). Text stays replicated; each rank's text
output covers its heads and is all-gathered over heads.

It offers the same interface as :class:`~ditsp.windows.runtime.WindowRuntime`
plus :meth:`attend`, which the NaDiT attention uses instead of local window
attention when a runtime provides it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ....attention.window import WindowPack, window_attention
from ....dist.agree import agree
from ....dist.comm import Comm
from ....windows.geometry import canonical_method, short_name
from ....windows.schedule import plan_schedule
from .config import NaDiTConfig


def even_shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` shares differing by at most one (larger first)."""
    return [total // parts + (p < total % parts) for p in range(parts)]


class UlyssesWindowRuntime:
    """Contiguous token shards + head-sharded window attention (the reference's SP)."""

    def __init__(self, grid: Sequence[int], layer_methods: Sequence[str], heads: int, comm: Comm,
                 num_windows: Sequence[int] = (4, 3, 3), dtype: torch.dtype = torch.float32):
        self.comm, self.rank, self.world_size, self.dtype = comm, comm.rank, comm.world_size, dtype
        methods = [canonical_method(m) for m in layer_methods]
        agree(comm, "the Ulysses NaDiT request (grid, schedule, heads, world size)",
              {"grid": list(grid), "schedule": [short_name(m) for m in methods], "heads": heads,
               "world_size": comm.world_size, "dtype": str(dtype)})
        # Every rank attends every window: plan the schedule for one "rank".
        self.schedule = plan_schedule(grid, methods, 1, "lpt", num_windows)
        self.rows = even_shares(self.schedule.num_tokens, self.world_size)
        self.row_start = sum(self.rows[: self.rank])
        self.head_shares = even_shares(heads, self.world_size)
        self.head_start = sum(self.head_shares[: self.rank])
        self.current = None
        self._orders: dict = {}  # method -> window-order index

    # -- the WindowRuntime interface -------------------------------------------

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        lay = self.schedule.layer_plan(layer).layout
        return [lay.window_shape(i) for i in range(len(lay))]

    def num_windows(self, layer: int) -> int:
        return len(self.schedule.layer_plan(layer).layout)

    def scatter(self, x_canonical: torch.Tensor, layer: int = 0) -> torch.Tensor:
        self.current = self.schedule.layer_methods[layer]
        return x_canonical[self.row_start : self.row_start + self.rows[self.rank]]

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

    # -- attention ---------------------------------------------------------------

    def attend(self, q, k, v, tq, tk, tv, pack: WindowPack, rope=None):
        """Sequence shards -> head shards, window attention over all windows, and back."""
        h0, h = self.head_start, self.head_shares[self.rank]
        qkv = self._seq_to_heads(torch.stack([q, k, v], 1))  # (N, 3, h, D) canonical order
        order = self._order(self.current)
        q_, k_, v_ = qkv.index_select(0, order).unbind(1)
        heads = slice(h0, h0 + h)
        out, tsum = window_attention(q_, k_, v_, None if tq is None else tq[:, heads], tk[:, heads], tv[:, heads],
                                     pack, rope)
        canonical = torch.empty_like(out)
        canonical[order] = out
        out = self._heads_to_seq(canonical)
        if tsum is not None:  # (L, h, D) of my heads -> (L, H, D)
            parts = self.comm.all_gather_rows(tsum.transpose(0, 1).contiguous(), self.head_shares, kind="text_heads")
            tsum = torch.cat(parts).transpose(0, 1)
        return out, tsum

    def _order(self, method: str) -> torch.Tensor:
        """Canonical rows -> all windows of ``method``'s layout back to back (cached)."""
        if method not in self._orders:
            self._orders[method] = torch.from_numpy(self.schedule.plans[method].layout.token_ids.copy())
        return self._orders[method]

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(n_local, 3, H, D) -> (N, 3, h_mine, D): send each peer its heads of my rows."""
        n, three, _, d = x.shape
        send = torch.cat([x[:, :, a : a + s].reshape(-1) for a, s in _starts(self.head_shares)])
        h = self.head_shares[self.rank]
        recv = self.comm.all_to_all_single(
            send, [n * three * s * d for s in self.head_shares], [r * three * h * d for r in self.rows],
            kind="ulysses_qkv",
        )
        return torch.cat([c.view(r, three, h, d) for c, r in zip(recv.split([r * three * h * d for r in self.rows]),
                                                                   self.rows)])

    def _heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """(N, h_mine, D) -> (n_local, H, D): send each peer its rows of my heads."""
        _, h, d = x.shape
        n = self.rows[self.rank]
        recv = self.comm.all_to_all_single(
            x.reshape(-1), [r * h * d for r in self.rows], [n * s * d for s in self.head_shares], kind="ulysses_out"
        )
        return torch.cat([c.view(n, s, d) for c, s in zip(recv.split([n * s * d for s in self.head_shares]),
                                                           self.head_shares)], dim=1)


def _starts(shares: list[int]):
    a = 0
    for s in shares:
        yield a, s
        a += s


def build_ulysses_runtime(cfg: NaDiTConfig, grid: Sequence[int], group=None) -> UlyssesWindowRuntime:
    """The baseline path on SP group ``group`` (None: one rank)."""
    comm = Comm.single() if group is None or dist.get_world_size(group) == 1 else Comm(group)
    return UlyssesWindowRuntime(grid, cfg.window_methods, cfg.heads, comm, cfg.num_windows, torch.float32)
