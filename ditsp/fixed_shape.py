"""Fixed-shape kernel calls: the SP degree never sets the shape of a kernel call.

Under SP a rank computes only its own rows, windows or slab, so a plain kernel
call's shape (rows of a GEMM, windows in an attention batch, rows of a
convolution) would follow the SP degree and the plan. BLAS and convolution
libraries choose their algorithm, blocking and edge handling by shape, and on
some CPUs a row's bits then depend on how many rows share its call (MKL fp32
calls of 1-3 rows on AVX2; almost every row count in bf16 on AVX-512/AMX;
nearly every count not a multiple of 8 under ``MKL_CBWR=COMPATIBLE``). No
row-count rule holds on every machine.

What holds by construction is narrower: a call of one fixed shape whose
operands are laid out alike (contiguous, 64-byte aligned) runs one algorithm,
so a row's (or batch item's) result depends on its own values only, not on its
position in the call or on the other rows. This module makes every such call
on the SP path take a shape that depends on the model alone:

- token-row GEMMs run in tiles of exactly ``row_tile`` rows, the tail tile
  zero-padded (:func:`linear_rows`), float32 CPU tiles on oneDNN like every
  float32 linear (:mod:`ditsp.cpu.gemm`; its 768-row calls are position-free
  under the AVX-512 and AVX2 kernel sets alike); rows every rank holds whole (a
  request's text) already have one shape at every degree and run plain calls;
- window attention runs each window shape's (window, head) pairs in batches of
  a fixed size that depends on the window's length only (:func:`pair_batch`);
- the VAE's convolutions run one output frame of a fixed number of output
  rows per call (:func:`conv_tile_rows`, a function of the layer's width and
  of the whole frame's height), in every execution mode: replicated, chunked,
  time- or height-sharded.

The single device runs the same tiles, so SP equals one device bit for bit.
``ditsp doctor`` probes the premise on a machine's kernels; the cost against
the plain calls is in ``benchmarks/results/determinism.md``.

The policy travels with the request: a runtime built from a
:class:`~ditsp.config.ParallelConfig` carries a :class:`KernelShapes`, and a
model's forward activates it with :func:`use` for its duration (a context
variable, so concurrent requests in threads or tasks do not see each other's).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from .cpu import gemm as cpu_gemm

# Rows per GEMM tile: a multiple of every micro-kernel height we know of (4, 6, 8, 12, 16, 32, 64) so no
# row of a tile falls in an edge micro-tile; chosen by `ditsp bench determinism` (cost vs one plain call).
ROW_TILE = 768
# (window, head) pairs per attention call: enough rows that small windows still batch, a function of the
# window length alone.
PAIR_ROWS = 512
# A convolution call computes one output frame of min(CONV_ROW_CAP, max(1, CONV_PIXELS // width)) output rows.
CONV_PIXELS = 8192
CONV_ROW_CAP = 32
ALIGN = 64


@dataclass(frozen=True)
class KernelShapes:
    """Which kernel calls get fixed shapes. ``deterministic=False`` is the fast path (plain calls)."""

    deterministic: bool = True
    row_tile: int = ROW_TILE
    pair_rows: int = PAIR_ROWS
    conv_pixels: int = CONV_PIXELS

    def describe(self) -> str:
        if not self.deterministic:
            return "fast (plain kernel calls; SP equals one device within tolerance)"
        return f"deterministic (fixed-shape calls: {self.row_tile}-row GEMM tiles; SP equals one device bit for bit)"


DETERMINISTIC = KernelShapes()
FAST = KernelShapes(deterministic=False)

# The default policy, the one home of it (ParallelConfig, the request, the CLI's run/upscale and the
# runtimes read it): plain calls. Fixed-shape calls cost 1.05-1.14x on the DiTs and 1.2-1.5x on the VAE
# end to end (`ditsp bench determinism`), more than the 10% a default may cost; a request asks for them
# with ``deterministic=True``.
DEFAULT_DETERMINISTIC = False
# The server's default is the exception: it promises that a job interrupted by a lost rank and re-run on
# a group of another size writes the same frames, which only fixed-shape calls give.
SERVE_DETERMINISTIC = True


def shapes_for(deterministic: bool) -> KernelShapes:
    return DETERMINISTIC if deterministic else FAST


DEFAULT = shapes_for(DEFAULT_DETERMINISTIC)
_current: ContextVar[KernelShapes] = ContextVar("ditsp_kernel_shapes", default=DEFAULT)


def current() -> KernelShapes:
    """The policy of the forward running in this thread or task."""
    return _current.get()


@contextmanager
def use(shapes: KernelShapes) -> Iterator[KernelShapes]:
    """Run the block with ``shapes`` (a model's forward enters its runtime's policy here)."""
    token = _current.set(shapes)
    try:
        yield shapes
    finally:
        _current.reset(token)


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0 and (t.shape[-1] * t.element_size()) % ALIGN == 0


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                shapes: KernelShapes | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on 2D rows ``x`` (M, K), every GEMM of exactly ``row_tile`` rows.

    Full tiles are read from and written to ``x``/the output in place when both
    are contiguous and 64-byte aligned row by row; otherwise (and for the
    zero-padded tail) through an aligned staging tile, so every call sees the
    same shape and the same layout. With autograd on, the tiles are
    concatenated (each tile's backward is again a fixed-shape GEMM).
    """
    shapes = shapes or current()
    if not shapes.deterministic or x.dim() != 2:
        return plain_linear(x, weight, bias)
    tile = shapes.row_tile
    m, k = x.shape
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        pad = -m % tile
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        return torch.cat([F.linear(t, weight, bias) for t in xp.split(tile)])[:m]
    out = x.new_empty(m, weight.shape[0])
    wt = weight.t()
    onednn = cpu_gemm.applies(x, weight, bias)  # oneDNN writes a new output: every tile through the staging rows
    direct = not onednn and _aligned(x) and _aligned(out)
    stage_in = stage_out = None
    for start in range(0, m, tile):
        rows = min(tile, m - start)
        src, dst = x[start:start + rows], out[start:start + rows]
        if direct and rows == tile:
            _gemm(src, wt, bias, dst)
            continue
        if stage_in is None:
            stage_in, stage_out = x.new_zeros(tile, k), x.new_empty(tile, weight.shape[0])  # 64-byte aligned
        stage_in[:rows] = src
        if rows < tile:
            stage_in[rows:] = 0
        if onednn:
            dst.copy_(cpu_gemm.linear(stage_in, weight, bias)[:rows])
        else:
            _gemm(stage_in, wt, bias, stage_out)
            dst.copy_(stage_out[:rows])
    return out


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One ``F.linear`` call, for rows whose call has one shape at every degree (or under the fast policy).

    Float32 CPU calls go through oneDNN (:mod:`ditsp.cpu.gemm`) under either policy: the call's shape
    is the same at every degree, so any one library gives every degree the same bits.
    """
    return cpu_gemm.linear(x, weight, bias)


def _gemm(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, wt, out=out)
    else:
        torch.addmm(bias, x, wt, out=out)


def conv_tile_rows(out_width: int, frame_rows: int | None = None, shapes: KernelShapes | None = None) -> int | None:
    """Output rows per convolution call (one output frame each); None: one call.

    A function of the layer's output width and of the whole frame's output height ``frame_rows``
    (both the same at every SP degree, one device included): at most ``min(CONV_ROW_CAP,
    conv_pixels // width)`` rows, spread evenly over the frame so the last tile pads at most
    a few rows (an 8-row frame runs one 8-row call, not a 32-row call that is three-quarters zeros).
    """
    shapes = shapes or current()
    if not shapes.deterministic:
        return None
    most = min(CONV_ROW_CAP, max(1, shapes.conv_pixels // max(1, out_width)))
    if not frame_rows or frame_rows <= 0:
        return most
    return -(-frame_rows // -(-frame_rows // most))


def pair_batch(rows_per_pair: int, shapes: KernelShapes | None = None) -> int | None:
    """(window, head) pairs per attention call for pairs of ``rows_per_pair`` query rows; None: one call."""
    shapes = shapes or current()
    if not shapes.deterministic:
        return None
    return max(1, shapes.pair_rows // max(1, rows_per_pair))
