"""Building blocks of the causal video VAE. Parameters only; *how* a block runs is the executor's job.

Every block's ``forward(x, ex)`` takes the activation ``x`` (B, C, T, H, W) of the piece of the
clip this process holds and an :class:`~.execution.Exec` that knows where that piece sits in the
clip: the executor supplies each causal conv's missing past frames (copies of frame 0 at the
start of the clip, the tail of the previous chunk, or frames received from the previous rank) and
missing rows (zeros at the image border, rows of the neighbouring height slab), reduces GroupNorm
statistics over the whole frame and gathers attention keys/values of the whole frame. The math of
one block is therefore the same in every execution mode.

Layer semantics (same as the released model):

- causal conv: time padding is ``k_t - 1`` frames *in front only*; at the start of the clip they
  are copies of frame 0. Spatial padding is one zero row/column each side for 3x3 convs, none for
  1x1, and one zero row at the bottom / column at the right for the stride-2 downsamplers.
- GroupNorm: statistics per frame (over the group's channels and H x W of one frame), eps 1e-6.
- upsampler: a 1x1x1 conv to ``C * r`` channels, then depth-to-space with the row offset outermost,
  then column offset, then frame offset, channel innermost; temporal stages drop the second copy of
  the clip's frame 0; then a causal 3x3x3 conv.
- mid attention: one head over all channels, per frame over its H x W tokens, with its own
  GroupNorm and a residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....fixed_shape import conv_tile_rows, plain_linear
from . import winograd
from .channels_last import is_channels_last
from .config import VaeConfig


_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.aten, "mkldnn_convolution")
# oneDNN's bf16 convolution needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere bf16 convs run in float32 (_conv_call).
_MKLDNN_DTYPES = (torch.float32,) + ((torch.bfloat16,) if _MKLDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride=(1, 1, 1),
           padding=(0, 0, 0), frame_rows: int | None = None,
           cache: winograd.WeightCache | None = None) -> torch.Tensor:
    """``F.conv3d`` whose calls have a shape that does not depend on the piece around a pixel.

    Under the deterministic kernel-shape policy (:mod:`ditsp.fixed_shape`) every call computes one
    output frame of exactly :func:`~ditsp.fixed_shape.conv_tile_rows` output rows (a function of the
    layer's width and of ``frame_rows``, the whole frame's output rows; a height slab must pass it,
    a piece of whole frames may leave it to this call's own output rows): time and row padding are made explicit first, and a tile past the last rows is
    zero-padded in an aligned staging buffer. So a pixel's value is the same whether its piece of
    the clip is the whole clip, a chunk of frames, a time shard or a height slab, on any CPU
    kernels. Under the fast policy it is one call over the piece, by Winograd
    (:mod:`.winograd`) where ``cache`` (the conv's transformed filters) is given and the call qualifies.
    """
    pt, ph, pw = padding
    (kt, kh), (st, sh) = weight.shape[2:4], stride[:2]
    h_out = _out_size(x.shape[3] + 2 * ph, kh, sh)
    tile_rows = conv_tile_rows(_out_size(x.shape[4] + 2 * pw, weight.shape[4], stride[2]), frame_rows or h_out)
    if tile_rows is None or not x.numel():
        if cache is not None and x.numel() and winograd.applies(x, weight, bias, stride, padding) \
                and cache.ready(weight, (x.shape[2] - 2) * h_out * (x.shape[4] + 2 * pw - 2)):
            return winograd.conv3d(x, weight, bias, padding, cache)
        if cache is not None and is_channels_last(x):
            weight = cache.channels_last(weight)  # oneDNN would copy a contiguous weight on every call
        return _conv_call(x, weight, bias, stride, padding)
    if pt or ph:
        x = F.pad(x, (0, 0, ph, ph, pt, pt))
    t_out = _out_size(x.shape[2], kt, st)
    if t_out <= 0 or h_out <= 0:
        return _conv_call(x, weight, bias, stride, (0, 0, pw))
    in_rows = (tile_rows - 1) * sh + kh
    out, stage = None, None
    for t in range(t_out):
        frames = x[:, :, t * st:t * st + kt]
        for j in range(0, h_out, tile_rows):
            tile = frames[:, :, :, j * sh:j * sh + in_rows]
            if tile.shape[3] < in_rows:
                if stage is None:
                    stage = x.new_zeros(tile.shape[:3] + (in_rows,) + tile.shape[4:])
                stage[:, :, :, :tile.shape[3]] = tile
                stage[:, :, :, tile.shape[3]:] = 0
                tile = stage
            y = _conv_call(tile, weight, bias, (1, sh, stride[2]), (0, 0, pw))  # (B, C_out, 1, rows, W_out)
            if out is None:
                out = x.new_empty(y.shape[:2] + (t_out, h_out) + y.shape[4:])
            rows = min(tile_rows, h_out - j)
            out[:, :, t, j:j + rows] = y[:, :, 0, :rows]
    return out


def _out_size(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _conv_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding) -> torch.Tensor:
    """One convolution call, on oneDNN wherever it can run.

    On CPU, ``F.conv3d`` picks oneDNN or im2col + GEMM by the input's size (float32, batch 1:
    oneDNN only above 20480 = C*T*H), so the fast policy's calls go to oneDNN directly for one
    algorithm at every size. Under the deterministic policy every call has one shape anyway, so
    whichever algorithm runs it runs always. bf16 on a CPU whose oneDNN has no bf16 convolution
    (no AVX-512 BW / AVX-NE-CONVERT) would fall to PyTorch's reference loop (measured on an AVX2
    EPYC, one thread: 17 s against 0.23 s for one 512-channel 3x3x3 conv over 3x16x16); it runs as a float32 oneDNN call
    on the bf16 values instead, rounded to bf16 once (each output a float32 sum, as bf16 kernels
    accumulate).
    """
    if not (_MKLDNN and x.device.type == "cpu" and x.numel()):
        return F.conv3d(x, weight, bias, stride=stride, padding=padding)
    if x.dtype in _MKLDNN_DTYPES:
        return _mkldnn(x, weight, bias, stride, padding)
    if x.dtype == torch.bfloat16:
        return _mkldnn(x.float(), weight.float(), None if bias is None else bias.float(), stride, padding).bfloat16()
    return F.conv3d(x, weight, bias, stride=stride, padding=padding)


def _mkldnn(x, weight, bias, stride, padding) -> torch.Tensor:
    layout = torch.channels_last_3d if is_channels_last(x) else torch.contiguous_format  # kept (.channels_last)
    return torch.ops.aten.mkldnn_convolution(x.contiguous(memory_format=layout),
                                             weight.contiguous(memory_format=layout), bias, list(padding),
                                             list(stride), [1, 1, 1], 1)


class CausalConv3d(nn.Module):
    """A 3-D conv with causal time padding. ``pad`` is "same" (3x3, pad 1), "down" (bottom/right) or "none"."""

    def __init__(self, cin: int, cout: int, kernel=(3, 3, 3), stride=(1, 1, 1), pad: str = "same"):
        super().__init__()
        self.cin, self.cout = cin, cout
        self.kernel, self.stride, self.pad = tuple(kernel), tuple(stride), pad
        self.weight = nn.Parameter(torch.empty(cout, cin, *self.kernel))
        self.bias = nn.Parameter(torch.empty(cout))
        self.winograd = winograd.WeightCache()  # the fast policy's transformed filters, kept with the conv
        fan_in = cin * self.kernel[0] * self.kernel[1] * self.kernel[2]
        nn.init.normal_(self.weight, std=fan_in ** -0.5)
        nn.init.zeros_(self.bias)

    @property
    def rows_pad(self) -> tuple[int, int]:
        """Zero rows the conv adds at the top and bottom of the whole image."""
        return {"same": (self.kernel[1] // 2, self.kernel[1] // 2), "down": (0, 1), "none": (0, 0)}[self.pad]

    @property
    def cols_pad(self) -> tuple[int, int]:
        return {"same": (self.kernel[2] // 2, self.kernel[2] // 2), "down": (0, 1), "none": (0, 0)}[self.pad]

    def out_rows(self, rows: int) -> int:
        top, bot = self.rows_pad
        return (rows + top + bot - self.kernel[1]) // self.stride[1] + 1

    def out_cols(self, cols: int) -> int:
        left, right = self.cols_pad
        return (cols + left + right - self.kernel[2]) // self.stride[2] + 1

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None = None, rows_padded: bool = False,
              frame_rows: int | None = None) -> torch.Tensor:
        """Valid conv in time over ``x`` whose time padding is already in place.

        Rows are zero-padded here unless ``rows_padded`` (the executor then put halo rows in place).
        ``frame_rows``: the whole frame's output rows when ``x`` is a height slab (see :func:`conv3d`).
        """
        weight = self.weight if weight is None else weight
        w = weight.to(x.dtype)
        top, bot = (0, 0) if rows_padded else self.rows_pad
        left, right = self.cols_pad
        if top == bot and left == right:
            pad = (0, top, left)
        else:
            x = F.pad(x, (left, right, top, bot))
            pad = (0, 0, 0)
        return conv3d(x, w, self.bias.to(x.dtype), stride=self.stride, padding=pad, frame_rows=frame_rows,
                      cache=self.winograd if w is self.weight else None)

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        return ex.conv(self, x)


class GroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics are taken per frame; the executor may reduce them across slabs."""

    def forward(self, x: torch.Tensor, ex, silu: bool = False, then=None) -> torch.Tensor:  # type: ignore[override]
        """Normalised ``x``; ``silu`` applies the SiLU that follows every such norm but the attention's;
        ``then``: the conv that consumes the result (a height slab fetches its halo rows with the statistics)."""
        return ex.norm(self, x, silu=silu, then=then)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: VaeConfig):
        super().__init__()
        self.norm1 = GroupNorm(cfg.groups, cin, eps=cfg.eps)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = GroupNorm(cfg.groups, cout, eps=cfg.eps)
        self.conv2 = CausalConv3d(cout, cout)
        self.conv_shortcut = CausalConv3d(cin, cout, kernel=(1, 1, 1), pad="none") if cin != cout else None

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        # Rebinding ``h`` step by step frees each intermediate as soon as the next one exists.
        h = self.norm1(x, ex, silu=True, then=self.conv1)
        h = self.conv1(h, ex)
        h = self.norm2(h, ex, silu=True, then=self.conv2)
        h = self.conv2(h, ex)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, ex)
        return h.add_(x)


class Downsample(nn.Module):
    """Stride-2 conv over H and W (and over time for temporal stages) with bottom/right zero padding."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.conv = CausalConv3d(channels, channels, kernel=(3 if temporal else 1, 3, 3),
                                 stride=(2 if temporal else 1, 2, 2), pad="down")

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        return self.conv(x, ex)


def depth_to_space_source(x: torch.Tensor, z: int) -> torch.Tensor:
    """A channels-last ``x`` (B, 4*z*C, T, H, W) viewed as the (B, T, z, H, 2, W, 2, C) its depth-to-space
    lays out, frames outermost (no copy): what a copy into a channels-last output's frames reads."""
    b, ch, t, h, w = x.shape
    c = ch // (4 * z)
    return x.permute(0, 2, 3, 4, 1).view(b, t, h, w, 2, 2, z, c).permute(0, 1, 6, 2, 4, 3, 5, 7)


def depth_to_space(x: torch.Tensor, z: int) -> torch.Tensor:
    """(B, 4*z*C, T, H, W) -> (B, C, T*z, 2H, 2W); input channel ((i*2 + j)*z + tau)*C + c."""
    b, ch, t, h, w = x.shape
    c = ch // (4 * z)
    if is_channels_last(x):  # stays so (.channels_last)
        return depth_to_space_source(x, z).reshape(b, t * z, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)
    x = x.view(b, 2, 2, z, c, t, h, w).permute(0, 4, 5, 3, 6, 1, 7, 2)
    return x.reshape(b, c, t * z, 2 * h, 2 * w)


class Upsample(nn.Module):
    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.factor = 8 if temporal else 4
        self.conv = CausalConv3d(channels, channels)  # registered first, as released
        self.upscale_conv = nn.Conv3d(channels, channels * self.factor, kernel_size=1)

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        if x.numel():
            x = conv3d(x, self.upscale_conv.weight.to(x.dtype), self.upscale_conv.bias.to(x.dtype),
                       frame_rows=ex.H if ex.sharded_rows else None)
        else:  # an empty piece (a rank without frames or rows) still walks every layer
            x = x.new_zeros((x.shape[0], self.upscale_conv.out_channels) + tuple(x.shape[2:]))
        return self.conv(ex.upsample(x, 2 if self.temporal else 1, self.temporal, self.conv), ex)


class MidAttention(nn.Module):
    """One-head self-attention over the H x W tokens of each frame, with GroupNorm and residual."""

    def __init__(self, channels: int, cfg: VaeConfig):
        super().__init__()
        self.group_norm = GroupNorm(cfg.groups, channels, eps=cfg.eps)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        b, c, t, h, w = x.shape
        dt = x.dtype
        # A height slab gathers the whole frame's normalised tokens and attends them all, then keeps
        # its rows: every GEMM then has the one-device shape (one frame of H x W tokens), so the
        # result is bitwise the one-device result (a GEMM's rounding depends on its row count).
        tok = ex.frame_tokens(self.group_norm(x, ex).permute(0, 2, 3, 4, 1).reshape(b, t, h * w, c), w)
        outs = []
        for i in range(t):  # one frame at a time: the same GEMM shapes in every mode and chunking
            f = tok[:, i].contiguous()
            q = plain_linear(f, self.to_q.weight.to(dt), self.to_q.bias.to(dt))
            k = plain_linear(f, self.to_k.weight.to(dt), self.to_k.bias.to(dt))
            v = plain_linear(f, self.to_v.weight.to(dt), self.to_v.bias.to(dt))
            o = F.scaled_dot_product_attention(q, k, v) if f.shape[1] else q
            del q, k, v
            outs.append(ex.own_tokens(plain_linear(o, self.to_out[0].weight.to(dt), self.to_out[0].bias.to(dt)), w))
        del tok
        o = torch.stack(outs, 1) if outs else x.new_zeros((b, 0, h * w, c))
        return x + o.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)


class MidBlock(nn.Module):
    def __init__(self, channels: int, cfg: VaeConfig):
        super().__init__()
        # Registered in the released model's order (attention first), which fixes the parameter order.
        self.attentions = nn.ModuleList([MidAttention(channels, cfg)])
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, cfg) for _ in range(2)])

    def forward(self, x: torch.Tensor, ex) -> torch.Tensor:
        x = self.resnets[0](x, ex)
        x = self.attentions[0](x, ex)
        return self.resnets[1](x, ex)
