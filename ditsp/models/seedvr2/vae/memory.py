"""Per-rank memory model of the VAE's execution modes, and the ``auto`` mode choice (one rule, see :mod:`.modes`).

The model walks the network for the largest piece one rank holds (its frames and rows under the
mode) and, op by op, adds up the tensors the implementation keeps alive at that moment: a resnet's
input (kept for the residual), the normalised input, the conv's time/halo-padded copy and its
output; the upsampler's 1x1 output, its depth-to-space copy and the frame-drop copy; the mid
attention's tokens, q/k/v and the whole-frame k/v gathered under height sharding. The peak over ops
is the activation peak. Added to it: the weights, the carried time tails of every causal conv
(chunked modes: ``k_t - 1`` frames of each conv's input at piece resolution), the clip tensors
(input, per-piece outputs and their concatenation, the gathered output), all in the compute dtype.
On CPU under the fast policy, the filters every Winograd conv caches (:mod:`.winograd`: 4x a float32
filter's bytes, kept with the conv from its first big call on) are counted too, like weights: the
encoder's and the decoder's, since a restoration holds both; so is the channels-last copy of the
weight every other conv keeps there (:meth:`.winograd.WeightCache.channels_last`).
The benchmark (:mod:`ditsp.bench.vae`) checks it against measured peaks of reduced-width VAEs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from . import channels_last, winograd
from .config import VaeConfig
from .layouts import TimeLayout, even_split
from .modes import AUTO_ORDER, BY_NAME, FALLBACK
from .model import VideoVAE
from ...meta import meta_device

GiB = 1024 ** 3
BACKENDS = ("cuda", "cpu", "cpu-deterministic")  # what runs the convs, and how (estimate)


@dataclass
class Piece:
    """What one rank holds at the network input: frames, rows, columns; halo rows per conv side."""

    frames: int
    rows: int
    cols: int
    halo: bool  # rows come from neighbours (height sharding) instead of only zero padding
    pieces: int  # chunks walked in sequence


@dataclass
class MemoryEstimate:
    mode: str
    weights: int
    activation_peak: int
    largest_activation: int
    halo: int
    carried_state: int
    io: int
    piece: Piece
    peak_op: str = ""
    filters: int = 0  # the Winograd convs' cached filters (CPU, fast policy)

    @property
    def total(self) -> int:
        return self.weights + self.activation_peak + self.carried_state + self.io + self.filters

    def row(self) -> str:
        g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
        return (f"{self.mode:14s} total {g(self.total):>6s} GiB = weights {g(self.weights)} + activations "
                f"{g(self.activation_peak)} (largest tensor {g(self.largest_activation)}, halos {g(self.halo)}) + "
                f"carried {g(self.carried_state)} + clip {g(self.io)}"
                + (f" + cached conv filters {g(self.filters)}" if self.filters else "") + f"; piece {self.piece.frames} frames x "
                f"{self.piece.rows} rows, peak at {self.peak_op}")


class _Walk:
    def __init__(self, bytes_per: int, gn_upcast: bool, halo: bool, carry: bool, fixed_shape_cpu: bool = False,
                 winograd_dtype: torch.dtype | None = None):
        self.b, self.gn_upcast, self.halo, self.carry = bytes_per, gn_upcast, halo, carry
        self.fixed_shape_cpu, self.winograd_dtype = fixed_shape_cpu, winograd_dtype
        self.peak, self.peak_op, self.largest, self.halo_bytes, self.state = 0, "", 0, 0, 0
        self.filters = 0

    def size(self, c, t, h, w) -> int:
        return c * t * h * w * self.b

    def note(self, live: int, op: str, *tensors: int) -> None:
        if live > self.peak:
            self.peak, self.peak_op = live, op
        self.largest = max(self.largest, 0, *tensors)

    def conv(self, held, cin, cout, shape, kt, st, ss, op, pad_bot_only=False):
        t, h, w = shape
        tin = self.size(cin, t, h, w)
        halo_rows = 0
        if self.halo and ss == 1:
            halo_rows = 2
        elif self.halo:
            halo_rows = 1
        padded = self.size(cin, t + kt - 1, h + halo_rows, w) if (kt > 1 and t > 1) or halo_rows else 0
        self.halo_bytes = max(self.halo_bytes, self.size(cin, t + kt - 1, halo_rows, w))
        if self.carry and kt > 1:
            self.state += self.size(cin, kt - 1, h, w)
        t2 = t if st == 1 else (t - 1) // 2 + 1
        out = self.size(cout, t2, h // ss, w // ss)
        if self.winograd_dtype is not None and kt == 3 and st == 1 and ss == 1 \
                and winograd.fits(cin, cout, (t, h, w), self.winograd_dtype):
            self.filters += winograd.filter_bytes(cin, cout)  # each conv is walked once
        elif self.winograd_dtype is not None:  # a direct conv on channels-last input keeps a copy of its weight
            self.filters += cin * cout * kt * 9 * self.b  # (3x3 spatial taps; ResnetBlock shortcuts overcounted)
        # Under the deterministic policy on CPU (layers.conv3d's fixed-shape calls) the input is padded by
        # its rows into a copy first, and oneDNN writes each call's output in its blocked channel layout and
        # reorders it back: one extra output-sized buffer (both measured at the peak of a decode).
        pad_copy = self.size(cin, t + kt - 1 if kt > 1 else t, h + 2, w) if self.fixed_shape_cpu else 0
        ws = out if self.fixed_shape_cpu else 0
        self.note(held + tin + padded + pad_copy + out + ws, op, tin, padded, out)
        return (t2, h // ss, w // ss)

    def norm(self, held, c, shape, op):
        x = self.size(c, *shape)
        up = 2 * x if self.gn_upcast else 0
        self.note(held + x + x + up, op, x)

    def resnet(self, cin, cout, shape, op, extra_held=0):
        x = self.size(cin, *shape)
        self.norm(extra_held + 0, cin, shape, op + ".norm1")
        self.conv(extra_held + x, cin, cout, shape, 3, 1, 1, op + ".conv1")
        self.norm(extra_held + x, cout, shape, op + ".norm2")
        self.conv(extra_held + x, cout, cout, shape, 3, 1, 1, op + ".conv2")
        if cin != cout:
            self.note(extra_held + x + 2 * self.size(cout, *shape), op + ".shortcut")
        return shape

    def attention(self, c, shape, op, full_rows):
        t, h, w = shape
        x = self.size(c, t, h, w)
        kv_full = 2 * self.size(c, t, full_rows, w) if self.halo else 0
        self.norm(0, c, shape, op + ".norm")
        self.note(x + 2 * x + 3 * x + kv_full, op + ".qkv", x, kv_full)
        self.note(x + 3 * x + kv_full + x, op + ".out")

    def upsample(self, c, shape, temporal, op):
        t, h, w = shape
        r = 8 if temporal else 4
        x = self.size(c, t, h, w)
        up = r * x
        t2 = 2 * t - 1 if temporal else t
        if temporal and t == 1 and not self.carry:
            pass
        self.note(x + 2 * up, op + ".depth_to_space", up)
        new = (t2 if temporal else t, 2 * h, 2 * w)
        xs = self.size(c, *new)
        if temporal:
            self.note(x + up + xs, op + ".frame_drop")
        self.conv(x, c, c, new, 3, 1, 1, op + ".conv")
        return new


def _walk_encoder(cfg: VaeConfig, wk: _Walk, shape, full_rows: int):
    w = cfg.widths
    shape = wk.conv(wk.size(cfg.in_channels, *shape), cfg.in_channels, w[0], shape, 3, 1, 1, "encoder.conv_in")
    cin = w[0]
    for i, c in enumerate(w):
        for j in range(cfg.layers_per_block):
            wk.resnet(cin if j == 0 else c, c, shape, f"encoder.down_blocks.{i}.resnets.{j}")
        cin = c
        if i < len(w) - 1:
            temporal = i in cfg.temporal_down_blocks
            shape = wk.conv(0, c, c, shape, 3 if temporal else 1, 2 if temporal else 1, 2,
                            f"encoder.down_blocks.{i}.downsamplers.0")
    mid = w[-1]
    wk.resnet(mid, mid, shape, "encoder.mid_block.resnets.0")
    wk.attention(mid, shape, "encoder.mid_block.attentions.0", full_rows)
    wk.resnet(mid, mid, shape, "encoder.mid_block.resnets.1")
    wk.norm(0, mid, shape, "encoder.conv_norm_out")
    wk.conv(0, mid, 2 * cfg.latent_channels, shape, 3, 1, 1, "encoder.conv_out")


def _walk_decoder(cfg: VaeConfig, wk: _Walk, shape, full_rows: int):
    w = tuple(reversed(cfg.widths))
    shape = wk.conv(0, cfg.latent_channels, w[0], shape, 3, 1, 1, "decoder.conv_in")
    wk.resnet(w[0], w[0], shape, "decoder.mid_block.resnets.0")
    wk.attention(w[0], shape, "decoder.mid_block.attentions.0", full_rows)
    wk.resnet(w[0], w[0], shape, "decoder.mid_block.resnets.1")
    cin = w[0]
    for i, c in enumerate(w):
        for j in range(cfg.layers_per_block + 1):
            wk.resnet(cin if j == 0 else c, c, shape, f"decoder.up_blocks.{i}.resnets.{j}")
        cin = c
        if i < len(w) - 1:
            shape = wk.upsample(c, shape, i in cfg.temporal_up_blocks, f"decoder.up_blocks.{i}.upsamplers.0")
    wk.norm(0, w[-1], shape, "decoder.conv_norm_out")
    wk.conv(0, w[-1], cfg.out_channels, shape, 3, 1, 1, "decoder.conv_out")


@functools.lru_cache(maxsize=16)  # estimates ask often
def num_params(cfg: VaeConfig) -> int:
    with meta_device():
        m = VideoVAE(cfg)
    return sum(p.numel() for p in m.parameters())


def piece_of(cfg: VaeConfig, op: str, shape, world: int, mode: str, chunk: int = 1, tile: int = 32,
             overlap: int = 8, rows: int | None = None) -> Piece:
    """The largest piece one rank holds (input frames/rows/cols of the network: pixels or latents);
    ``rows``: the rank's latent rows under the height modes (default: the largest even slab)."""
    T, H, W = shape
    t, h, w = cfg.latent_shape(T, H, W)
    s, f = cfg.spatial_factor, cfg.temporal_factor
    enc = op == "encode"
    frames_all, rows_all, cols = (T, H, W) if enc else (t, h, w)
    chunk_frames = (1 + f * chunk) if enc else (1 + chunk)
    slab = -(-h // world) if rows is None else int(rows)
    slab_rows = (slab * s + (H - h * s)) if enc else slab
    n_chunks = max(1, math.ceil((t - 1) / chunk)) if t > 1 else 1
    if mode == "replicated":
        return Piece(frames_all, rows_all, cols, False, 1)
    if mode == "chunked":
        return Piece(min(chunk_frames, frames_all), rows_all, cols, False, n_chunks)
    if mode == "time":
        lat = max(q - p for p, q in TimeLayout(t, world, f).latents)
        # Encode: f frames per latent plus the 2 frames of causal context a later rank receives (rank 0's
        # first latent comes from one frame: the bound holds for every rank). Decode: a later rank's
        # latents each expand to f frames (no frame-0 drop) after the previous latent it receives as
        # causal context, which walks like one more latent frame.
        fr = f * lat + (2 if world > 1 else 0) if enc else lat + (1 if world > 1 else 0)
        return Piece(min(fr, frames_all), rows_all, cols, False, 1)
    if mode == "height":
        return Piece(frames_all, slab_rows, cols, world > 1, 1)
    if mode == "height+chunks":
        return Piece(min(chunk_frames, frames_all), slab_rows, cols, world > 1, n_chunks)
    if mode == "tiled":
        tl = min(tile, h) * (s if enc else 1)
        tc = min(tile, w) * (s if enc else 1)
        return Piece(min(chunk_frames, frames_all), tl, tc, False, n_chunks)
    raise ValueError(mode)


def estimate(cfg: VaeConfig, op: str, shape, world: int, mode: str, dtype=torch.bfloat16, chunk: int = 1,
             tile: int = 32, overlap: int = 8, gather: bool = True, backend: str = "cuda",
             winograd_filters: bool = False, rows: int | None = None) -> MemoryEstimate:
    """Modelled peak bytes of one rank running ``op`` ("encode"/"decode") of a (T, H, W) pixel clip.

    ``backend`` (:data:`BACKENDS`): ``"cpu-deterministic"`` (a CPU run under the deterministic policy, in the
    contiguous layout, :mod:`.channels_last`) adds, at each conv, the row-padded copy its fixed-shape calls
    read and the output-sized buffer oneDNN reorders their results through; ``"cpu"`` (channels-last, the
    fast policy: oneDNN reads and writes the layout directly) and ``"cuda"`` model neither. ``winograd_filters``
    (:func:`counts_winograd`): add the filters the Winograd convs of this piece will cache. ``rows``: this
    rank's latent rows under the height modes (ranks of unequal speed, :class:`.layouts.SlabLayout`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    b = torch.empty((), dtype=dtype).element_size()
    T, H, W = shape
    t, h, w = cfg.latent_shape(T, H, W)
    pc = piece_of(cfg, op, shape, world, mode, chunk, tile, overlap, rows)
    carry = mode in ("chunked", "height+chunks", "tiled") and pc.pieces > 1
    wk = _Walk(b, False, pc.halo, carry, backend == "cpu-deterministic", dtype if winograd_filters else None)
    walk = {"encode": _walk_encoder, "decode": _walk_decoder}
    walk[op](cfg, wk, (pc.frames, pc.rows, pc.cols), h)
    filters = wk.filters
    if winograd_filters:  # the cache lives with the VAE: a restoration's decode still holds the encoder's filters
        other = "decode" if op == "encode" else "encode"
        po = piece_of(cfg, other, shape, world, mode, chunk, tile, overlap, rows)
        wo = _Walk(b, False, po.halo, False, backend == "cpu-deterministic", dtype)
        walk[other](cfg, wo, (po.frames, po.rows, po.cols), h)
        filters += wo.filters
    lat = 2 * cfg.latent_channels * t * h * w * b
    vid = cfg.in_channels * T * H * W * b
    if op == "encode":
        io = vid + 2 * lat
    else:
        share = vid if mode in ("replicated", "chunked", "tiled") or world == 1 else \
            vid * (pc.frames / max(T, 1) if mode == "time" else pc.rows / h)
        io = lat + share * (2 if pc.pieces > 1 else 1) + (2 * vid if gather and world > 1 and mode not in (
            "replicated", "chunked", "tiled") else 0) + (vid if mode == "tiled" else 0)
    return MemoryEstimate(mode, num_params(cfg) * b, wk.peak, wk.largest, wk.halo_bytes, wk.state, int(io), pc,
                          wk.peak_op, filters)


def backend_of(device: torch.device | str, deterministic: bool) -> str:
    """The :func:`estimate` backend of a VAE run on ``device`` under this kernel policy (its activations' layout)."""
    if torch.device(device).type != "cpu":
        return "cuda"
    return "cpu-deterministic" if deterministic or not channels_last.enabled() else "cpu"


def counts_winograd(device: torch.device | str, deterministic: bool) -> bool:
    """Whether a VAE run on ``device`` under this kernel policy caches Winograd filters (CPU, fast, switched on)."""
    return torch.device(device).type == "cpu" and not deterministic and winograd.enabled()


@dataclass
class Choice:
    mode: str
    report: str
    estimates: dict = field(default_factory=dict)


def choose_mode(cfg: VaeConfig, shape, world: int, budget, dtype=torch.bfloat16, chunk: int = 1,
                tile: int = 32, overlap: int = 8, ops: tuple[str, ...] = ("encode", "decode"),
                winograd_filters: bool = False, backend: str = "cuda", rows=None) -> Choice:
    """What ``auto`` means, the one rule (:mod:`.modes`): the first exact mode of ``AUTO_ORDER`` whose modelled
    per-rank peak over ``ops`` fits ``budget``; tiled (APPROXIMATE) only if none does; else MemoryError.

    Ranks of unequal capacity: ``budget`` one per rank and ``rows`` each rank's latent slab rows under the
    height modes; a mode fits when every rank's peak fits its own budget (the estimates name the most
    loaded rank's peak). A pure function of its arguments, so every rank that agreed on them picks the
    same mode.
    """
    t = cfg.latent_shape(*shape)[0]
    cands = [m for m in AUTO_ORDER if t >= BY_NAME[m].min_latent_frames and (world > 1 or not BY_NAME[m].splits)]
    per_rank = budget is not None and not isinstance(budget, int) or rows is not None
    if per_rank:
        budgets = [budget] * world if budget is None or isinstance(budget, int) else list(budget)
        return _choose_per_rank(cfg, shape, world, budgets, dtype, chunk, tile, overlap, ops, winograd_filters,
                                backend, rows, cands)

    def peak(m: str) -> int:
        return max(estimate(cfg, op, shape, world, m, dtype, chunk, tile, overlap, backend=backend,
                            winograd_filters=winograd_filters).total for op in ops)

    est = {}
    for m in cands:
        est[m] = peak(m)
        if budget is None or est[m] <= budget:
            note = "no budget" if budget is None else f"fits {budget / GiB:.2f} GiB"
            return Choice(m, f"auto: the first exact mode that fits, modelled {est[m] / GiB:.2f} GiB per rank, "
                             f"{note}", est)
    for m in FALLBACK:
        est[m] = peak(m)
        if est[m] <= budget:
            return Choice(m, f"auto: no exact mode fits {budget / GiB:.2f} GiB; {m} (APPROXIMATE), modelled "
                             f"{est[m] / GiB:.2f} GiB", est)
    raise MemoryError(f"no VAE mode fits {budget / GiB:.2f} GiB per rank for {'+'.join(ops)} {tuple(shape)} at "
                      f"SP={world}: " + "; ".join(f"{m} {b / GiB:.2f} GiB" for m, b in est.items()))


def _choose_per_rank(cfg, shape, world, budgets, dtype, chunk, tile, overlap, ops, winograd_filters, backend, rows,
                     cands) -> Choice:
    """:func:`choose_mode` for ranks of unequal budgets and slabs: a mode fits when every rank's fits."""

    def peaks(m: str) -> list[int]:
        slab = BY_NAME[m].slab and rows is not None
        one = None
        out = []
        for r in range(world):
            if one is None or slab:
                one = max(estimate(cfg, op, shape, world, m, dtype, chunk, tile, overlap, backend=backend,
                                   winograd_filters=winograd_filters, rows=rows[r] if slab else None).total
                          for op in ops)
            out.append(one)
        return out

    def fits(p: list[int]) -> bool:
        return all(b is None or x <= b for x, b in zip(p, budgets))

    def room(p: list[int]) -> str:  # the rank with the least room left
        r = min(range(world), key=lambda k: (budgets[k] or 0) - p[k]) if budgets[0] is not None else 0
        return f"rank {r} {p[r] / GiB:.2f} GiB" + ("" if budgets[r] is None else f" of {budgets[r] / GiB:.2f}")

    est = {}
    for m in cands:
        p = peaks(m)
        est[m] = max(p)
        if fits(p):
            note = "no budget" if budgets[0] is None else "fits every rank's budget"
            return Choice(m, f"auto: the first exact mode that fits, modelled {room(p)} GiB, {note}", est)
    for m in FALLBACK:
        p = peaks(m)
        est[m] = max(p)
        if fits(p):
            return Choice(m, f"auto: no exact mode fits every rank; {m} (APPROXIMATE), modelled {room(p)} GiB", est)
    raise MemoryError(f"no VAE mode fits every rank's budget ({', '.join(f'{b / GiB:.2f}' for b in budgets)} GiB) "
                      f"for {'+'.join(ops)} {tuple(shape)} at SP={world}: "
                      + "; ".join(f"{m} {b / GiB:.2f} GiB" for m, b in est.items()))
