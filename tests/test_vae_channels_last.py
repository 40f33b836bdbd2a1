"""The fast policy's channels-last VAE (ditsp.models.seedvr2.vae.channels_last): the same function as
the contiguous layout within the fast policy's tolerance, every activation really in the layout (a
silent fall back to contiguous copies would cost the speed it is for), every sharded mode on real
ranks, and the deterministic policy left in the contiguous layout."""

from __future__ import annotations

import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.fixed_shape import DETERMINISTIC, FAST, use
from ditsp.models.seedvr2.vae import TINY, channels_last, winograd
from ditsp.models.seedvr2.vae.channels_last import is_channels_last
from ditsp.models.seedvr2.vae.execution import Exec, row_moments
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.layers import CausalConv3d, GroupNorm, MidAttention, ResnetBlock, Upsample, \
    depth_to_space
from ditsp.models.seedvr2.vae.sharded import ParallelVAE

CL = torch.channels_last_3d
FP32_REL = 2e-5  # fp32: the two layouts' convs round differently, ~1e-6 per conv


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _vae(dtype=torch.float32):
    return seeded_vae(TINY.with_widths((32, 64, 64, 64), groups=8)).to(dtype)


def _clip(T=5, H=40, W=24):
    return torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _layouts(vae):
    """Forward hooks recording, per layer output, whether it is channels-last (None when its shape
    leaves the layout undetermined, e.g. empty or one pixel)."""
    seen = []

    def hook(module, args, out):
        if out.numel() and not (out.is_contiguous() and out.is_contiguous(memory_format=CL)):
            seen.append((type(module).__name__, is_channels_last(out)))

    handles = [m.register_forward_hook(hook) for m in vae.modules()
               if isinstance(m, (CausalConv3d, GroupNorm, ResnetBlock, Upsample, MidAttention))]
    return seen, handles


def _run(vae, x, chunk, enabled, monkeypatch):
    monkeypatch.setattr(channels_last, "enabled", lambda enabled=enabled: enabled)
    z = vae.encode(x, chunk=chunk).mean
    return z, vae.decode(z, chunk=chunk)


@pytest.mark.parametrize("chunk", [None, 1])
def test_fast_policy_runs_every_layer_channels_last_with_the_same_result(chunk, monkeypatch):
    vae, x = _vae(), _clip()
    with use(FAST):
        ref = _run(vae, x, chunk, False, monkeypatch)
        seen, handles = _layouts(vae)
        got = _run(vae, x, chunk, True, monkeypatch)
    for h in handles:
        h.remove()
    assert len(seen) > 50 and all(last for _, last in seen), [s for s in seen if not s[1]][:5]
    for a, b in zip(got, ref):
        assert a.is_contiguous()  # what leaves the VAE is in the usual layout
        assert rel(a, b) < FP32_REL


@pytest.mark.parametrize("chunk", [None, 1])
def test_norms_write_each_causal_convs_input_behind_its_past_frames(chunk, monkeypatch):
    """A norm feeding a causal conv writes behind room for the conv's past frames, so the conv joins no
    copy of the whole activation; the bits are the cat's."""
    vae, x = _vae(), _clip(9)
    joins = []
    cat = Exec._cat
    monkeypatch.setattr(Exec, "_cat", lambda self, parts, dim: joins.append(dim) or cat(self, parts, dim))
    with use(FAST):
        got = _run(vae, x, chunk, True, monkeypatch)
        saved = len(joins)
        joins.clear()
        monkeypatch.setattr(Exec, "_front", lambda self, conv, x: 0)
        ref = _run(vae, x, chunk, True, monkeypatch)
    # every ResnetBlock conv (2 per block) and both conv_outs read a norm's output
    resnet_convs = 2 * sum(isinstance(m, ResnetBlock) for m in vae.modules()) + 2
    assert len(joins) - saved >= resnet_convs * (1 if chunk is None else 2), (len(joins), saved)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_bf16_channels_last_error_is_the_contiguous_layouts(monkeypatch):
    """bf16 rounds differently per layout; against float64 both are equally far off."""
    x = _clip()
    with use(FAST):
        z64, y64 = _run(_vae(torch.float64), x.double(), None, False, monkeypatch)
        vae = _vae(torch.bfloat16)
        errs = {}
        for enabled in (False, True):
            monkeypatch.setattr(channels_last, "enabled", lambda enabled=enabled: enabled)
            errs[enabled] = (rel(vae.encode(x).mean, z64), rel(vae.decode(z64.bfloat16()), y64))
    for plain, last in zip(errs[False], errs[True]):
        assert 0 < last < 1.5 * plain + 1e-3, errs


def test_deterministic_policy_stays_contiguous(monkeypatch):
    vae, x = _vae(), _clip()
    monkeypatch.setattr(channels_last, "enabled", lambda: True)
    seen, handles = _layouts(vae)
    with use(DETERMINISTIC):
        vae.decode(vae.encode(x).mean)
    for h in handles:
        h.remove()
    assert seen and not any(last for _, last in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_moments_of_a_channels_last_activation(dtype):
    x = (torch.randn(2, 16, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype)
    gm, g2 = row_moments(x.contiguous(memory_format=CL), 4)
    pm, p2 = row_moments(x, 4)
    # float64 truth: per (batch, group, frame, row) over the group's channels and the row's columns
    v = x.double().view(2, 4, 4, 3, 5, 7).permute(0, 1, 3, 4, 2, 5).reshape(2, 4, 3, 5, 28)
    mean = v.mean(-1)
    m2 = (v - mean.unsqueeze(-1)).square().sum(-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-5  # bf16: float32 sums of x and x^2
    for got, plain, true in ((gm, pm, mean), (g2, p2, m2)):
        assert got.dtype == torch.float64 and got.shape == true.shape
        assert rel(got, true) < tol and rel(plain, true) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_winograd_reads_and_writes_channels_last_with_the_same_bits(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 24, 5, 13, 10, generator=g).to(dtype)
    w = (torch.randn(16, 24, 3, 3, 3, generator=g) * 0.1).to(dtype)
    b = (torch.randn(16, generator=g) * 0.1).to(dtype)
    plain = winograd.conv3d(x, w, b, (0, 1, 1))
    last = winograd.conv3d(x.contiguous(memory_format=CL), w, b, (0, 1, 1))
    assert is_channels_last(last) and plain.is_contiguous()
    assert torch.equal(last, plain)  # the same float32 tiles either way: only the copies in and out differ


@pytest.mark.parametrize("z", [1, 2])
def test_depth_to_space_keeps_the_layout(z):
    x = torch.randn(1, 4 * z * 3, 2, 3, 5)
    got = depth_to_space(x.contiguous(memory_format=CL), z)
    assert is_channels_last(got) and torch.equal(got, depth_to_space(x, z))


# ----------------------------------------------------------------- sharded, on real ranks


def sharded_fast(ctx, modes):
    torch.set_num_threads(1)
    pv = ParallelVAE(_vae(), Comm(ctx.group), chunk=1)
    out = {}
    with use(FAST), torch.no_grad():
        for mode in modes:
            z = pv.encode(_clip(9, 40, 24), mode=mode).posterior.mean
            out[mode] = (z, pv.decode(z, mode=mode))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_modes_channels_last_match_one_device(clusters, world, monkeypatch):
    """Time split (with a rank holding one latent frame at 3), height slabs and slabs in chunks, all in
    the channels-last layout, against one device in the contiguous layout."""
    monkeypatch.setattr(channels_last, "enabled", lambda: False)
    pv = ParallelVAE(_vae(), None)
    with use(FAST), torch.no_grad():
        z = pv.encode(_clip(9, 40, 24), mode="replicated").posterior.mean
        ref = (z, pv.decode(z, mode="replicated"))
    modes = ["time", "height", "height+chunks"]
    for mode, (z, y) in clusters(world).run(sharded_fast, modes)[0].items():
        assert rel(z, ref[0]) < FP32_REL and rel(y, ref[1]) < FP32_REL, mode


def slab_joins(ctx, mode):
    """Height slabs on this rank with and without norms writing behind the causal convs' past frames:
    the outputs and the number of joined copies each way."""
    torch.set_num_threads(1)
    pv = ParallelVAE(_vae(), Comm(ctx.group), chunk=1)
    joins, cat, front = [], Exec._cat, Exec._front
    Exec._cat = lambda self, parts, dim: joins.append(dim) or cat(self, parts, dim)
    out = {}
    try:
        for name, fn in (("front", front), ("cat", lambda self, conv, x: 0)):
            Exec._front = fn
            joins.clear()
            with use(FAST), torch.no_grad():
                z = pv.encode(_clip(9, 40, 24), mode=mode).posterior.mean
                out[name] = (z, pv.decode(z, mode=mode), len(joins))
    finally:
        Exec._cat, Exec._front = cat, front
    return out


@pytest.mark.parametrize("mode", ["height", "height+chunks"])
def test_height_slabs_write_each_causal_convs_input_behind_its_past_frames(clusters, mode):
    for rank in clusters(2).run(slab_joins, mode):
        (z, y, n_front), (z_cat, y_cat, n_cat) = rank["front"], rank["cat"]
        assert torch.equal(z, z_cat) and torch.equal(y, y_cat)
        assert n_cat - n_front >= 50, (n_cat, n_front)  # the 48 ResnetBlock convs and 2 conv_outs, at least


def test_direct_calls_reuse_one_channels_last_weight_until_winograd_takes_over(monkeypatch):
    """oneDNN copies a contiguous weight to the input's layout on every call: a channels-last input gets the
    conv's cached channels-last copy instead (the same bits), built once, dropped with the Winograd build."""
    monkeypatch.delenv(winograd.ENV, raising=False)
    g = torch.Generator().manual_seed(3)
    conv = CausalConv3d(24, 16).requires_grad_(False)
    conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.1)
    conv.bias.zero_()
    x = torch.randn(1, 24, 5, 9, 7, generator=g).contiguous(memory_format=CL)
    with use(FAST), torch.no_grad():
        first = conv.apply(x, rows_padded=False)
        cached = conv.winograd.last_weight
        again = conv.apply(x, rows_padded=False)
        assert cached is not None and conv.winograd.last_weight is cached and is_channels_last(cached)
        assert torch.equal(cached, conv.weight)
        assert torch.equal(first, again) and is_channels_last(first)
        plain = conv.apply(x.contiguous(), rows_padded=False)
        assert rel(first, plain) < 1e-5
        conv.weight.mul_(2)  # an in-place change: a new copy
        assert torch.equal(conv.winograd.channels_last(conv.weight), conv.weight)
        monkeypatch.setattr(winograd, "RULES", ((1, 1, 1),))
        monkeypatch.setattr(winograd, "MIN_COUT", 1)
        monkeypatch.setattr(winograd, "BUILD_PIXELS", 0)
        conv.apply(x, rows_padded=False)  # now by Winograd: the filters replace the copy
        assert conv.winograd.filters is not None and conv.winograd.last_weight is None


def _both_ways(pv, switch: str, counted: str, mode: str, encode_mode: str | None = None, counts=lambda a: True):
    """Encode and decode with ``Exec.<switch>`` on, then off: {on: (latent, video, calls of ``Exec.<counted>``
    whose positional arguments ``counts`` accepts)}."""
    calls, real = [], getattr(Exec, counted)
    setattr(Exec, counted, lambda self, *a, **k: calls.append(bool(counts(a))) or real(self, *a, **k))
    out = {}
    try:
        for on in (True, False):
            setattr(Exec, switch, on)
            calls.clear()
            with use(FAST), torch.no_grad():
                z = pv.encode(_clip(9, 40, 24), mode=encode_mode or mode).posterior.mean
                out[on] = (z, pv.decode(z, mode=mode), sum(calls))
    finally:
        setattr(Exec, counted, real)
        setattr(Exec, switch, True)
    return out


def on_ranks(ctx, switch, counted, mode, encode_mode=None, counts=None):
    torch.set_num_threads(1)
    pv = ParallelVAE(_vae(), Comm(ctx.group), chunk=1)
    return _both_ways(pv, switch, counted, mode, encode_mode, counts or (lambda a: True))


@pytest.mark.parametrize("mode", ["height", "height+chunks"])
def test_height_slabs_join_past_frames_and_halo_rows_in_one_buffer(clusters, mode):
    """Convs no norm feeds (the first conv of each side, the upsamplers' convs) took two copies of the
    activation (frames, then rows); now one, with the same bits."""
    for rank in clusters(2).run(on_ranks, "joins_past_with_halo", "_cat", mode):
        (z, y, n_one), (z_two, y_two, n_two) = rank[True], rank[False]
        assert torch.equal(z, z_two) and torch.equal(y, y_two)
        assert n_two - n_one >= 10, (n_two, n_one)  # encoder and decoder conv_in, and the upsamplers' convs


@pytest.mark.bitwise  # the same bits rest on the elementwise loop's shape: checked under another kernel set too
@pytest.mark.parametrize("mode", ["height", "height+chunks"])
def test_height_slab_norms_write_rows_and_halos_without_a_joined_copy(clusters, mode):
    """Norms that bring their conv's halo rows normalise the slab's and the received rows straight into
    the output, instead of joining them into an extended copy first: the same bits."""
    for world in (2, 3):
        for rank in clusters(world).run(on_ranks, "normalises_rows_in_place", "_normalise_rows", mode):
            (z, y, n), (z_copy, y_copy, n_copy) = rank[True], rank[False]
            assert torch.equal(z, z_copy) and torch.equal(y, y_copy)
            assert n >= 50 and n_copy == 0, (n, n_copy)  # every ResnetBlock norm and the conv_outs' norms


@pytest.mark.parametrize("mode", ["replicated", "chunked"])
def test_upsamplers_write_depth_to_space_behind_the_convs_past_frames(mode):
    """The decoder's upsamplers rearrange into the next conv's input in one copy (frame 0's duplicate left
    out, room for the past frames left in front): the same bits, and the joins it replaces gone."""
    out = _both_ways(ParallelVAE(_vae(), None, chunk=1), "upsamples_in_place", "_cat", mode, "replicated")
    (_, y, n), (_, y_three, n_three) = out[True], out[False]
    assert torch.equal(y, y_three)
    assert n_three - n >= 3, (n_three, n)  # at least each upsampler's causal join once


def test_upsamplers_in_place_on_a_time_split(clusters):
    for rank in clusters(2).run(on_ranks, "upsamples_in_place", "_cat", "time", "replicated"):
        (_, y, n), (_, y_three, n_three) = rank[True], rank[False]
        assert torch.equal(y, y_three) and n_three > n


def _given_a_buffer(args) -> bool:
    return args[-1] is not None  # _halo_joined's ext: the upsampler wrote the slab into it


@pytest.mark.parametrize("mode", ["height", "height+chunks"])
def test_slab_upsamplers_write_into_their_convs_halo_buffer(clusters, mode):
    """On a height slab the upsampler rearranges straight into the buffer its conv reads (room for the past
    frames in front, for the halo rows above and below): same bits as rearranging, then joining."""
    for rank in clusters(2).run(on_ranks, "upsamples_in_place", "_halo_joined", mode, "replicated", _given_a_buffer):
        (_, y, n), (_, y_copies, n_copies) = rank[True], rank[False]
        assert torch.equal(y, y_copies)
        assert n >= 3 and n_copies == 0, (n, n_copies)  # each upsampler's conv, on every piece


def test_row_pattern_repeats_the_scale_along_a_row_channel_innermost():
    from ditsp.models.seedvr2.vae.execution import _row_pattern
    v = torch.randn(1, 4, 3, 5, 1, 1)  # (B, G, Cg, T, 1, 1)
    p = _row_pattern(v, 7)
    assert p.shape == (1, 4, 3, 5, 1, 7) and torch.equal(p, v.expand(1, 4, 3, 5, 1, 7))
    assert p.stride()[2] == 1 and p.stride()[1] == 3 and p.stride()[5] == 12  # channels, then pixels of a row


@pytest.mark.bitwise  # the same bits rest on the elementwise loop's shape: checked under another kernel set too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_scales_repeated_along_rows_give_the_same_bits(clusters, dtype, monkeypatch):
    """A norm's scale and shift laid out channel-innermost along a row (one vectorised loop per row, not one
    per pixel's channels): the same latent and video, on one device and on height slabs."""
    from ditsp.models.seedvr2.vae import execution
    patterns, real = [], execution._row_pattern
    monkeypatch.setattr(execution, "_row_pattern", lambda v, w: patterns.append(w) or real(v, w))
    out = _both_ways(ParallelVAE(_vae(dtype), None, chunk=1), "scales_channels_inner", "_scale_shift", "chunked")
    assert len(patterns) >= 2 * 50  # scale and shift of every norm call, with the switch on
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    assert out[True][2] >= 50
    for rank in clusters(2).run(on_ranks_typed, "scales_channels_inner", "_scale_shift", "height", dtype):
        assert torch.equal(rank[True][0], rank[False][0]) and torch.equal(rank[True][1], rank[False][1])


def on_ranks_typed(ctx, switch, counted, mode, dtype):
    torch.set_num_threads(1)
    return _both_ways(ParallelVAE(_vae(dtype), Comm(ctx.group), chunk=1), switch, counted, mode)
