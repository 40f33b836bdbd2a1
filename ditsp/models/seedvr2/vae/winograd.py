"""Winograd F(4x4, 3x3) for the VAE's wide 3x3x3 convolutions: float32 on CPU, fast policy only.

A direct 3x3x3 conv spends 27 multiply-adds per output and input channel; oneDNN runs it near the
core's peak, so the only way to be faster is to do fewer of them. Winograd's minimal filtering
computes a 4x4 output tile of a 3x3 filter from a 6x6 input tile with 36 products instead of
144: each frame's input tiles and the filters are transformed (``B^T d B``, ``G g G^T``), the
36 transformed positions are 36 independent channel GEMMs, and the output transform
(``A^T m A``) folds them back. Time stays direct: each position runs one GEMM per temporal tap,
the taps summed, so a conv is 108 GEMMs that do a quarter of the direct conv's multiplies. On one
AVX-512 core the VAE's convs run 1.5-2.8x faster (more the wider they are) and the released VAE's
encode + decode of a 5x64x64 clip takes 0.59x the CPU time (``ditsp bench winograd``,
``benchmarks/results/vae-winograd.md``).

The price is precision: the transforms' coefficients (up to 8 in ``A^T``, 5 in ``B^T``) grow the
float32 rounding error to ~1e-5 of the output's scale, against ~5e-7 for the direct conv
(``tests/test_vae_winograd.py`` bounds it). Fine for the fast policy, which promises results within
tolerance; never under the deterministic policy, whose fixed-shape calls must be bitwise equal
across SP degrees (:func:`.layers.conv3d` calls this from its fast branch only).

Layout. The transforms run on a channels-last float32 copy of each band so that every slice they
add is a run of channels (vectorised), and a GEMM's rows are (frame, tile) with the channels
contiguous, so the temporal taps are row offsets into one matrix (no copies). A channels-last
activation (:mod:`.channels_last`, the fast policy's) is copied in and written back without
transposes; a (C, T, H, W) one is transposed both ways. All of it
runs in bands of tile rows of about :data:`BAND_BYTES` of transformed input, which keeps the
buffers cache-sized and reused. The filters' transforms are packed for oneDNN and kept in a
:class:`WeightCache` on the conv module, recomputed when the weight changes (its storage or its
version counter): 4x the filter's bytes (1.6 GiB for the convs a 5x64x64 clip sends here, 3.6 GiB
for all of the released VAE's eligible convs) and, on this VM, ~1.5 us per channel pair to build,
which is why a conv builds them only once its calls have done about as much direct work
(:data:`BUILD_PIXELS`).

The ``vae_winograd`` field of :class:`~ditsp.cpu.settings.CpuSettings` (``DITSP_VAE_WINOGRAD=0``)
turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....cpu import settings
from .channels_last import is_channels_last

ENV = settings.ENV["vae_winograd"]  # the switch's environment variable (the budget's advice names it)

# GEMM rows are processed in bands of tile rows whose transformed input V stays near this size (cache-sized
# working set, no page faults of fresh large buffers).
BAND_BYTES = 12 << 20
# When a conv is worth it, measured on one AVX-512 core (benchmarks/results/vae-winograd.md): the
# transforms cost per input and output channel, the GEMMs save per pair of them, and small GEMMs run
# far from peak. So both widths must be wide, and the narrower the input, the more GEMM rows (output
# frames x 4x4 tiles per frame) and output frames (each reads three transformed input frames) it needs.
MIN_COUT = 128
RULES = ((256, 32, 1), (128, 128, 3))  # (input channels at least, then GEMM rows, output frames)
# A bfloat16 conv is computed in float32 (module docstring). oneDNN's bfloat16 direct conv runs about twice as
# fast as its float32 one, so only convs at least this wide both ways gain (benchmarks/results/vae-winograd-bf16.md).
MIN_COUT_BF16 = 256
RULES_BF16 = ((256, 32, 1),)
# A conv's filters are transformed (and packed) once its Winograd-eligible calls, this one included, reach
# this many output pixels (frames x rows x columns); until then it runs direct. Transforming costs 0.3-1.7 us
# per (in, out) channel pair on this VM (mostly page faults of the new 4x-weight-sized buffers) and saves
# ~0.12-0.17 ns per pair per output pixel in float32: a big call builds at once and pays it back by itself,
# a small conv first runs direct for about what the transform costs (so a short session never pays more than
# twice the best choice in hindsight), and a conv that runs once in a small one-shot clip never pays it.
BUILD_PIXELS = 8192
# bfloat16 saves only 0.014-0.06 ns per pair per pixel against oneDNN's twice-as-fast direct bf16 conv, for the
# same build cost, so its break-even is about four times later (benchmarks/results/vae-winograd-bf16.md).
BUILD_PIXELS_BF16 = 32768

TILE = 4  # outputs per tile side: F(4x4, 3x3) reads 6x6 input tiles
_N = TILE + 2

# F(4, 3) at the points 0, 1, -1, 2, -2 and infinity.
_G = ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6),
      (1 / 24, 1 / 12, 1 / 6), (1 / 24, -1 / 12, 1 / 6), (0, 0, 1))
# B^T rows (input transform) and A^T rows (output transform), applied as the slice sums in
# _input_pass and _output_pass: B^T = [[4,0,-5,0,1,0], [0,-4,-4,1,1,0], [0,4,-4,-1,1,0],
# [0,-2,-1,2,1,0], [0,2,-1,-2,1,0], [0,4,0,-5,0,1]]; A^T = [[1,1,1,1,1,0], [0,1,-1,2,-2,0],
# [0,1,1,4,4,0], [0,1,-1,8,-8,1]]. A^T's column 1 is all ones: a bias added to the transformed
# position (1, 1) lands on every output of the tile (the GEMM of that position adds it).
_BIAS_POSITION = 1 * _N + 1

_op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _op is not None else None


def enabled() -> bool:
    """Whether the ``vae_winograd`` setting in force allows the Winograd route (default: on)."""
    return settings.current().vae_winograd


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding) -> bool:
    """Whether this conv call takes the Winograd route (the caller has already chosen the fast policy).

    A float32 or bfloat16 CPU inference call of a 3x3x3, stride-1 conv with no time padding (the
    caller puts the causal frames in place), wide and big enough by :func:`fits`.
    """
    if _op is None or x.device.type != "cpu" or x.dim() != 5 or _rules(x.dtype)[1] is None:
        return False
    if weight.dtype != x.dtype or tuple(weight.shape[2:]) != (3, 3, 3) or weight.shape[1] != x.shape[1]:
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    if tuple(stride) != (1, 1, 1) or padding[0] != 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    if torch.compiler.is_compiling() or weight.is_inference():
        return False  # an inference tensor has no version counter: in-place changes would leave stale filters
    t_out, h_out, w_out = x.shape[2] - 2, x.shape[3] + 2 * padding[1] - 2, x.shape[4] + 2 * padding[2] - 2
    return fits(weight.shape[1], weight.shape[0], (t_out, h_out, w_out), x.dtype) and enabled()


def fits(c_in: int, c_out: int, out_shape: tuple[int, int, int], dtype: torch.dtype) -> bool:
    """The size rule alone: whether a 3x3x3 conv this wide, with output frames x rows x columns ``out_shape``,
    gains by Winograd in ``dtype`` (:data:`MIN_COUT`, :data:`RULES` and their bfloat16 pair). The memory
    model (:mod:`.memory`) asks it too, to count the filters such a conv will cache."""
    min_cout, rules = _rules(dtype)
    t_out, h_out, w_out = out_shape
    if rules is None or c_out < min_cout or t_out < 1 or h_out < 1 or w_out < 1:
        return False
    rows = t_out * -(-h_out // TILE) * -(-w_out // TILE)
    for min_cin, min_rows, min_frames in rules:
        if c_in >= min_cin:
            return rows >= min_rows and t_out >= min_frames
    return False


def filter_bytes(c_in: int, c_out: int) -> int:
    """Bytes of one conv's cached filters: 36 transformed positions x 3 taps of (C_out, C_in), float32."""
    return _N * _N * 3 * c_out * c_in * 4


def _rules(dtype: torch.dtype) -> tuple[int, tuple | None]:
    """(least output channels, size rules) of a conv in ``dtype`` (rules None: never by Winograd), read per call."""
    return {torch.float32: (MIN_COUT, RULES), torch.bfloat16: (MIN_COUT_BF16, RULES_BF16)}.get(dtype, (0, None))


def transform_weight(weight: torch.Tensor) -> torch.Tensor:
    """``G g G^T`` of every (tap, out, in) 3x3 filter: (36, 3, C_out, C_in) float32.

    One (36 x 9) @ (9 x filters) product, so the big result is written once, in its final layout
    (float32: its rounding, ~3e-8 of the filters' scale, is far below the transform's own).
    """
    g = torch.tensor(_G, dtype=torch.float64)
    kron = torch.kron(g, g).to(torch.float32)  # (36, 9): [a * 6 + b, i * 3 + j] = G[a, i] G[b, j]
    taps = weight.detach().to(torch.float32).permute(2, 0, 1, 3, 4).reshape(-1, 9)  # (tap * out * in, 9)
    return torch.mm(kron, taps.t()).view(_N * _N, 3, weight.shape[0], weight.shape[1])


class WeightCache:
    """One conv's transformed filters, recomputed when the weight's storage or version changes; and,
    until it has them, the weight laid out channels-last for direct calls (:meth:`channels_last`).

    Holds no reference to the weight; copying or pickling a module carries an empty cache.
    """

    __slots__ = ("key", "filters", "seen", "pixels", "last_key", "last_weight")

    def __init__(self):
        self.key = self.filters = self.seen = self.last_key = self.last_weight = None
        self.pixels = 0

    def channels_last(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in channels-last 3-D for a direct call on a channels-last input, copied once per weight.

        Given a contiguous weight and a channels-last input, oneDNN's convolution copies the weight to
        channels-last on every call: 28 MB for a 512-wide float32 3x3x3 conv, which made a 5x32x32
        clip's decode 1.6x slower than in the contiguous layout. The copy is dropped once the conv has
        its Winograd filters (it then runs no direct calls). A weight that tracks gradients, or an
        inference tensor (no version counter to tell a changed weight by), is handed back as it is.
        """
        if weight.is_inference() or (torch.is_grad_enabled() and weight.requires_grad):
            return weight
        key = self._key(weight)
        if self.last_key != key:
            self.last_weight = None  # free the old copy first
            self.last_weight, self.last_key = weight.detach().contiguous(memory_format=torch.channels_last_3d), key
        return self.last_weight

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        return weight.data_ptr(), weight._version, tuple(weight.shape), tuple(weight.stride())

    def ready(self, weight: torch.Tensor, pixels: int) -> bool:
        """Whether a call with ``pixels`` output pixels (frames x rows x cols) should run by Winograd now.

        Yes when the filters of this weight are cached, or when this weight's calls so far, this one
        included, reach :data:`BUILD_PIXELS` (:data:`BUILD_PIXELS_BF16` for a bfloat16 weight; the caller then
        builds them); no otherwise (run direct).
        """
        key = self._key(weight)
        if self.key == key and self.filters is not None:
            return True
        if self.seen != key:
            self.seen, self.pixels = key, 0
        self.pixels += pixels
        return self.pixels >= (BUILD_PIXELS_BF16 if weight.dtype == torch.bfloat16 else BUILD_PIXELS)

    def get(self, weight: torch.Tensor, rows: int) -> list[list[torch.Tensor]]:
        """The 36 x 3 filter matrices (C_out, C_in) of ``weight``, packed for oneDNN GEMMs of ``rows`` rows."""
        key = self._key(weight)
        if self.key != key or self.filters is None:
            self.filters = self.last_weight = self.last_key = None  # free the old filters before building the new ones
            self.filters = _filters(weight, rows)
            self.key = key
        return self.filters

    def clear(self) -> None:
        self.key = self.filters = self.seen = self.last_key = self.last_weight = None
        self.pixels = 0

    def __reduce__(self):  # copies and pickles start empty: the filters follow the copy's own weight
        return (WeightCache, ())


def _filters(weight: torch.Tensor, rows: int) -> list[list[torch.Tensor]]:
    u = transform_weight(weight)
    global _pack
    if _pack is not None:
        try:
            return [[_pack(u[p, k], rows) for k in range(3)] for p in range(_N * _N)]
        except RuntimeError:
            _pack = None  # a oneDNN build that cannot pack: the plain matrices (oneDNN reorders per call)
    return [[u[p, k] for k in range(3)] for p in range(_N * _N)]


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding=(0, 1, 1),
           cache: WeightCache | None = None, band_bytes: int | None = None) -> torch.Tensor:
    """``F.conv3d(x, weight, bias, padding=padding)`` for a 3x3x3 stride-1 conv by Winograd F(4x4, 3x3).

    ``x`` (B, C_in, T, H, W) float32 on CPU, ``padding`` (0, rows, cols) zero padding; output
    (B, C_out, T - 2, H + 2 rows - 2, W + 2 cols - 2). H and W need not be multiples of 4: the last
    tiles read zeros past the edge and their extra outputs are dropped. ``cache``: the conv's
    :class:`WeightCache` (without one the filters are transformed for this call alone).

    The work runs in bands of tile rows (all frames, all columns) whose transformed input is about
    ``band_bytes``: every buffer then stays cache-sized and is reused by the allocator from band to
    band, instead of whole-activation buffers that page-fault on every call.
    """
    b, c, t_in, h, w = x.shape
    ph, pw = padding[1], padding[2]
    t_out, h_out, w_out = t_in - 2, h + 2 * ph - 2, w + 2 * pw - 2
    th, tw = -(-h_out // TILE), -(-w_out // TILE)
    band = max(1, min(th, (band_bytes or BAND_BYTES) // (_N * _N * t_in * tw * c * 4)))
    filters = (cache or WeightCache()).get(weight, t_out * band * tw)
    bias = bias.float() if bias is not None else None
    # x's layout and dtype (a bfloat16 output is rounded once); a channels-last x needs no transposes either way
    last = is_channels_last(x)
    out = torch.empty((b, weight.shape[0], t_out, h_out, w_out), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last_3d if last else torch.contiguous_format)
    for i in range(b):
        for r in range(0, th, band):
            n = min(band, th - r)
            xc = _channels_last(x[i], TILE * r - ph, TILE * n + 2, pw, tw, last)
            v = _input_transform(xc, n, tw)
            del xc
            m = _gemms(v, filters, bias, n * tw, t_out * n * tw)
            del v
            y = _output_transform(m, n, tw)  # (T, rows, cols, C)
            rows = min(TILE * n, h_out - TILE * r)
            if last:
                out[i].permute(1, 2, 3, 0)[:, TILE * r:TILE * r + rows] = y[:, :rows, :w_out]
                continue
            yc = y.view(-1, y.shape[-1]).t().contiguous().view(-1, t_out, TILE * n, TILE * tw)  # channels first
            out[i, :, :, TILE * r:TILE * r + rows] = yc[:, :, :rows, :w_out]
    return out


def _channels_last(x: torch.Tensor, top: int, rows: int, left: int, tw: int, last: bool) -> torch.Tensor:
    """Rows ``top`` .. ``top + rows`` of (C, T, H, W), columns from ``-left``, zeros outside: (T, rows, 4 tw + 2, C)
    float32. ``last``: ``x`` is one item of a channels-last activation (else contiguous)."""
    c, t, h, w = x.shape
    wp = TILE * tw + 2
    lo, hi = max(top, 0), min(top + rows, h)
    if last:  # channels last already: no transpose
        out = torch.empty(t, rows, wp, c, dtype=torch.float32)
        a, b = lo - top, hi - top
        for part in (out[:, :a], out[:, b:], out[:, a:b, :left], out[:, a:b, left + w:]):
            part.zero_()
        out[:, a:b, left:left + w] = x.permute(1, 2, 3, 0)[:, lo:hi]  # one copy (and cast)
        return out
    x = F.pad(x[:, :, lo:hi], (left, wp - w - left, lo - top, top + rows - hi))  # a copy, in x's dtype
    out = torch.empty(t * rows * wp, c, dtype=torch.float32)
    return out.copy_(x.view(c, t * rows * wp).t()).view(t, rows, wp, c)  # a blocked transpose (and cast)


def _input_transform(xc: torch.Tensor, th: int, tw: int) -> torch.Tensor:
    """(T, 4 th + 2, 4 tw + 2, C) -> V (36, T * th * tw, C): ``B^T d B`` of every 6x6 tile.

    V's rows are (frame, tile row, tile col), so a temporal tap is an offset of th * tw rows.
    """
    t, hp, _, c = xc.shape
    z = xc.new_empty(_N, t, hp, tw, c)
    _input_pass(xc, 2, tw, z)  # along columns: z[j] = (t, rows, tile col, c)
    v = z.new_empty(_N, _N, t, th, tw, c)
    _input_pass(z, 2, th, v)  # along rows, all six column positions at once: v[i][j] = (t, tile row, tile col, c)
    return v.view(_N * _N, t * th * tw, c)


def _input_pass(x: torch.Tensor, dim: int, tiles: int, out: torch.Tensor) -> None:
    """``out[k] = sum_j B^T[k, j] d_j`` where ``d_j`` is the j-th element of every tile along ``dim`` (stride 4)."""
    span = TILE * (tiles - 1) + 1
    pick = (slice(None),) * dim + (slice(None, None, TILE),)
    d0, d1, d2, d3, d4, d5 = (x.narrow(dim, j, span)[pick] for j in range(_N))
    u = torch.add(d4, d2, alpha=-4)
    v = torch.add(d3, d1, alpha=-4)
    torch.add(u, v, out=out[1])  # -4 d1 - 4 d2 + d3 + d4
    torch.sub(u, v, out=out[2])  # 4 d1 - 4 d2 - d3 + d4
    torch.sub(d4, d2, out=u)
    torch.sub(d3, d1, out=v)
    torch.add(u, v, alpha=2, out=out[3])  # -2 d1 - d2 + 2 d3 + d4
    torch.add(u, v, alpha=-2, out=out[4])  # 2 d1 - d2 - 2 d3 + d4
    torch.sub(d0, d2, out=v)
    torch.add(u, v, alpha=4, out=out[0])  # 4 d0 - 5 d2 + d4
    torch.sub(d5, d3, out=u)
    torch.sub(d1, d3, out=v)
    torch.add(u, v, alpha=4, out=out[5])  # 4 d1 - 5 d3 + d5


def _gemms(v: torch.Tensor, filters, bias: torch.Tensor | None, tiles: int, rows: int) -> list[torch.Tensor]:
    """M[p] = sum over taps k of V[p] shifted by k frames times U[p, k]^T: 36 x (rows, C_out)."""
    m = []
    for p in range(_N * _N):
        acc = _op(v[p, :rows], filters[p][0], bias if p == _BIAS_POSITION else None, "none", [], "")
        acc += _op(v[p, tiles:tiles + rows], filters[p][1], None, "none", [], "")
        acc += _op(v[p, 2 * tiles:2 * tiles + rows], filters[p][2], None, "none", [], "")
        m.append(acc)
    return m


def _output_pass(m, out) -> None:
    """``out[r] = sum_k A^T[r, k] m[k]`` for the four output rows of A^T."""
    m0, m1, m2, m3, m4, m5 = m
    s12, d12 = m1 + m2, m1 - m2
    s34, d34 = m3 + m4, m3 - m4
    torch.add(s12, s34, out=out[0]).add_(m0)
    torch.add(d12, d34, alpha=2, out=out[1])
    torch.add(s12, s34, alpha=4, out=out[2])
    torch.add(d12, d34, alpha=8, out=out[3]).add_(m5)


def _output_transform(m: list[torch.Tensor], th: int, tw: int) -> torch.Tensor:
    """36 x (T * th * tw, C) -> ``A^T m A`` per tile: (T, 4 th, 4 tw, C) channels last."""
    c = m[0].shape[1]
    t = m[0].shape[0] // (th * tw)
    p = m[0].new_empty(TILE, _N, t, th, tw, c)
    for j in range(_N):  # along rows, per column position (the GEMMs' outputs are separate tensors)
        _output_pass([m[i * _N + j].view(t, th, tw, c) for i in range(_N)], p[:, j])
    del m[:]
    y = p.new_empty(t, th, TILE, tw, TILE, c)
    _output_pass(p.transpose(0, 1), y.permute(4, 2, 0, 1, 3, 5))  # along columns, into the pixel grid
    return y.view(t, TILE * th, TILE * tw, c)
