"""Packed window SP: several restoration requests (different grids) as one window-aligned SP forward.

The packed rows are every request's canonical rows back to back. One
:class:`~ditsp.windows.packed.PackedLayout` per window method holds all
requests' windows, and one plan per method (``lpt`` or ``locality``) spreads
them over the ranks together, so small requests fill the ranks a single one
would leave idle. Per layer this runtime does what the window-aligned runtime
does, once for all requests:

- one row exchange per layout change (all requests' rows in one all-to-all);
- window attention grouped by (request, window shape): a window attends its
  own request's text only, and RoPE uses that request's text length;
- one text all-reduce for all requests' text sums (each request's text stream
  is a slice of the concatenated text), each slice divided by *its own*
  request's window count, so each request gets the reference's mean over its
  windows only;
- one output all-gather at the end.

It implements the :class:`~ditsp.sp.protocol.SPRuntime` methods; ``attend``
also takes one RoPE function per request (a list) and ``tq/tk/tv`` as the
requests' texts concatenated (``text_lens`` says where each starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..attention.window import segment_attention
from ..distributed.agree import agree
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from ..fixed_shape import DEFAULT
from ..windows.exchange import exchange
from ..windows.geometry import NUM_WINDOWS, canonical_method, short_name
from ..windows.packed import PackedLayout, packed_layout
from ..windows.plan import Plan, transition
from ..windows.planners import plan_layouts


@dataclass(frozen=True, eq=False)
class PackedWindowPack:
    """Local windows (back to back) grouped by (request, shape): (request, shape, row index, count)."""

    shapes: tuple[tuple[int, int, int], ...]
    lengths: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, int, int], torch.Tensor, int], ...]

    @classmethod
    def build(cls, shapes, requests, device="cpu") -> "PackedWindowPack":
        shapes = tuple(tuple(int(v) for v in s) for s in shapes)
        lengths = tuple(s[0] * s[1] * s[2] for s in shapes)
        by: dict = {}
        acc = 0
        for s, r, n in zip(shapes, requests, lengths):
            by.setdefault((int(r), s), []).append(torch.arange(acc, acc + n))
            acc += n
        groups = tuple((r, s, torch.cat(rows).to(device), len(rows)) for (r, s), rows in by.items())
        return cls(shapes, lengths, groups)

    @property
    def num_rows(self) -> int:
        return sum(self.lengths)


class PackedWindowRuntime:
    """Window-aligned SP for several requests at once on one SP group."""

    kernel_shapes = DEFAULT

    def __init__(self, grids: Sequence[Sequence[int]], layer_methods: Sequence[str], comm: Comm,
                 text_lens: Sequence[int], planner: str = "lpt", num_windows: Sequence[int] = NUM_WINDOWS,
                 dtype: torch.dtype = torch.float64, transport=None):
        self.comm = comm
        self.transport = Transport(comm, transport)  # the layout exchanges' settings
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = dtype
        self.grids = tuple(tuple(int(v) for v in g) for g in grids)
        self.text_lens = tuple(int(t) for t in text_lens)
        if len(self.text_lens) != len(self.grids):
            raise ValueError(f"{len(self.text_lens)} text lengths for {len(self.grids)} requests")
        methods = tuple(canonical_method(m) for m in layer_methods)
        agree(comm, "the packed window-SP requests (grids, text lengths, schedule, windows, planner, dtype)", {
            "grids": [list(g) for g in self.grids], "text": list(self.text_lens),
            "schedule": [short_name(m) for m in methods], "num_windows": [int(v) for v in num_windows],
            "planner": planner, "dtype": str(dtype), "world_size": comm.world_size})
        self._methods = methods
        self.planner = planner
        distinct = list(dict.fromkeys(methods))
        self.packed: dict[str, PackedLayout] = {m: packed_layout(self.grids, m, num_windows) for m in distinct}
        plans = plan_layouts(tuple(self.packed[m].layout for m in distinct), comm.world_size, planner)
        self.plans: dict[str, Plan] = dict(zip(distinct, plans))
        lay0 = self.packed[distinct[0]]
        self.row_offsets = lay0.row_offsets
        self.text_offsets = tuple(np.concatenate([[0], np.cumsum(self.text_lens)]).tolist())
        self.current: str | None = None
        self._packs: dict = {}
        self._rids: dict = {}

    @classmethod
    def single(cls, grids, layer_methods, text_lens, num_windows=NUM_WINDOWS, dtype=torch.float64, planner="lpt"):
        return cls(grids, layer_methods, Comm.single(), text_lens, planner, num_windows, dtype)

    # -- layout facts ------------------------------------------------------------

    @property
    def grid(self) -> tuple[int, int, int]:
        """The packed layout's virtual grid (requests side by side); see ``grids`` for the requests."""
        return tuple(next(iter(self.packed.values())).layout.grid)

    @property
    def layer_methods(self) -> tuple[str, ...]:
        return self._methods

    @property
    def num_tokens(self) -> int:
        return self.row_offsets[-1]

    def plan(self, layer: int) -> Plan:
        return self.plans[self._methods[layer]]

    def local_window_ids(self, layer: int) -> tuple[int, ...]:
        return self.plan(layer).rank_windows[self.rank]

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        lay = self.plan(layer).layout
        return [lay.window_shape(i) for i in self.local_window_ids(layer)]

    def window_pack(self, layer: int, device) -> PackedWindowPack:
        key = (self._methods[layer], str(device))
        if key not in self._packs:
            req = self.packed[self._methods[layer]].window_request()
            ids = self.local_window_ids(layer)
            self._packs[key] = PackedWindowPack.build(self.local_window_shapes(layer), [req[i] for i in ids], device)
        return self._packs[key]

    def local_request_ids(self, layer: int | None = None, device="cpu") -> torch.Tensor:
        """Request index of every local row in ``layer``'s layout (default: the current layout)."""
        method = self._methods[layer] if layer is not None else self.current
        key = (method, str(device))
        if key not in self._rids:
            ids = self.plans[method].rank_token_ids(self.rank)
            rid = np.searchsorted(np.array(self.row_offsets[1:]), ids, side="right")
            self._rids[key] = torch.from_numpy(rid).to(device)
        return self._rids[key]

    def num_windows(self, layer: int) -> list[int]:
        """Windows of each request in ``layer``'s layout."""
        pl = self.packed[self._methods[layer]]
        return [pl.request_windows(r) for r in range(pl.num_requests)]

    # -- data movement -------------------------------------------------------------

    def scatter(self, x_packed: torch.Tensor, layer: int = 0) -> torch.Tensor:
        if x_packed.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} packed rows, got {x_packed.shape[0]}")
        self.current = self._methods[layer]
        ids = torch.from_numpy(self.plan(layer).rank_token_ids(self.rank)).to(x_packed.device)
        return x_packed.index_select(0, ids)

    def enter_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.current is None:
            raise RuntimeError("scatter() the input before entering a layer")
        required = self._methods[layer]
        if required != self.current:
            x = exchange(x, transition(self.plans[self.current], self.plans[required]), self.transport)
        self.current = required
        return x

    def attend(self, q, k, v, tq, tk, tv, pack: PackedWindowPack, rope=None):
        """Window attention of local rows; each window with its own request's text.

        ``tq/tk/tv``: the requests' texts concatenated (L_total, H, D); ``rope``:
        one ``rope(x, shape)`` for all requests or a list with one per request.
        Returns the video output and the fp64 per-request text sums (L_total, H, D).
        """
        _, heads, dim = q.shape
        out = q.new_empty(q.shape)
        to = self.text_offsets
        txt = torch.zeros(tk.shape[0], heads, dim, dtype=torch.float64, device=q.device) if tq is not None else None
        for r, shape, idx, n in pack.groups:
            a, b = to[r], to[r + 1]
            L = b - a
            l = idx.numel() // n
            rp = rope[r] if isinstance(rope, (list, tuple)) else rope
            qg, kg, vg = (t.index_select(0, idx).view(n, l, heads, dim) for t in (q, k, v))
            if rp is not None:
                qg, kg = rp(qg, shape), rp(kg, shape)
            kg = torch.cat([kg, tk[a:b].expand(n, L, heads, dim)], 1)
            vg = torch.cat([vg, tv[a:b].expand(n, L, heads, dim)], 1)
            if tq is not None:
                qg = torch.cat([qg, tq[a:b].expand(n, L, heads, dim)], 1)
            o = segment_attention(qg, kg, vg)
            out.index_copy_(0, idx, o[:, :l].reshape(n * l, heads, dim))
            if txt is not None:
                txt[a:b] += o[:, l:].double().sum(0)
        return out, txt

    def reduce_text(self, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
        """One SUM all-reduce for every request's text; each slice / its own request's window count."""
        if txt_sum.dtype != self.dtype:
            raise TypeError(f"text reduction in {txt_sum.dtype}, but the runtime agreed on {self.dtype}")
        total = self.comm.all_reduce(txt_sum.contiguous(), kind="text_all_reduce")
        to, counts = self.text_offsets, self.num_windows(layer)
        return torch.cat([total[to[r]:to[r + 1]] / counts[r] for r in range(len(counts))])

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows back to packed order (requests' canonical rows back to back), one all-gather."""
        plan = self.plans[self.current]
        rows = [int(v) for v in plan.rank_tokens]
        parts = self.comm.all_gather_rows(y_local, rows, kind="output_gather")
        out = y_local.new_empty((self.num_tokens,) + tuple(y_local.shape[1:]))
        for r, part in enumerate(parts):
            out[torch.from_numpy(plan.rank_token_ids(r)).to(out.device)] = part
        return out

    def split(self, packed_rows: torch.Tensor) -> list[torch.Tensor]:
        """Packed rows -> one tensor of canonical rows per request."""
        o = self.row_offsets
        return [packed_rows[o[r]:o[r + 1]] for r in range(len(self.grids))]

    def imbalance(self) -> dict[str, float]:
        return {short_name(m): float(p.imbalance) for m, p in self.plans.items()}

    def report(self, heads: int | None = None) -> str:
        heads_txt = f", {heads} heads on every rank" if heads else ""
        return (f"packed window SP, {len(self.grids)} requests, planner {self.planner}, "
                f"SP={self.world_size}{heads_txt}")
