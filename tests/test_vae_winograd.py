"""Winograd F(4x4, 3x3) for the VAE's 3x3x3 convs (ditsp/models/seedvr2/vae/winograd.py): its error against
float64, when it runs (fast policy, float32 CPU inference, wide convs, the switch) and when it must not
(deterministic policy, bf16, autograd), its filter cache, and a whole VAE with it against without it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from ditsp.cpu import settings as cpu_settings
from ditsp.distributed.comm import Comm
from ditsp.fixed_shape import DETERMINISTIC, FAST, use
from ditsp.models.seedvr2.vae import TINY, winograd
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.layers import CausalConv3d, conv3d
from ditsp.models.seedvr2.vae.sharded import ParallelVAE

pytestmark = pytest.mark.skipif(not winograd.enabled() or winograd._op is None,
                                reason="no oneDNN linear in this build, or Winograd switched off")

# Max error relative to the reference's max |value|. The direct float32 conv measures 3e-7..5e-7; Winograd
# F(4x4, 3x3) 4e-6..1.3e-5 (128..512 input channels): its transforms multiply values by up to 5 (B^T) and 8
# (A^T) and sum 36 of them, so the float32 rounding of each GEMM sum reaches the output ~20x amplified. The
# bound leaves 4x over the widest measured case and still tells a wrong tile, tap or padding (errors ~1).
WINO_REL = 5e-5
DIRECT_REL = 2e-6
# A whole VAE (encode then decode, ~40 convs with GroupNorms between): at the released widths Winograd vs
# direct measured 6e-6 (latent) and 2.4e-5 (decoded); this small one 1e-6..1e-5.
VAE_REL = 2e-4


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def case(cin, cout, t_in, h, w, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cin, t_in, h, w, generator=g)
    weight = torch.randn(cout, cin, 3, 3, 3, generator=g) / (27 * cin) ** 0.5
    bias = torch.randn(cout, generator=g)
    return x, weight, bias


@pytest.fixture
def everywhere(monkeypatch):
    """Winograd for every 3x3x3 conv, however narrow (the thresholds are a speed choice, not a correctness one)."""
    monkeypatch.setattr(winograd, "RULES", ((1, 1, 1),))
    monkeypatch.setattr(winograd, "MIN_COUT", 1)
    monkeypatch.setattr(winograd, "BUILD_PIXELS", 0)  # transform on the first call, however small
    monkeypatch.setattr(winograd, "BUILD_PIXELS_BF16", 0)


@pytest.fixture
def calls(monkeypatch):
    """Counts the Winograd convs that run."""
    n = []
    real = winograd.conv3d

    def spy(*args, **kwargs):
        n.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(winograd, "conv3d", spy)
    return n


# (C_in, C_out, T_in, H, W, row padding, column padding, batch): H and W not multiples of 4, T_in 3..7,
# C_in != C_out, unpadded and padded sides, a 4x4 image (one tile) and one of 3x2 (one padded tile).
CASES = [
    (48, 40, 5, 13, 10, 1, 1, 1),
    (40, 56, 3, 7, 9, 0, 1, 1),
    (64, 32, 7, 6, 5, 1, 0, 1),
    (32, 48, 4, 9, 17, 1, 1, 2),
    (24, 16, 6, 4, 4, 1, 1, 1),
    (16, 24, 3, 5, 4, 0, 0, 1),
    (256, 136, 4, 11, 9, 1, 1, 1),
]


@pytest.mark.parametrize("cin,cout,t_in,h,w,ph,pw,batch", CASES)
def test_matches_float64_within_bound(cin, cout, t_in, h, w, ph, pw, batch):
    x, weight, bias = case(cin, cout, t_in, h, w, batch)
    ref = F.conv3d(x.double(), weight.double(), bias.double(), padding=(0, ph, pw))
    direct = F.conv3d(x, weight, bias, padding=(0, ph, pw))
    out = winograd.conv3d(x, weight, bias, (0, ph, pw))
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel(direct, ref) < DIRECT_REL
    assert rel(out, ref) < WINO_REL, (rel(out, ref), rel(direct, ref))
    # bands of one tile row each (the split a big activation gets) stay within the same bound
    bands = winograd.conv3d(x, weight, bias, (0, ph, pw), band_bytes=1)
    assert rel(bands, ref) < WINO_REL
    # no bias
    assert rel(winograd.conv3d(x, weight, None, (0, ph, pw)), F.conv3d(x.double(), weight.double(), None,
                                                                       padding=(0, ph, pw))) < WINO_REL


def test_exact_fit_and_non_contiguous_inputs():
    """No padding at all (10 = 4 x 2 + 2: the tiles cover the input exactly), channels-last and strided inputs."""
    x, weight, bias = case(16, 8, 4, 10, 10)
    ref = F.conv3d(x.double(), weight.double(), bias.double())
    assert rel(winograd.conv3d(x, weight, bias, (0, 0, 0)), ref) < WINO_REL
    assert rel(winograd.conv3d(x, weight, bias, (0, 0, 0), band_bytes=1), ref) < WINO_REL
    ref = F.conv3d(x.double(), weight.double(), bias.double(), padding=(0, 1, 1))
    cl = x.contiguous(memory_format=torch.channels_last_3d)
    assert rel(winograd.conv3d(cl, weight, bias, (0, 1, 1)), ref) < WINO_REL
    wide = torch.stack([x, -x], -1).flatten(-2)[..., ::2]  # every other column of a wider tensor: x, strided
    assert not wide.is_contiguous()
    assert rel(winograd.conv3d(wide, weight, bias, (0, 1, 1)), ref) < WINO_REL


def test_weight_transform_matches_its_definition():
    g = torch.tensor(winograd._G, dtype=torch.float64)
    _, weight, _ = case(24, 40, 3, 4, 4)
    ref = torch.einsum("ai,octij,bj->abtoc", g, weight.double(), g).reshape(36, 3, 40, 24)
    assert rel(winograd.transform_weight(weight), ref) < 1e-6


def test_fast_policy_takes_winograd_deterministic_does_not(everywhere, calls):
    conv = CausalConv3d(32, 24)
    x = torch.randn(1, 32, 5, 9, 11)
    with torch.no_grad():
        with use(DETERMINISTIC):
            det = conv.apply(x)
        assert not calls
        # the deterministic policy's result is its fixed-shape direct conv (the call without a cache), bit for bit
        with use(DETERMINISTIC):
            assert torch.equal(det, conv3d(x, conv.weight, conv.bias, padding=(0, 1, 1)))
        with use(FAST):
            fast = conv.apply(x)
        assert len(calls) == 1
    assert rel(fast, F.conv3d(F.pad(x, (1, 1, 1, 1)).double(), conv.weight.double(), conv.bias.double())) < WINO_REL


def test_bf16_autograd_and_other_kernels_stay_direct(everywhere, calls):
    conv = CausalConv3d(32, 24)
    x = torch.randn(1, 32, 4, 8, 8)
    with use(FAST):
        with torch.no_grad():
            copy.deepcopy(conv).bfloat16().apply(x.bfloat16())  # a bf16 conv this narrow: offered its cache, not taken
            conv.apply(x, weight=conv.weight.sum(2, keepdim=True))  # the image fast path's (1, 3, 3) kernel
            conv3d(x, conv.weight, conv.bias, padding=(0, 1, 1))  # a call without the conv's cache
            CausalConv3d(32, 24, stride=(1, 2, 2), pad="down").apply(x)  # strided
        assert not calls
        y = conv.apply(x)  # autograd on: the weight needs a gradient
        assert not calls and y.requires_grad
        y.sum().backward()
        assert conv.weight.grad is not None
        with torch.no_grad():
            conv.apply(x)
        assert len(calls) == 1
        with torch.inference_mode():
            CausalConv3d(32, 24).apply(x)  # weights made in inference mode: no version counter to key a cache on
        assert len(calls) == 1


def test_thresholds_pick_wide_convs():
    def applies(cin, cout, t_out, size):
        x = torch.empty(1, cin, t_out + 2, size, size)
        w = torch.empty(cout, cin, 3, 3, 3)
        with torch.no_grad():
            return winograd.applies(x, w, None, (1, 1, 1), (0, 1, 1))

    # GEMM rows = output frames x 4x4 tiles: 48 are enough at 256+ channels, 8 or 16 stream 4x the filter
    # bytes of a direct conv for too little work
    assert applies(512, 512, 3, 16) and not applies(512, 512, 2, 8)
    assert applies(256, 256, 3, 16) and not applies(256, 256, 1, 16)
    assert applies(128, 128, 5, 64) and not applies(128, 128, 1, 64) and not applies(128, 128, 5, 16)
    assert not applies(64, 64, 5, 64)  # too narrow
    assert not applies(128, 3, 5, 64)  # a conv_out: nothing to save in its GEMMs


def test_thresholds_bf16_only_the_widest():
    """bf16 convs: oneDNN's direct bf16 conv runs ~2x its float32 one, so only wide in and out pays off."""
    def applies(cin, cout, t_out, size, dtype=torch.bfloat16):
        x = torch.empty(1, cin, t_out + 2, size, size, dtype=dtype)
        with torch.no_grad():
            return winograd.applies(x, torch.empty(cout, cin, 3, 3, 3, dtype=dtype), None, (1, 1, 1), (0, 1, 1))

    assert applies(512, 512, 3, 16) and applies(256, 256, 5, 32)
    assert not applies(256, 128, 5, 64) and not applies(128, 128, 5, 64)  # narrow out or in: direct bf16 is faster
    assert applies(128, 128, 5, 64, torch.float32)
    assert not applies(512, 512, 3, 16, torch.float16)  # no rules for other dtypes
    x = torch.empty(1, 512, 5, 16, 16, dtype=torch.bfloat16)
    assert not winograd.applies(x, torch.empty(512, 512, 3, 3, 3), None, (1, 1, 1), (0, 1, 1))  # mixed dtypes


def test_bf16_conv_is_computed_in_float32(monkeypatch):
    """A bf16 conv by Winograd rounds once, at the end: as close to the exact result as the direct bf16 conv."""
    monkeypatch.setattr(winograd, "RULES_BF16", ((1, 1, 1),))
    monkeypatch.setattr(winograd, "MIN_COUT_BF16", 1)
    x, weight, bias = (t.bfloat16() for t in case(40, 24, 5, 13, 10))
    assert winograd.applies(x, weight, bias, (1, 1, 1), (0, 1, 1))
    wino = winograd.conv3d(x, weight, bias, (0, 1, 1))
    direct = F.conv3d(x, weight, bias, padding=(0, 1, 1))
    ref = F.conv3d(x.double(), weight.double(), bias.double(), padding=(0, 1, 1))
    assert wino.dtype == torch.bfloat16 and wino.shape == ref.shape
    assert rel(wino, ref) <= 2 ** -8 and rel(direct, ref) <= 2 ** -8  # one bf16 rounding, relative to the max
    rounded = ref.to(torch.bfloat16)  # the exact result, rounded once
    assert (wino != rounded).double().mean() < 0.02  # float32 Winograd's ~1e-5 flips only near-ties
    assert (wino != rounded).double().mean() <= 2 * (direct != rounded).double().mean() + 0.005


def test_the_switch(everywhere, calls):
    conv = CausalConv3d(16, 16)
    x = torch.randn(1, 16, 3, 8, 8)
    with use(FAST), torch.no_grad():
        with cpu_settings.use(vae_winograd=False):
            off = conv.apply(x)
        assert not calls
        with cpu_settings.use(vae_winograd=True):
            on = conv.apply(x)
        assert len(calls) == 1
    assert rel(on, off.double()) < WINO_REL


def test_filter_cache_follows_the_weight(everywhere):
    conv = CausalConv3d(16, 24)
    x = torch.randn(1, 16, 4, 8, 8)

    def ref():
        return F.conv3d(F.pad(x, (1, 1, 1, 1)).double(), conv.weight.double(), conv.bias.double())

    with use(FAST), torch.no_grad():
        y = conv.apply(x)
        filters = conv.winograd.filters
        assert filters is not None
        conv.apply(x)
        assert conv.winograd.filters is filters  # same weight: reused
        conv.weight.mul_(-2)  # in place: the version counter moves
        y2 = conv.apply(x)
        assert conv.winograd.filters is not filters
        assert rel(y2, ref()) < WINO_REL and rel(y, ref()) > 0.5
        filters = conv.winograd.filters
        conv.weight = torch.nn.Parameter(torch.randn_like(conv.weight))  # a new tensor
        assert rel(conv.apply(x), ref()) < WINO_REL and conv.winograd.filters is not filters
        conv.load_state_dict({k: v * 3 for k, v in conv.state_dict().items()})  # a checkpoint load copies in place
        assert rel(conv.apply(x), ref()) < WINO_REL
    # a copy of the module starts with an empty cache (and never shares the original's filters)
    for other in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
        assert other.winograd.filters is None
        with use(FAST), torch.no_grad():
            assert rel(other.apply(x), ref()) < WINO_REL


def test_small_convs_run_direct_until_their_calls_pay_for_the_transform(everywhere, calls, monkeypatch):
    """The filters are built once a weight's calls reach BUILD_PIXELS output pixels; direct before that."""
    monkeypatch.setattr(winograd, "BUILD_PIXELS", 3 * 3 * 8 * 8)
    conv = CausalConv3d(16, 16)
    small, big = torch.randn(1, 16, 5, 8, 8), torch.randn(1, 16, 11, 8, 8)  # 3 and 9 frames of 8x8 out
    with use(FAST), torch.no_grad():
        first = conv.apply(small)
        conv.apply(small)
        assert not calls and conv.winograd.filters is None
        third = conv.apply(small)  # 3 x 192 pixels: built now
        assert len(calls) == 1 and conv.winograd.filters is not None
        conv.apply(small)
        assert len(calls) == 2
        conv.weight.mul_(0.5)  # new filters: the count starts over
        conv.apply(small)
        assert len(calls) == 2
        CausalConv3d(16, 16).apply(big)  # big enough on its first call
        assert len(calls) == 3
    assert rel(third, first.double()) < WINO_REL


def test_whole_vae_with_and_without_winograd(everywhere, calls):
    """Encode then decode a clip of a small VAE whose every 3x3x3 conv takes Winograd, against direct convs."""
    vae = seeded_vae(TINY.with_widths((32, 64, 64, 64), groups=8))
    pv = ParallelVAE(vae, None)
    x = torch.rand(1, 3, 5, 40, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    out = {}
    for flag in ("0", "1"):
        with cpu_settings.use(vae_winograd=flag == "1"), use(FAST), torch.no_grad():
            z = pv.encode(x).posterior.mean
            out[flag] = (z, pv.decode(z))
    assert len(calls) > 20  # every 3x3x3 stride-1 conv of encode and decode
    for a, b in zip(out["1"], out["0"]):
        assert a.shape == b.shape
        assert 0 < rel(a, b.double()) < VAE_REL


def _small_vae():
    return seeded_vae(TINY.with_widths((32, 64, 64, 64), groups=8))


def _clip():
    return torch.rand(1, 3, 5, 40, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1


def height_slabs_with_winograd(ctx):
    """A rank: the small VAE in height slabs, fast policy, Winograd for every 3x3x3 conv (each slab's own tiles)."""
    torch.set_num_threads(1)
    saved = winograd.RULES, winograd.MIN_COUT, winograd.BUILD_PIXELS
    winograd.RULES, winograd.MIN_COUT, winograd.BUILD_PIXELS = ((1, 1, 1),), 1, 0
    try:
        pv = ParallelVAE(_small_vae(), Comm(ctx.group))
        with cpu_settings.use(vae_winograd=True), use(FAST), torch.no_grad():
            z = pv.encode(_clip(), mode="height").posterior.mean
            return z, pv.decode(z, mode="height")
    finally:  # pool ranks outlive the test
        winograd.RULES, winograd.MIN_COUT, winograd.BUILD_PIXELS = saved


def test_height_slabs_with_winograd_match_one_device_direct(clusters):
    """SP=2 height slabs tile each slab from its own first row: within the whole-VAE tolerance of one device."""
    pv = ParallelVAE(_small_vae(), None)
    with cpu_settings.use(vae_winograd=False), use(FAST), torch.no_grad():
        z = pv.encode(_clip(), mode="replicated").posterior.mean
        ref = (z, pv.decode(z, mode="replicated"))
    z2, dec2 = clusters(2).run(height_slabs_with_winograd)[0]
    assert 0 < rel(z2, ref[0].double()) < VAE_REL
    assert 0 < rel(dec2, ref[1].double()) < VAE_REL


def test_bf16_filters_wait_for_their_own_break_even(everywhere, calls, monkeypatch):
    """A bf16 conv saves less per pixel against oneDNN's faster direct bf16 conv: its build waits for
    BUILD_PIXELS_BF16, not the float32 count."""
    monkeypatch.setattr(winograd, "RULES_BF16", ((1, 1, 1),))
    monkeypatch.setattr(winograd, "MIN_COUT_BF16", 1)
    monkeypatch.setattr(winograd, "BUILD_PIXELS", 3 * 8 * 8)
    monkeypatch.setattr(winograd, "BUILD_PIXELS_BF16", 3 * 3 * 8 * 8)
    conv = CausalConv3d(16, 16).bfloat16()
    small = torch.randn(1, 16, 5, 8, 8).bfloat16()  # 3 frames of 8x8 out: the float32 count in one call
    with use(FAST), torch.no_grad():
        conv.apply(small)
        conv.apply(small)
        assert not calls and conv.winograd.filters is None
        conv.apply(small)
        assert len(calls) == 1 and conv.winograd.filters is not None
