"""The SP runtime protocol: the whole interface between a window model and its parallelism.

A model never calls a collective and never looks inside a plan. Per request it
gets one runtime and, in forward order, calls:

1. ``scatter(x_canonical, 0)``: this rank's rows of the canonical token rows
   (canonical order: ``(t*H + h)*W + w``) for layer 0;
2. per layer ``i``: ``enter_layer(x, i)`` (the rows this rank must hold for
   layer ``i``), ``window_pack(i, device)`` (its local windows, grouped by
   shape), ``attend(...)`` (window attention over those windows; the text
   output comes back summed over the local windows), and
   ``reduce_text(tsum, i)`` (the mean over *all* windows of the layer);
3. ``gather(y_local)``: every rank's output rows back in canonical order.

``report()`` names the execution path for run reports. A runtime with one
rank runs the same code without collectives: that is the single-device path.

Instead of canonical rows held whole on every rank, the input can arrive as
this rank's rows of any other ownership of the patched grid (e.g. the height
slab a sharded VAE encoded): ``scatter_rows`` moves them straight to the
runtime's rows for layer 0, and ``gather_rows`` sends the output rows straight
to another ownership (the decoder's slabs) instead of every rank.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from ..attention.window import WindowPack
from ..distributed.comm import Comm
from ..distributed.transport import Transport
from ..fixed_shape import DEFAULT, KernelShapes
from ..windows.ownership import RowOwnership

RopeFn = Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor]


@runtime_checkable
class SPRuntime(Protocol):
    """What a window-attention model calls; see the module docstring for the order."""

    comm: Comm  # the SP group, with counted collectives
    transport: Transport  # the policy and agreed plans of this runtime's all-to-alls (over ``comm``)
    rank: int
    world_size: int
    dtype: torch.dtype  # dtype of the text reduction (agreed by every rank)
    kernel_shapes: KernelShapes  # fixed-shape or plain kernel calls (ditsp.fixed_shape), set by parallelize

    @property
    def grid(self) -> tuple[int, int, int]:
        """Post-patch token grid (T, H, W) this runtime was planned for."""

    @property
    def layer_methods(self) -> tuple[str, ...]:
        """Canonical window method of each layer."""

    def scatter(self, x_canonical: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """This rank's rows of ``(N, C)`` canonical rows, for ``layer``."""

    def scatter_rows(self, x_rows: torch.Tensor, src: RowOwnership, patch: Sequence[int]) -> torch.Tensor:
        """Like :meth:`scatter`, from this rank's ``(n, C)`` rows of ``src`` on the grid the tokens were patched from."""

    def gather_rows(self, y_local: torch.Tensor, dst: RowOwnership, patch: Sequence[int]) -> torch.Tensor:
        """Like :meth:`gather`, but only to ``dst``: this rank gets its ``(n, C / prod(patch))`` rows of ``dst``."""

    def enter_layer(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows as ``layer`` needs them (moved between ranks where the layout changes)."""

    def local_window_shapes(self, layer: int) -> list[tuple[int, int, int]]:
        """Shapes of the windows whose rows this rank's attention covers, in row order."""

    def window_pack(self, layer: int, device: torch.device | str) -> WindowPack:
        """:meth:`local_window_shapes` as a :class:`WindowPack` (cached per layout)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tq: torch.Tensor | None,
               tk: torch.Tensor, tv: torch.Tensor, pack: WindowPack, rope: RopeFn | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Window attention of local rows ``q, k, v`` (n, H, D) with text ``tq, tk, tv`` (L, H, D).

        Returns the video output (n, H, D) and the fp32 text output summed over
        the windows this rank attended (None when ``tq`` is None).
        """

    def reduce_text(self, txt_sum: torch.Tensor, layer: int) -> torch.Tensor:
        """Mean of the per-window text outputs over all windows of ``layer``."""

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows back to canonical order, on every rank."""

    def report(self, heads: int | None = None) -> str:
        """One line naming the path, e.g. for `ditsp run`."""


def check_request(runtime: SPRuntime, grid: Sequence[int], layer_methods: Sequence[str], model: str) -> None:
    """Raise ValueError unless ``runtime`` was planned for this grid and layer schedule."""
    if tuple(runtime.grid) != tuple(grid) or tuple(runtime.layer_methods) != tuple(layer_methods):
        raise ValueError(f"runtime planned grid {tuple(runtime.grid)} with {len(runtime.layer_methods)} layers; "
                         f"{model} needs grid {tuple(grid)} with {len(layer_methods)} layers")


class ScheduleRuntime:
    """What runtimes planned on a :class:`~ditsp.windows.schedule.SchedulePlan` (``self.schedule``) share:
    the request's grid and layer methods, and window packs cached per layout and device."""

    schedule: object
    kernel_shapes: KernelShapes = DEFAULT

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.schedule.grid)

    @property
    def layer_methods(self) -> tuple[str, ...]:
        return tuple(self.schedule.layer_methods)

    def window_pack(self, layer: int, device) -> WindowPack:
        packs = self.__dict__.setdefault("_packs", {})
        key = (self.schedule.layer_methods[layer], str(device))
        if key not in packs:
            packs[key] = WindowPack.build(self.local_window_shapes(layer), device)
        return packs[key]

