"""Window-aligned SP ("Plan A"): whole windows per rank, all heads on every rank.

"Plan A" means the full activation is re-sharded at every window-layout
change: each rank holds whole windows of the current layout, so attention
needs no communication, and where the next layer's layout differs one
all-to-all moves every row to the rank owning its new window.

The runtime owns the layer schedule and its plans, the entry distribution (each rank
keeps only its own rows from the patch embedding on), the layout changes
between layers, the text reduction and the final gather. With one rank it
runs the same code with local permutations and no collectives, which is how
the single-device model runs.

Each layout change goes through the transport (:mod:`ditsp.distributed.transport`):
the rows bound for other ranks go out in one asynchronous all-to-all per
chunk, the rows that stay are gathered into place while they are in flight,
and the received rows are scattered to their places after the wait. Every
rank issues the same calls (a rank with nothing to move joins with empty
splits). Starting the next layer's stay-windows before the rest arrive would
need the block to run its rows in two groups, which this runtime does not do.
``exposed_s`` accumulates the wall time spent in layout changes (per forward,
reset by :meth:`scatter`).
"""

from __future__ import annotations

from typing import Sequence

import time

import torch

from ..attention.window import WindowPack, window_attention
from ..distributed.agree import agree
from ..distributed.autograd import all_reduce_sum, connect_empty, replicated_gather
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from ..windows.capacity import Shares
from ..windows.exchange import exchange
from ..windows.geometry import NUM_WINDOWS, canonical_method, short_name
from ..windows.plan import Plan
from ..windows.schedule import SchedulePlan, plan_schedule
from ..windows.ownership import RowOwnership
from .handoff import rows_to_tokens, tokens_to_rows
from .protocol import RopeFn, ScheduleRuntime


class WindowRuntime(ScheduleRuntime):
    """Window-aligned SP for one request (grid) on one SP group; implements :class:`SPRuntime`."""

    def __init__(
        self,
        grid: Sequence[int],
        layer_methods: Sequence[str],
        comm: Comm,
        planner: str = "lpt",
        num_windows: Sequence[int] = NUM_WINDOWS,
        dtype: torch.dtype = torch.float32,
        transport=None,
        shares: Shares | None = None,
    ):
        self.comm = comm
        self.transport = Transport(comm, transport)  # the layout exchanges' and handoffs' settings
        self.exposed_s = 0.0
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = dtype
        methods = [canonical_method(m) for m in layer_methods]
        # Every rank must plan the same request, or the collectives below diverge and hang.
        request = {
            "grid": [int(v) for v in grid],
            "schedule": [short_name(m) for m in methods],
            "num_windows": [int(v) for v in num_windows],
            "planner": planner,
            "dtype": str(dtype),
            "world_size": comm.world_size,
        }
        if shares is not None and not shares.even:  # ranks of unequal capacity: their speeds and token caps
            request["shares"] = {"speed": list(shares.speed), "max_tokens": shares.max_tokens}
        agree(comm, "the window-SP request (grid, schedule, windows, planner, dtype, world size)", request)
        self.schedule: SchedulePlan = plan_schedule(grid, methods, comm.world_size, planner, num_windows,
                                                    shares=shares)
        self.current: str | None = None

    @classmethod
    def single(cls, grid, layer_methods, num_windows=NUM_WINDOWS, dtype=torch.float32,
               planner="lpt") -> "WindowRuntime":
        """One rank, no process group: the single-device path."""
        return cls(grid, layer_methods, Comm.single(), planner, num_windows, dtype)

    # -- layout facts --------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.schedule.layer_methods)

    def plan(self, layer: int) -> Plan:
        return self.schedule.layer_plan(layer)

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        plan = self.plan(layer)
        return [plan.layout.window_shape(i) for i in plan.rank_windows[self.rank]]

    def local_token_ids(self, layer: int) -> torch.Tensor:
        """Canonical ids of this rank's rows in ``layer``'s layout, in local order."""
        return torch.from_numpy(self.plan(layer).rank_token_ids(self.rank))

    def num_windows(self, layer: int) -> int:
        return len(self.plan(layer).layout)

    def num_local_rows(self, layer: int) -> int:
        return int(self.plan(layer).rank_tokens[self.rank])

    # -- data movement ---------------------------------------------------------

    def scatter(self, x_canonical: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """This rank's rows of canonical ``(N, C)`` rows for ``layer``'s layout (no communication)."""
        if x_canonical.shape[0] != self.schedule.num_tokens:
            raise ValueError(f"expected {self.schedule.num_tokens} canonical rows, got {x_canonical.shape[0]}")
        self.current = self.schedule.layer_methods[layer]
        self.exposed_s = 0.0
        return x_canonical.index_select(0, self.local_token_ids(layer).to(x_canonical.device))

    def scatter_rows(self, x_rows: torch.Tensor, src: RowOwnership, patch) -> torch.Tensor:
        """This rank's rows of ``src`` (a fine-grid ownership) -> its patched rows of layer 0, one exchange."""
        self.current = self.schedule.layer_methods[0]
        self.exposed_s = 0.0
        return rows_to_tokens(x_rows, src, self._ownership(self.current), patch, self.transport)

    def gather_rows(self, y_local: torch.Tensor, dst: RowOwnership, patch) -> torch.Tensor:
        """This rank's output rows -> its rows of ``dst`` (a fine-grid ownership), one exchange."""
        tokens = self._ownership(self.current)
        return tokens_to_rows(y_local, tokens, dst, patch, self.transport)

    def _ownership(self, method: str) -> RowOwnership:
        """The row ownership of ``method``'s plan, built once per runtime (its transitions are cached by it)."""
        owners = self.__dict__.setdefault("_owners", {})
        if method not in owners:
            owners[method] = RowOwnership.of_plan(self.schedule.plans[method])
        return owners[method]

    def ensure_layout(self, x: torch.Tensor, current: str, required: str) -> torch.Tensor:
        """Re-shard ``x`` from layout ``current`` to ``required`` (identity when equal)."""
        current, required = canonical_method(current), canonical_method(required)
        if current != required:
            t0 = time.perf_counter()
            t = self.schedule.transition_between(current, required)
            x = exchange(x, t, self.transport)
            self.exposed_s += time.perf_counter() - t0
        self.current = required
        return x

    def enter_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Make ``x`` hold ``layer``'s layout, whatever the schedule did before."""
        if self.current is None:
            raise RuntimeError("scatter() the input before entering a layer")
        return self.ensure_layout(x, self.current, self.schedule.layer_methods[layer])

    def attend(self, q, k, v, tq, tk, tv, pack: WindowPack, rope: RopeFn | None = None):
        """Local window attention: every window's rows are on this rank, no communication."""
        out, tsum = window_attention(q, k, v, tq, tk, tv, pack, rope)
        if pack.num_rows == 0:  # no window here: stay in the backward graph (ditsp.distributed.autograd)
            out, tsum = connect_empty(out, tsum, q, k, v, tq, tk, tv)
        return out, tsum

    def reduce_text(self, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
        """Plain mean over all windows of ``layer``: local sum -> SUM all-reduce -> / window count.

        A rank with no window passes zeros of the same shape and dtype.
        """
        if txt_sum.dtype != self.dtype:
            raise TypeError(f"text reduction in {txt_sum.dtype}, but the runtime agreed on {self.dtype}")
        total = all_reduce_sum(self.comm, txt_sum, kind="text_all_reduce")
        return total / self.num_windows(layer)

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows back to canonical order, on every rank."""
        plan = self.schedule.plans[self.current]
        own = torch.from_numpy(plan.rank_token_ids(self.rank))
        return replicated_gather(lambda y: self._gather(y, plan), y_local, own)

    def _gather(self, y_local: torch.Tensor, plan: Plan) -> torch.Tensor:
        rows = [int(v) for v in plan.rank_tokens]
        parts = self.comm.all_gather_rows(y_local, rows, kind="output_gather")
        out = y_local.new_empty((self.schedule.num_tokens,) + tuple(y_local.shape[1:]))
        for r, part in enumerate(parts):
            out[torch.from_numpy(plan.rank_token_ids(r)).to(out.device)] = part
        return out

    def report(self, heads: int | None = None) -> str:
        """Names the execution path, e.g. for a run report."""
        heads_txt = f", {heads} heads on every rank" if heads else ""
        sh = self.schedule.shares
        caps = "" if sh is None else (f", tokens by speed {':'.join(f'{v:g}' for v in sh.speed)}"
                                      + ("" if sh.max_tokens is None else " under each rank's token cap"))
        return f"window-aligned Plan A, planner {self.schedule.planner}, SP={self.world_size}{caps}{heads_txt}"
