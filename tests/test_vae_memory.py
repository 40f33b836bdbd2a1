"""Memory model and the auto mode choice (pure functions: identical on every rank)."""

import pytest
import torch

from ditsp.models.seedvr2.vae import RELEASED, TINY
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.memory import GiB, choose_mode, estimate
from ditsp.models.seedvr2.vae.sharded import ParallelVAE
from ditsp.models.seedvr2.vae.tiled import ramp, tiles

K4 = (81, 2160, 3840)


def test_4k_81_frame_decode_fits_24gb_per_rank_at_sp8():
    est = estimate(RELEASED, "decode", K4, 8, "height+chunks", torch.bfloat16, gather=False)
    assert est.total <= 24 * GiB, est.row()
    # ... while one device's plain pass and the time split alone do not come close.
    assert estimate(RELEASED, "decode", K4, 1, "replicated").total > 200 * GiB
    assert estimate(RELEASED, "decode", K4, 8, "time").total > 24 * GiB


def test_more_ranks_shrink_the_height_slab():
    a = [estimate(RELEASED, "decode", K4, n, "height+chunks", gather=False).total for n in (1, 2, 4, 8)]
    assert a == sorted(a, reverse=True) and a[0] > 3 * a[-1]


def test_auto_takes_the_first_exact_mode_that_fits_in_the_tables_order():
    """One meaning of auto (vae/modes.py): AUTO_ORDER's first exact mode fitting encode and decode."""
    from ditsp.models.seedvr2.vae.modes import AUTO_ORDER, EXACT_MODES

    assert set(AUTO_ORDER) == set(EXACT_MODES) and AUTO_ORDER[0] == "height"
    big = choose_mode(RELEASED, (81, 720, 1280), 4, None)
    assert big.mode == "height" and "no budget" in big.report  # no budget: the first
    tight = choose_mode(RELEASED, (81, 720, 1280), 4, 24 * GiB)
    assert tight.mode == "height+chunks" and "fits 24.00 GiB" in tight.report
    for m in AUTO_ORDER[:AUTO_ORDER.index(tight.mode)]:  # everything before it does not fit
        assert max(estimate(RELEASED, op, (81, 720, 1280), 4, m).total for op in ("encode", "decode")) > 24 * GiB
    with pytest.raises(MemoryError, match="no VAE mode fits"):
        choose_mode(RELEASED, K4, 1, 1 * GiB)


def test_auto_skips_a_time_split_of_one_latent_frame():
    c = choose_mode(RELEASED, (1, 720, 1280), 4, None)
    assert c.mode == "height"
    with pytest.raises(MemoryError) as e:
        choose_mode(RELEASED, (1, 64, 64), 4, 1)
    assert "time" not in str(e.value) and "replicated" in str(e.value)


def test_auto_falls_back_to_tiled_and_says_approximate():
    c = choose_mode(RELEASED, (81, 1072, 1920), 1, 20 * GiB)
    assert c.mode == "tiled" and "APPROXIMATE" in c.report


def test_auto_runs_and_reports_its_mode():
    pv = ParallelVAE(seeded_vae(TINY))
    x = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    enc = pv.encode(x)
    assert enc.mode == "chunked" and "mode chunked (SP=1, auto: the first exact mode that fits" in enc.report


def test_one_device_auto_never_takes_a_mode_that_splits_across_ranks():
    """One device: a height slab or a time split is the whole clip through the split machinery, so auto
    takes the leanest whole-frame mode; two ranks still take the height slabs first."""
    from ditsp.models.seedvr2.vae.modes import BY_NAME

    for shape in ((17, 256, 256), (81, 720, 1280), (1, 720, 1280)):
        one = choose_mode(RELEASED, shape, 1, None)
        assert one.mode == "chunked" and not BY_NAME[one.mode].splits
        assert choose_mode(RELEASED, shape, 2, None).mode == "height"
    lean = estimate(RELEASED, "decode", (81, 720, 1280), 1, "chunked").total
    assert lean < estimate(RELEASED, "decode", (81, 720, 1280), 1, "replicated").total
    assert lean < estimate(RELEASED, "decode", (81, 720, 1280), 1, "height").total


def test_tiles_and_ramp():
    assert tiles(10, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    assert tiles(7, 4, 1) == [(0, 4), (3, 7)]
    w = ramp(6, 2, 2)
    assert w[2] == w[3] == 1 and 0 < w[0] < w[1] < 1 and torch.allclose(w, w.flip(0))


def test_tiled_is_approximate_but_close_with_a_wide_overlap():
    vae = seeded_vae(TINY)
    x = torch.rand(1, 3, 1, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    exact = ParallelVAE(vae).encode(x, mode="replicated").posterior.mean
    tiled = ParallelVAE(vae, tile=6, overlap=4).encode(x, mode="tiled").posterior.mean
    err = ((tiled - exact).abs().max() / exact.abs().max()).item()
    assert 1e-4 < err < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_winograd_filters_are_the_caches_an_encode_and_decode_build(monkeypatch, dtype):
    """The estimate's Winograd filters and channels-last weight copies (CPU, fast policy) are the bytes the convs'
    caches hold after a restoration."""
    from ditsp.fixed_shape import FAST, use
    from ditsp.models.seedvr2.vae import winograd

    if winograd._op is None:
        pytest.skip("no oneDNN linear in this build")
    monkeypatch.setattr(winograd, "BUILD_PIXELS", 0)  # every qualifying conv builds on its first call
    monkeypatch.setattr(winograd, "BUILD_PIXELS_BF16", 0)
    monkeypatch.delenv(winograd.ENV, raising=False)
    cfg = RELEASED.with_widths((64, 128, 256, 256))
    vae = seeded_vae(cfg).to(dtype)
    shape = (5, 32, 48)
    x = (torch.rand(1, 3, *shape, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dtype)
    pv = ParallelVAE(vae, None)
    with use(FAST), torch.no_grad():
        pv.decode(pv.encode(x, mode="chunked").posterior.mean, mode="chunked")
    caches = [(m, m.winograd) for m in vae.modules() if isinstance(getattr(m, "winograd", None), winograd.WeightCache)]
    filters = sum(winograd.filter_bytes(m.weight.shape[1], m.weight.shape[0]) for m, c in caches if c.filters is not None)
    # every other conv ran direct on channels-last input and keeps that copy of its weight (a 1x1x1 weight is
    # already in both layouts: no copy)
    copies = sum(c.last_weight.nbytes for m, c in caches
                 if c.last_weight is not None and c.last_weight.data_ptr() != m.weight.data_ptr())
    assert filters > 0 and copies > 0
    built = filters + copies
    for op in ("encode", "decode"):
        est = estimate(cfg, op, shape, 1, "chunked", dtype, backend="cpu", winograd_filters=True)
        assert est.filters == built
        assert est.total == estimate(cfg, op, shape, 1, "chunked", dtype, backend="cpu").total + built
    assert "cached conv filters" in est.row()


def test_winograd_filters_counted_only_where_they_are_built(monkeypatch):
    from ditsp.models.seedvr2.job.budget import estimate as job_estimate, suggestions
    from ditsp.models.seedvr2.vae import winograd
    from ditsp.models.seedvr2.vae.memory import counts_winograd

    monkeypatch.delenv(winograd.ENV, raising=False)
    assert counts_winograd("cpu", deterministic=False)
    assert not counts_winograd("cpu", deterministic=True) and not counts_winograd("cuda", deterministic=False)
    monkeypatch.setattr(winograd, "enabled", lambda: False)
    assert not counts_winograd("cpu", deterministic=False)
    plain = job_estimate("seedvr2-3b", "fp32", 17, (256, 256), 1, "chunked")
    with_filters = job_estimate("seedvr2-3b", "fp32", 17, (256, 256), 1, "chunked", winograd_filters=True)
    assert with_filters.vae_filters > GiB and with_filters.total == plain.total + with_filters.vae_filters
    assert "cached conv filters" in with_filters.describe() and "cached conv" not in plain.describe()
    budget = (plain.total + with_filters.total) // 2  # fits without the filters only
    fits = suggestions("seedvr2-3b", "fp32", 17, (256, 256), 1, "chunked", budget, 17, winograd_filters=True)
    assert any(f.startswith(f"{winograd.ENV}=0") for f in fits)


def test_the_backend_says_whether_convs_reorder_through_a_buffer(monkeypatch):
    """Channels-last CPU runs (the fast policy) write the conv outputs in place, as CUDA is modelled; only the
    contiguous layout on CPU (the deterministic policy) reorders each output through a buffer of its size."""
    from ditsp.models.seedvr2.vae import channels_last
    from ditsp.models.seedvr2.vae.memory import backend_of

    shape = (5, 64, 64)
    e = {b: estimate(TINY, "decode", shape, 1, "chunked", backend=b) for b in ("cuda", "cpu", "cpu-deterministic")}
    assert e["cuda"].total == e["cpu"].total < e["cpu-deterministic"].total
    with pytest.raises(ValueError, match="backend must be one of"):
        estimate(TINY, "decode", shape, 1, "chunked", backend="gpu")
    assert (backend_of("cpu", False), backend_of("cpu", True), backend_of("cuda", False)) == ("cpu", "cpu-deterministic", "cuda")
    monkeypatch.setattr(channels_last, "enabled", lambda: False)
    assert backend_of("cpu", False) == "cpu-deterministic"


def test_the_pre_flight_estimate_counts_the_deterministic_cpu_convs_copies():
    from ditsp.models.seedvr2.job.budget import estimate as job_estimate

    args = ("seedvr2-3b", "bf16", 17, (256, 256), 2, "height")
    plain, fixed_shape = job_estimate(*args), job_estimate(*args, vae_backend="cpu-deterministic")
    assert fixed_shape.vae > plain.vae and fixed_shape.total - plain.total == fixed_shape.vae - plain.vae
