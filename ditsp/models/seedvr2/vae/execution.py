"""The executor: runs the VAE's layers on one piece of the clip, wherever that piece sits.

A *piece* is what this process holds right now: frames ``[t_start, ...)`` of the clip (at the
current stage's frame rate) and, when height-sharded, rows ``rows[rank]`` of every frame. Every
operator of the VAE is either pointwise, per frame, or a small causal/spatial stencil, so one piece
can be computed exactly given

- for each causal conv with ``k_t`` taps: the ``k_t - 1`` frames of its (padded) input stream that
  precede the piece. At the clip start these are copies of frame 0; otherwise they are the tail kept
  from the previous chunk (``carry``, single process) or received from the previous rank
  (``time_chain``, temporal SP: each rank forwards the last ``k_t - 1`` frames of its own padded
  stream to the next one, so a rank with few frames passes on what it got);
- for each conv, the rows above and below its slab (zeros at the image border, else halo rows of
  the neighbouring slab, exchanged per conv through :mod:`ditsp.distributed.halo`);
- for each GroupNorm, the per-(frame, group) statistics of the whole frame: every piece computes
  per-(frame, group, row) moments (:func:`row_moments`), a height slab all-gathers them (one
  collective of ``2 * G * T * rows`` float64 values per call), and the frame statistics are merged
  from the whole frame's rows in row order (:func:`frame_stats`), the same arithmetic in every mode;
- for the mid attention, the keys and values of the whole frame (all-gathered per call).

The activations' memory layout is :mod:`.channels_last`'s choice, made once per piece
(:meth:`Exec.arrange`); the executor's own copies keep it.

The executor tracks where the piece is as the stages change its frame rate and row count
(``t_start`` and ``rows`` are updated by strided convs and upsamplers), so layers need no
knowledge of the mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ....distributed.comm import Comm
from ....distributed.halo import exchange_rows, post_to_next, recv_from_prev
from ....row_blocks import rows_per_block
from ..compiled import fused_norm
from . import channels_last
from .layers import depth_to_space, depth_to_space_source


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def conv_rows(layer, rows: list[tuple[int, int]], H: int):
    """Row bookkeeping of one conv over height slabs ``rows`` (per rank) of an H-row input.

    Returns ``(out_rows, H_out, halos)`` with ``halos[r] = (zeros_top, from_prev, from_next, zeros_bot)``.
    Output row ``j`` belongs to the slab holding input row ``j * stride`` (slab starts are multiples of
    the stride); the last non-empty slab takes the remaining output rows.
    """
    k, s = layer.kernel[1], layer.stride[1]
    top, _ = layer.rows_pad
    H_out = layer.out_rows(H)
    out = [(min(_ceil_div(a, s), H_out), min(_ceil_div(b, s), H_out)) for a, b in rows]
    last = max((r for r, (a, b) in enumerate(rows) if b > a), default=None)
    if last is not None:
        out[last] = (out[last][0], H_out)
        out = [o if r <= last else (H_out, H_out) for r, o in enumerate(out)]
    halos = []
    for (i0, i1), (o0, o1) in zip(rows, out):
        if o1 <= o0:
            halos.append((0, 0, 0, 0))
            continue
        n0, n1 = o0 * s - top, (o1 - 1) * s - top + k
        halos.append((max(0, -n0), max(0, i0 - max(n0, 0)), max(0, min(n1, H) - i1), max(0, n1 - H)))
    return out, H_out, halos


def row_moments(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, group, frame, row) mean and M2 (sum of squared deviations) of x (B, C, T, h, W), in float64.

    The result for one row depends only on that row's values, never on how many rows, frames or
    ranks the piece has, so a height slab and the whole frame produce the same numbers for the
    rows they share:

    - each channel's row is reduced over its W columns (contiguous x: last-dim reductions;
      channels-last x: over dim 1 of (rows, W, C), all channels of a row at once) (float32/64 input:
      two passes, the mean, then the sum of squared deviations from it, within 2e-7 of the exact
      variance and 6-20x faster than ``var_mean``'s float64 Welford, which was 9.6% of the VAE's
      time; 16-bit input: float32 sums of x and x^2); on CPU a block of rows at a time through one
      reused buffer (:func:`_blocked_row_sums`: torch's float32 reductions of a bf16 tensor
      upcast all of it first, ~1 s of a bf16 9x128x128 decode in fresh whole-activation copies);
    - the channels of a group are then merged one by one in channel order (elementwise float64
      ops on (B, G, T, h) tensors; Chan's rule for equal counts).

    Row invariance holds as long as the last-dim reduction is computed per row, which the CPU
    kernels do whenever a piece's (channels x frames x rows) is at least its width or the tensor
    is below the parallel grain (always, in practice); a different thread count may change the
    per-row order, so compare runs with the same thread count.
    """
    b, c, t, h, w = x.shape
    cg = c // groups
    if not x.numel():
        z = torch.zeros((b, groups, t, h), dtype=torch.float64, device=x.device)
        return z, z.clone()
    # Per row, two sums in the work dtype: float32/64 the mean and the sum of squared deviations from it,
    # 16-bit the float32 sums of x and of x^2 (as a 2-norm); then combined below in float64. A channels-last
    # activation is reduced over W as (rows, W, C), every channel of a row at once, without a transposed copy.
    wide = x.dtype in (torch.float32, torch.float64)
    last = channels_last.is_channels_last(x)
    if x.device.type == "cpu" and (last or x.is_contiguous()) and not (torch.is_grad_enabled() and x.requires_grad) \
            and not torch.compiler.is_compiling():
        if last:  # in memory (b, t, h, w, c): rows of (W, C)
            first, second = _blocked_row_sums(x.permute(0, 2, 3, 4, 1).reshape(-1, w, c))
            first, second = (v.view(b, t, h, c).permute(0, 3, 1, 2) for v in (first, second))
        else:
            first, second = (v.view(b, c, t, h) for v in _blocked_row_sums(x.view(-1, w)))
    elif wide:
        first = x.mean(-1)
        second = (x - first.unsqueeze(-1)).square_().sum(-1)
    else:
        first = x.sum(-1, dtype=torch.float32)
        second = torch.linalg.vector_norm(x, 2, dim=-1, dtype=torch.float32)
    if wide:
        mean, m2 = first.double(), second.double()
    else:
        s1 = first.double()
        mean = s1 / w
        m2 = (second.double().square() - s1 * mean).clamp_min(0)
    mean, m2 = mean.reshape(b, groups, cg, t, h), m2.reshape(b, groups, cg, t, h)
    gm = mean[:, :, 0].clone()
    for j in range(1, cg):
        gm += mean[:, :, j]
    gm /= cg
    g2 = m2[:, :, 0].clone()
    for j in range(cg):
        if j:
            g2 += m2[:, :, j]
        g2 += (mean[:, :, j] - gm).square_().mul_(w)
    return gm, g2


def _blocked_row_sums(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_moments`' two sums over dim 1 of ``rows`` (N, W) or (N, W, C) on CPU, a cache-sized block of
    rows at a time (:mod:`ditsp.row_blocks`); results (N,) or (N, C).

    For (N, W) the same ops on the same rows as the whole-tensor expressions (float32/64: the mean, then
    the sum of squared deviations; 16-bit: float32 sums of x and x^2), so the same bits; for the (N, W, C)
    of a channels-last activation the same sums over the strided W (16-bit: the 2-norm as the root of the
    sum of squares), the fast policy's own rounding. Either way the working copy
    (16-bit: the upcast the float32 reductions make of the whole tensor; 32-bit: the deviations) is one
    reused, cache-sized buffer instead of a whole-activation allocation per call.
    """
    n, w = rows.shape[:2]
    rest = tuple(rows.shape[2:])
    wide = rows.dtype in (torch.float32, torch.float64)
    work = rows.dtype if wide else torch.float32
    step = rows_per_block(w * math.prod(rest) * torch.finfo(work).bits // 8)
    first = torch.empty((n,) + rest, dtype=work)
    second = torch.empty((n,) + rest, dtype=work)
    buf = torch.empty((min(step, n), w) + rest, dtype=work)
    for i in range(0, n, step):
        part = rows[i:i + step]
        k = part.shape[0]
        if wide:
            torch.mean(part, 1, out=first[i:i + k])
            torch.sub(part, first[i:i + k].unsqueeze(1), out=buf[:k]).square_()
            torch.sum(buf[:k], 1, out=second[i:i + k])
        elif not rest:
            blk = buf[:k].copy_(part)
            torch.sum(blk, 1, out=first[i:i + k])
            torch.linalg.vector_norm(blk, 2, dim=1, out=second[i:i + k])
        else:  # a 2-norm over a strided dim runs ~16x slower than a sum there: the root of the sum of squares
            blk = buf[:k].copy_(part)
            torch.sum(blk, 1, out=first[i:i + k])
            torch.sum(blk.square_(), 1, out=second[i:i + k]).sqrt_()
    return first, second


def _row_pattern(v: torch.Tensor, width: int) -> torch.Tensor:
    """A norm's (B, G, Cg, T, 1, 1) scale or shift repeated over a row's ``width`` pixels, laid out as a
    channels-last row is (frame, pixel, channel): against a channels-last activation every operand of
    the elementwise loop then runs with stride 1 along a whole row (pixels x channels, vectorised),
    where a per-channel pattern left the loop one pixel's few channels long, at the scale's stride T.
    Each element is the same product and sum either way (the same bits, tested)."""
    b, g, cg, t = v.shape[:4]
    out = torch.empty((b, t, 1, width, g, cg), dtype=v.dtype, device=v.device)
    out.copy_(v.permute(0, 3, 4, 5, 1, 2))
    return out.permute(0, 4, 5, 1, 2, 3)


def frame_stats(row_mean: torch.Tensor, row_m2: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per (batch, group, frame) from the per-row moments of the WHOLE frame.

    ``row_mean``/``row_m2``: (B, G, T, H), every row of the frame in canonical order, each row
    over ``per_row`` values. Every execution mode calls this on the identical tensor, so the
    statistics are bitwise the same in every mode.
    """
    H = row_mean.shape[-1]
    mean = row_mean.sum(-1) / H
    m2 = row_m2.sum(-1) + (row_mean - mean.unsqueeze(-1)).square_().sum(-1) * per_row
    return mean, m2 / (H * per_row)


_LANES = 64  # a multiple of twice the widest SIMD vector of any CPU kernel (AVX-512 bf16: 2 x 32)


def padded_buffer(shape, dtype, device, memory_format=torch.contiguous_format) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat buffer, view of ``shape``, laid out in ``memory_format``) where the buffer's length makes
    every SiLU element SIMD.

    PyTorch's CPU elementwise kernels run SIMD code over whole vectors and scalar code over the
    tail of each thread's range, and the two SiLUs round differently (float32). A slab's tensor
    and the whole frame's have different lengths, so the same pixel could take either path.
    Padding the buffer so each thread's share (``ceil(n / threads)``, the split PyTorch's
    ``parallel_for`` makes) is a multiple of ``_LANES`` puts every element on the SIMD path.
    """
    n = math.prod(shape)
    threads = max(1, torch.get_num_threads())
    grain = 32768  # at::internal::GRAIN_SIZE
    m = -(-max(n, 1) // _LANES) * _LANES
    for _ in range(64):
        nt = min(threads, -(-m // grain)) if m >= grain else 1
        if m % (_LANES * nt) == 0:
            break
        m = -(-m // (_LANES * nt)) * (_LANES * nt)
    buf = torch.empty(m, dtype=dtype, device=device)
    if m > n:
        buf[n:].zero_()
    if memory_format == torch.channels_last_3d:
        b, c, t, h, w = shape
        return buf, buf[:n].view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
    return buf, buf[:n].view(tuple(shape))


class Exec:
    """Execution context of one piece (see module doc).

    comm: the SP group (needed for ``time_chain`` and height slabs).
    time_chain: past frames of each causal conv come from rank - 1 (temporal SP).
    carry: dict conv -> last ``k_t - 1`` frames of its padded input, kept between chunks.
    image_fast_path: a one-frame piece at the clip start sums each conv's taps into a 2-D kernel
    (an image). Only valid for bitwise parity when the whole clip is that frame: a rank of a time
    split that holds just frame 0 must run the taps over the frame-0 copies as one device does.
    """

    joins_past_with_halo = True  # a slab's causal conv builds past frames and halo rows in one buffer (_halo)
    normalises_rows_in_place = True  # a slab's norm writes its rows and halos straight to its output (_normalise_rows)
    upsamples_in_place = True  # depth-to-space written behind the next conv's past frames (upsample)
    scales_channels_inner = True  # a norm's per-channel scale and shift laid out channel-innermost (_scale_shift)

    def __init__(self, comm: Comm | None = None, *, time_chain: bool = False, carry: dict | None = None,
                 image_fast_path: bool = True):
        self.comm = comm or Comm.single()
        self.time_chain = time_chain
        self.image_fast_path = image_fast_path
        self.carry = carry
        self.t_start = 0
        self.rows: list[tuple[int, int]] | None = None
        self.H: int | None = None
        self.counts = {"conv": 0, "conv_2d_fast": 0}
        self._haloed = None  # the conv whose input rows the last norm already extended by its halos
        self._fronted = None  # (conv, its padded input, the norm's output inside it): see _front
        self._slab_ext = None  # (conv, its halo-extended input, the upsampled slab inside it): see upsample
        self.memory_format = torch.contiguous_format  # the activations' layout, set by arrange()

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a piece's network input) in the layout the layers run in (:mod:`.channels_last`)."""
        self.memory_format = torch.channels_last_3d if channels_last.wanted(x) else torch.contiguous_format
        return x.contiguous(memory_format=self.memory_format)

    def _cat(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """``torch.cat`` into this piece's layout (a plain cat may fall back to contiguous when the parts'
        layouts differ, e.g. a broadcast frame 0 or received halo rows)."""
        if self.memory_format == torch.contiguous_format:
            return torch.cat(parts, dim)
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):  # out= does not record autograd
            return torch.cat(parts, dim).contiguous(memory_format=self.memory_format)
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        out = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device, memory_format=self.memory_format)
        return torch.cat(parts, dim, out=out)

    def begin(self, t_start: int, rows: list[tuple[int, int]] | None = None, H: int | None = None) -> "Exec":
        """Start a piece at global frame ``t_start`` (of the network input), optionally a height slab."""
        self.t_start, self.rows, self.H = t_start, (list(rows) if rows is not None else None), H
        return self

    @property
    def sharded_rows(self) -> bool:
        return self.rows is not None

    # -- causal conv ---------------------------------------------------------

    def _past(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """The k_t - 1 frames of the layer's input stream before this piece (None at the clip start)."""
        kt = layer.kernel[0]
        if self.t_start == 0:
            return None
        if self.time_chain:
            b, c, _, h, w = x.shape
            return recv_from_prev(self.comm, (b, c, kt - 1, h, w), x.dtype, x.device)
        if self.carry is None or layer not in self.carry:
            raise RuntimeError("a piece after the clip start needs the carried state of the previous chunk")
        return self.carry[layer]

    def conv(self, layer, x: torch.Tensor) -> torch.Tensor:
        self.counts["conv"] += 1
        kt, st = layer.kernel[0], layer.stride[0]
        a, T = self.t_start, x.shape[2]
        weight = None
        pending = None
        joined_past = None  # past frames still to join (a slab's conv joins them with its halo rows)
        fronted, self._fronted = self._fronted, None
        slab_ext, self._slab_ext = self._slab_ext, None
        if kt > 1:
            past = self._past(layer, x)
            # The last kt - 1 frames of this piece's padded stream, for the next chunk / rank.
            if past is None:
                past_full = x[:, :, :1].expand(-1, -1, kt - 1, -1, -1)
            else:
                past_full = past
            if T >= kt - 1:
                tail = x[:, :, T - (kt - 1):]
            else:
                tail = self._cat([past_full[:, :, T:], x], 2)
            if self.time_chain and self.comm.rank < self.comm.world_size - 1:
                pending = post_to_next(self.comm, tail)
            if self.carry is not None:
                self.carry[layer] = tail.clone(memory_format=self.memory_format)  # one copy, owned
            n_out = _ceil_div(a + T, st) - _ceil_div(a, st)
            if past is None and T == 1 and self.image_fast_path:
                # Clip start with one frame (an image): every tap sees frame 0, so the taps are
                # summed into one 2-D kernel instead of materialising the frame copies.
                weight = layer.weight.sum(2, keepdim=True)
                self.counts["conv_2d_fast"] += 1
            elif n_out > 0:
                need = a + kt - 1 - _ceil_div(a, st) * st
                if fronted is not None and fronted[0] is layer and fronted[2] is x and \
                        fronted[1].shape[2] - T == need:
                    x = fronted[1]  # the norm wrote x behind room for these frames: no cat
                    x[:, :, :need] = past_full[:, :, kt - 1 - need:]
                elif need and self.rows is not None and self._haloed is not layer and self.joins_past_with_halo \
                        and not torch.is_grad_enabled():
                    joined_past = past_full[:, :, kt - 1 - need:]  # joined with the halo rows: one copy
                else:
                    x = self._cat([past_full[:, :, kt - 1 - need:], x], 2)
        else:
            n_out = T
        if self.rows is not None:
            if self._haloed is layer:  # the norm before this conv gathered its halo rows already
                rows_out, H_out, _ = conv_rows(layer, self.rows, self.H)
            else:
                ext = slab_ext[1] if slab_ext is not None and slab_ext[0] is layer and slab_ext[2] is x else None
                x, rows_out, H_out = self._halo(layer, x, joined_past, ext)
        self._haloed = None
        if n_out <= 0 or x.shape[3] == 0:
            b = x.shape[0]
            rows_local = (rows_out[self.comm.rank][1] - rows_out[self.comm.rank][0]) if self.rows is not None \
                else layer.out_rows(x.shape[3])
            y = x.new_zeros((b, layer.cout, max(n_out, 0), rows_local, layer.out_cols(x.shape[4])))
        else:
            y = layer.apply(x, weight=weight, rows_padded=self.rows is not None,
                            frame_rows=H_out if self.rows is not None else None)
        if pending is not None:
            pending.wait()
        if st > 1:
            self.t_start = _ceil_div(a, st)
        if self.rows is not None:
            self.rows, self.H = rows_out, H_out
        return y

    def _halo(self, layer, x: torch.Tensor, past: torch.Tensor | None = None, ext: torch.Tensor | None = None):
        """``x`` extended by the conv's halo rows (and zero rows at the image border): (x, rows, H) after it.

        ``past``: causal frames to put in front of ``x`` as well. Frames and rows then go into one
        buffer, ``x`` copied once (joined one after the other they were two copies of the activation);
        the rows sent are those of the joined stream either way, so the bits are the same. ``ext``: that
        buffer, already holding ``x`` (an upsampler wrote it there, :meth:`upsample`).
        """
        rows_out, H_out, halos = conv_rows(layer, self.rows, self.H)
        r, n = self.comm.rank, self.comm.world_size
        zt, fp, fn, zb = halos[r]
        to_prev = halos[r - 1][2] if r > 0 else 0
        to_next = halos[r + 1][1] if r + 1 < n else 0
        slot = max(max(h[1], h[2]) for h in halos)  # the same on every rank: one common row layout
        if past is not None:
            return self._halo_joined(x, past, rows_out, H_out, (zt, fp, fn, zb), to_prev, to_next, slot, ext)
        top, bottom = exchange_rows(self.comm, x, 3, from_prev=fp, from_next=fn, to_prev=to_prev, to_next=to_next,
                                    kind="halo_rows", slot=slot)
        parts = []
        if zt:
            parts.append(x.new_zeros(x.shape[:3] + (zt,) + x.shape[4:]))
        if top is not None:
            parts.append(top)
        parts.append(x)
        if bottom is not None:
            parts.append(bottom)
        if zb:
            parts.append(x.new_zeros(x.shape[:3] + (zb,) + x.shape[4:]))
        if len(parts) > 1 and rows_out[r][1] > rows_out[r][0]:
            x = self._cat(parts, 3)
        elif rows_out[r][1] <= rows_out[r][0]:
            x = x[:, :, :, :0]
        return x, rows_out, H_out

    def _halo_joined(self, x: torch.Tensor, past: torch.Tensor, rows_out, H_out, halo, to_prev: int, to_next: int,
                     slot: int, ext: torch.Tensor | None = None):
        """:meth:`_halo` of ``past`` frames followed by ``x``, built in one buffer (``ext``: given, with ``x``
        in place)."""
        zt, fp, fn, zb = halo
        r = self.comm.rank
        b, c, t, h, w = x.shape
        p = past.shape[2]
        if to_prev > h or to_next > h:
            raise ValueError(f"rank {r} holds {h} rows but must send {to_prev} up and {to_next} down")

        def rows(a: int, k: int) -> torch.Tensor:  # rows a..a+k of the joined stream (past frames, then x)
            return torch.cat([past.narrow(3, a, k), x.narrow(3, a, k)], 2)

        strip = torch.cat([rows(0, to_prev), rows(h - to_next, to_next)], 3)  # only the rows that travel
        top, bottom = exchange_rows(self.comm, strip, 3, from_prev=fp, from_next=fn, to_prev=to_prev,
                                    to_next=to_next, kind="halo_rows", slot=slot)
        if rows_out[r][1] <= rows_out[r][0]:
            return x.new_empty((b, c, p + t, 0, w)), rows_out, H_out
        shape = (b, c, p + t, zt + fp + h + fn + zb, w)
        given = ext is not None and tuple(ext.shape) == shape
        if not given:
            ext = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=self.memory_format)
        ext[:, :, :, :zt].zero_()
        if top is not None:
            ext[:, :, :, zt:zt + fp] = top
        ext[:, :, :p, zt + fp:zt + fp + h] = past
        if not given:
            ext[:, :, p:, zt + fp:zt + fp + h] = x
        if bottom is not None:
            ext[:, :, :, zt + fp + h:zt + fp + h + fn] = bottom
        ext[:, :, :, zt + fp + h + fn:].zero_()
        return ext, rows_out, H_out

    # -- GroupNorm per frame ---------------------------------------------------

    def _fuses(self, then) -> bool:
        """Whether a norm followed by conv ``then`` gathers the conv's halo rows with its statistics
        (the same answer on every rank: it depends on the layer and the common row layout only)."""
        return (then is not None and self.rows is not None and self.comm.world_size > 1 and then.kernel[1] > 1
                and then.stride[1] == 1)

    def norm(self, layer, x: torch.Tensor, silu: bool = False, then=None) -> torch.Tensor:
        """GroupNorm with per-frame statistics (per-row moments, gathered over slabs, merged in row
        order), optionally followed by SiLU (applied tail-free, :func:`padded_buffer`).

        ``then``: the conv that consumes the result. On a height slab its halo rows then travel in
        the statistics' all-gather as raw (un-normalised) rows, and this piece normalises them
        with its own rows: one collective instead of two, and the same elementwise arithmetic on
        every pixel (the conv then skips its exchange).
        """
        b, c, t, h, w = x.shape
        g = layer.num_groups
        cg = c // g
        x = x.contiguous(memory_format=self.memory_format)
        if t == 0:
            return x.clone()
        rm, r2 = row_moments(x, g)
        if self._fuses(then):
            return self._norm_haloed(layer, x, rm, r2, silu, then)
        if self.rows is not None and self.comm.world_size > 1:
            counts = [max(0, b_ - a) for a, b_ in self.rows]
            both = torch.stack([rm, r2]).movedim(-1, 0).contiguous()  # (h, 2, B, G, T)
            parts = self.comm.all_gather_rows(both, counts, kind="groupnorm_stats")
            both = torch.cat(parts, 0).movedim(0, -1)
            rm, r2 = both[0], both[1]
        if not h:
            return x.clone()
        return self._normalise(layer, x, rm, r2, silu, then)

    def _front(self, conv, x: torch.Tensor) -> int:
        """Frames to leave free in front of a norm's output that causal ``conv`` reads next (0: none).

        A causal conv reads its input behind the ``k_t - 1`` frames before the piece; joining them is
        a copy of the whole activation. Written behind that room instead, the conv fills in just those
        frames (:meth:`conv`). For the channels-last layout (frames outermost per clip), inference only,
        on whole frames or on a height slab whose norm brings the conv's halo rows (:meth:`_fuses`; any
        other slab's conv builds its past frames and halo rows in one buffer, :meth:`_halo`).
        """
        if self.rows is not None and not self._fuses(conv):
            return 0
        return self._front_frames(conv, x.shape[2])

    def _front_frames(self, conv, frames: int) -> int:
        """:meth:`_front` for a whole-frame input of ``frames`` frames."""
        if conv is None or conv.kernel[0] <= 1 or conv.stride[0] != 1 or not frames:
            return 0
        if self.memory_format != torch.channels_last_3d or torch.is_grad_enabled():
            return 0
        if self.t_start == 0 and frames == 1 and self.image_fast_path:
            return 0  # the conv sums its taps instead (an image): no past frames
        return conv.kernel[0] - 1

    def _scale_shift(self, layer, shape, rm: torch.Tensor, r2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm's float32 scale and shift per (group, channel, frame): y = x * scale + shift; (B, G, Cg, T, 1, 1),
        or repeated along a row, (B, G, Cg, T, 1, W), for the channels-last loop (:func:`_row_pattern`)."""
        b, c, t, h, w = shape
        g = layer.num_groups
        cg = c // g
        mean, var = frame_stats(rm.contiguous(), r2.contiguous(), cg * w)
        mean, var = mean.float(), var.float()
        rstd = torch.rsqrt(var + layer.eps).view(b, g, 1, t, 1, 1)
        mean = mean.view(b, g, 1, t, 1, 1)
        gamma = layer.weight.float().view(1, g, cg, 1, 1, 1)
        beta = layer.bias.float().view(1, g, cg, 1, 1, 1)
        scale = rstd * gamma
        shift = beta - mean * scale
        if self.scales_channels_inner and self.memory_format == torch.channels_last_3d and fused_norm(layer) is None:
            scale, shift = (_row_pattern(v, w) for v in (scale, shift))
        return scale, shift

    def _normalise(self, layer, x: torch.Tensor, rm: torch.Tensor, r2: torch.Tensor, silu: bool,
                   then=None) -> torch.Tensor:
        """``x`` normalised with the frame statistics merged from the whole frame's row moments
        (written behind room for conv ``then``'s past frames where :meth:`_front` says so)."""
        b, c, t, h, w = x.shape
        g = layer.num_groups
        cg = c // g
        scale, shift = self._scale_shift(layer, x.shape, rm, r2)
        if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad):
            # training: out= and in-place SiLU would cut the graph, so plain ops (no causal front: _front_frames)
            y = torch.addcmul(shift.to(x.dtype), x.view(b, g, cg, t, h, w), scale.to(x.dtype)).view(x.shape)
            return (F.silu(y) if silu else y).contiguous(memory_format=self.memory_format)
        fused = fused_norm(layer)
        if fused is not None:  # --compile: normalise and SiLU in one pass (ditsp.models.seedvr2.compiled)
            with torch.no_grad():
                y = fused(x.view(b, g, cg, t, h, w), scale.expand(b, g, cg, t, 1, 1).to(x.dtype),
                          shift.expand(b, g, cg, t, 1, 1).to(x.dtype), silu)
            # the compiled kernel picks its own output strides: back to the piece's layout
            return y.reshape(x.shape).contiguous(memory_format=self.memory_format)
        with torch.no_grad():  # inference only; out= refuses tensors that track gradients
            buf, y = self._norm_output(then, x, x.shape)
            torch.addcmul(shift.to(x.dtype), x.view(b, g, cg, t, h, w), scale.to(x.dtype),
                          out=y.view(b, g, cg, t, h, w))
            if silu:
                F.silu(buf, inplace=True)
        return y

    def _norm_haloed(self, layer, x: torch.Tensor, rm: torch.Tensor, r2: torch.Tensor, silu: bool, then):
        """:meth:`norm` of a slab whose result feeds conv ``then``: statistics and ``then``'s raw halo
        rows in one all-gather (bytes: each rank's per-row float64 moments, padded to the largest
        slab, then two slots of border rows); returns the normalised slab extended by its halos."""
        b, c, t, h, w = x.shape
        comm, r, n = self.comm, self.comm.rank, self.comm.world_size
        rows_out, _, halos = conv_rows(then, self.rows, self.H)
        zt, fp, fn, zb = halos[r]
        to_prev = halos[r - 1][2] if r > 0 else 0
        to_next = halos[r + 1][1] if r + 1 < n else 0
        slot = max(max(hh[1], hh[2]) for hh in halos)
        counts = [max(0, b_ - a) for a, b_ in self.rows]
        both = torch.stack([rm, r2]).movedim(-1, 0).contiguous()  # (h, 2, B, G, T) float64
        per_row = math.prod(both.shape[1:]) * 8
        stats_len = max(counts) * per_row
        xm = x.movedim(3, 0)  # (h, B, C, T, W) view
        row_bytes = math.prod(xm.shape[1:]) * x.element_size()
        payload = torch.zeros(stats_len + 2 * slot * row_bytes, dtype=torch.uint8, device=x.device)
        payload[:h * per_row] = both.view(-1).view(torch.uint8)
        border = payload[stats_len:].view(x.dtype).view((2 * slot,) + tuple(xm.shape[1:]))
        if to_prev:
            border[:to_prev] = xm[:to_prev]
        if to_next:
            border[slot:slot + to_next] = xm[h - to_next:]
        parts = comm.all_gather_rows(payload, [payload.numel()] * n, kind="groupnorm_stats+halo")
        both = torch.cat([p[:k * per_row] for p, k in zip(parts, counts)]).view(torch.float64)
        both = both.view((sum(counts), 2) + tuple(rm.shape[:-1])).movedim(0, -1)
        rm, r2 = both[0], both[1]
        self._haloed = then
        received = [None, None]
        if fp:
            received[0] = parts[r - 1][stats_len:].view(x.dtype).view(border.shape)[slot:slot + fp].movedim(0, 3)
        if fn:
            received[1] = parts[r + 1][stats_len:].view(x.dtype).view(border.shape)[:fn].movedim(0, 3)
        if self.normalises_rows_in_place and self.memory_format == torch.channels_last_3d \
                and not torch.is_grad_enabled() and fused_norm(layer) is None:
            y = self._normalise_rows(layer, x, received, (zt, fp, fn, zb), rm, r2, silu, then)
            return y[:, :, :, :0] if rows_out[r][1] <= rows_out[r][0] else y
        ext = torch.empty((b, c, t, zt + fp + h + fn + zb, w), dtype=x.dtype, device=x.device,
                          memory_format=self.memory_format)
        em = ext.movedim(3, 0)
        em[:zt].zero_()
        if fp:
            ext[:, :, :, zt:zt + fp] = received[0]
        em[zt + fp:zt + fp + h] = xm
        if fn:
            ext[:, :, :, zt + fp + h:zt + fp + h + fn] = received[1]
        if zb:
            em[-zb:].zero_()
        y = self._normalise(layer, ext, rm, r2, silu, then)
        ym = y.movedim(3, 0)
        if zt:
            ym[:zt].zero_()  # the conv's zero padding at the image border, after the norm
        if zb:
            ym[-zb:].zero_()
        if rows_out[r][1] <= rows_out[r][0]:
            return y[:, :, :, :0]
        return y

    def _norm_output(self, then, x: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer the SiLU runs over, output view of ``shape``) for a norm of ``x`` feeding conv ``then``:
        behind room for the conv's past frames where :meth:`_front` says so (the SiLU over the output
        alone), else :func:`padded_buffer` (every SiLU element SIMD)."""
        front = self._front(then, x)
        if not front:
            return padded_buffer(shape, x.dtype, x.device, self.memory_format)
        b, c, t, rows, w = shape
        full = torch.empty((b, c, t + front, rows, w), dtype=x.dtype, device=x.device, memory_format=self.memory_format)
        y = full[:, :, front:]
        self._fronted = (then, full, y)
        return y, y

    def _normalise_rows(self, layer, x: torch.Tensor, received, halo, rm: torch.Tensor, r2: torch.Tensor, silu: bool,
                        then) -> torch.Tensor:
        """:meth:`_norm_haloed`'s result written piece by piece: the slab's own rows and the halo rows
        received are each normalised straight into their rows of the output (written behind room for
        ``then``'s past frames where :meth:`_front` says so), instead of first being joined into a copy
        of the extended slab. Channels-last only: there the elementwise loop runs over the channels of
        one pixel, so a pixel's arithmetic does not depend on which piece it is in (the same bits)."""
        zt, fp, fn, zb = halo
        b, c, t, h, w = x.shape
        g = layer.num_groups
        rows = zt + fp + h + fn + zb
        scale, shift = self._scale_shift(layer, (b, c, t, rows, w), rm, r2)
        scale, shift = scale.to(x.dtype), shift.to(x.dtype)
        shape = (b, c, t, rows, w)
        with torch.no_grad():
            buf, y = self._norm_output(then, x, shape)
            for a, src in ((zt, received[0]), (zt + fp, x), (zt + fp + h, received[1])):
                if src is not None and src.shape[3]:
                    k = src.shape[3]
                    torch.addcmul(shift, src.unflatten(1, (g, c // g)), scale,
                                  out=y[:, :, :, a:a + k].unflatten(1, (g, c // g)))
            if zt:
                y[:, :, :, :zt].zero_()  # the conv's zero padding at the image border
            if zb:
                y[:, :, :, rows - zb:].zero_()
            if silu:
                F.silu(buf, inplace=True)
        return y

    # -- mid attention -----------------------------------------------------------

    def frame_tokens(self, tok: torch.Tensor, width: int) -> torch.Tensor:
        """This piece's tokens (B, T, rows*width, C) -> those of the whole frame (one all-gather per call)."""
        if self.rows is None or self.comm.world_size == 1:
            return tok
        counts = [max(0, b - a) * width for a, b in self.rows]
        parts = self.comm.all_gather_rows(tok.movedim(2, 0).contiguous(), counts, kind="attention_tokens")
        return torch.cat(parts, 0).movedim(0, 2).contiguous()

    def own_tokens(self, out: torch.Tensor, width: int) -> torch.Tensor:
        """Whole-frame tokens (B, H*width, C) -> this piece's rows."""
        if self.rows is None or self.comm.world_size == 1:
            return out
        a, b = self.rows[self.comm.rank]
        return out[:, a * width:max(a, b) * width]

    def upsample(self, x: torch.Tensor, z: int, temporal: bool, conv) -> torch.Tensor:
        """Depth-to-space of ``x`` (B, 4*z*C, T, H, W) for causal ``conv``, then :meth:`upsampled`.

        On whole frames in the channels-last layout (inference) the rearranged frames are written in one
        copy, frame 0's duplicate left out at the clip start, behind room for ``conv``'s past frames
        (:meth:`_front`): before, the rearrangement, the dropped duplicate and the conv's causal join
        were up to three copies of the upsampled activation. Same values: data movement only.
        """
        if not self.upsamples_in_place or not channels_last.is_channels_last(x) or torch.is_grad_enabled() \
                or self.memory_format != torch.channels_last_3d or not x.numel() \
                or (self.rows is not None and not self.joins_past_with_halo):
            return self.upsampled(depth_to_space(x, z), temporal)
        b, ch, t, h, w = x.shape
        c = ch // (4 * z)
        drop = temporal and self.t_start == 0  # frame 0's duplicate
        frames = t * z - drop
        self.upsampled(x[:, :, :0], temporal)  # the piece's new start (and rows); no frames moved
        front = self._front_frames(conv, frames)
        top = bottom = 0  # rows left free above and below (a slab's halo)
        if self.rows is not None:
            if front and conv.kernel[1] > 1:  # the conv's halo rows and past frames go around it (_halo_joined)
                zt, fp, fn, zb = conv_rows(conv, self.rows, self.H)[2][self.comm.rank]
                top, bottom = zt + fp, fn + zb
            else:
                front = 0
        full = torch.empty((b, c, front + frames, top + 2 * h + bottom, 2 * w), dtype=x.dtype, device=x.device,
                           memory_format=self.memory_format)
        y = full[:, :, front:, top:top + 2 * h]
        if self.rows is not None and front:
            self._slab_ext = (conv, full, y)
        elif front:
            self._fronted = (conv, full, y)
        src = depth_to_space_source(x, z)  # (B, T, z, H, 2, W, 2, C)
        dst = y.permute(0, 2, 3, 4, 1)  # (B, frames, 2H, 2W, C), frames outermost
        if drop:
            dst[:, 0].view(b, h, 2, w, 2, c).copy_(src[:, 0, 0])
            if t > 1:
                dst[:, 1:].view(b, t - 1, z, h, 2, w, 2, c).copy_(src[:, 1:])
        else:
            dst.view(b, t, z, h, 2, w, 2, c).copy_(src)
        return y

    def upsampled(self, x: torch.Tensor, temporal: bool) -> torch.Tensor:
        """After depth-to-space: drop the duplicate of the clip's frame 0; move to the new stage."""
        if temporal:
            if self.t_start == 0 and x.shape[2] > 0:
                x = self._cat([x[:, :, :1], x[:, :, 2:]], 2)
            self.t_start = 0 if self.t_start == 0 else 2 * self.t_start - 1
        if self.rows is not None:
            self.rows = [(2 * a, 2 * b) for a, b in self.rows]
            self.H *= 2
        return x
