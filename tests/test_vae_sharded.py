"""Every sharded VAE mode on real gloo ranks is bitwise one device (``torch.equal``), fp32 and bf16.

One device (``replicated``) is computed on the same rank with the same thread count; the shapes
cover latent rows and frames that do not split evenly, heights not divisible by 8, images, clips
of 5/9/17 frames and ranks left empty. The reference vectors are checked once through SP.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditsp.distributed.agree import DisagreementError
from ditsp.distributed.comm import Comm
from ditsp.distributed.halo import exchange_rows
from ditsp.fixed_shape import DETERMINISTIC
from ditsp.fixed_shape import use as use_policy
from ditsp.models.seedvr2.vae import TINY
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.sharded import ParallelVAE, SlabLayout, TimeLayout, even_split

pytestmark = pytest.mark.timeout(420)
DATA = Path(__file__).parent / "data" / "vae-tiny"
REL = 1e-5
EXACT = ["time", "height", "height+chunks"]


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def clip(T, H, W, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, T, H, W, generator=g) * 2 - 1


# ----------------------------------------------------------------- rank-side


def vectors_all_modes(ctx):
    torch.set_num_threads(1)
    vae, io = seeded_vae(TINY), load_file(DATA / "io.safetensors")
    pv = ParallelVAE(vae, Comm(ctx.group))
    out = {}
    for mode in EXACT:
        enc = pv.encode(io["video"], mode=mode)
        dec = pv.decode(io["posterior_mean"], mode=mode)
        out[mode] = (rel_err(enc.posterior.mean, io["posterior_mean"]), rel_err(enc.posterior.logvar, io["posterior_logvar"]),
                     rel_err(dec, io["decoded_from_mean"]), enc.report)
    return out


@use_policy(DETERMINISTIC)
def bitwise_cases(ctx, cases):
    """For each (dtype, T, H, W): is every sharded mode's encode and decode torch.equal to one device's?"""
    torch.set_num_threads(1)
    vaes = {}
    pv_one, out = {}, []
    for dtype, T, H, W in cases:
        if dtype not in vaes:
            vaes[dtype] = seeded_vae(TINY).to(dtype)
            pv_one[dtype] = (ParallelVAE(vaes[dtype], Comm(ctx.group)), ParallelVAE(vaes[dtype]))
        pv, one = pv_one[dtype]
        x = clip(T, H, W).to(dtype)
        ref = one.encode(x, mode="replicated").posterior
        ref_d = one.decode(ref.mean, mode="replicated")
        for mode in EXACT:
            enc = pv.encode(x, mode=mode).posterior
            out.append((str(dtype), T, H, W, mode, torch.equal(enc.mean, ref.mean) and torch.equal(enc.logvar, ref.logvar),
                        torch.equal(pv.decode(ref.mean, mode=mode), ref_d)))
        out.append((str(dtype), T, H, W, "chunked", torch.equal(one.encode(x, mode="chunked").posterior.mean, ref.mean),
                    torch.equal(one.decode(ref.mean, mode="chunked"), ref_d)))
    return out


@use_policy(DETERMINISTIC)
def slab_handoff(ctx):
    """Encode left sharded by latent rows, then decode from the slabs; same as the full path."""
    torch.set_num_threads(1)
    vae = seeded_vae(TINY)
    pv = ParallelVAE(vae, Comm(ctx.group))
    x = clip(5, 40, 24, seed=7)
    noise = torch.randn(1, 16, 2, 5, 3, generator=torch.Generator().manual_seed(1))
    full, _ = ParallelVAE(vae).encode_latent(x, mode="replicated", noise=noise)
    slab, enc = pv.encode_latent(x, mode="height", noise=noise, keep_sharded=True)
    t0, t1, h0, h1 = enc.layout.rank_rows(ctx.rank)
    slab_err = rel_err(slab, full[:, :, t0:t1, h0:h1]) if h1 > h0 else 0.0
    ref = ParallelVAE(vae).decode(vae.from_latent(full), mode="replicated")
    mine = pv.decode_slab(vae.from_latent(slab), enc.layout, gather=False)
    whole = pv.decode_slab(vae.from_latent(slab), enc.layout, gather=True)
    rows = (8 * h0, 8 * h1)
    return (slab.shape[3], h1 - h0, slab_err, rel_err(mine, ref[:, :, :, rows[0]:rows[1]]) if h1 > h0 else 0.0,
            tuple(mine.shape), rel_err(whole, ref))


def mismatched_modes(ctx):
    pv = ParallelVAE(seeded_vae(TINY), Comm(ctx.group))
    try:
        pv.encode(clip(5, 16, 16), mode="height" if ctx.rank == 0 else "time")
    except DisagreementError as e:
        return str(e)
    return None


def halo_rows(ctx):
    """Both carriages (point-to-point, all-gather of slots) give the same halos."""
    comm = Comm(ctx.group)
    r, n = ctx.rank, ctx.world_size
    x = torch.arange(3 * (r + 1), dtype=torch.float32).view(-1, 1) + 100 * r  # ranks hold 3, 6, 9... rows
    out = []
    for gather in (False, True):
        top, bot = exchange_rows(comm, x, 0, from_prev=1 if r else 0, from_next=2 if r < n - 1 else 0,
                                 to_prev=2 if r else 0, to_next=1 if r < n - 1 else 0, slot=3, gather=gather)
        out.append((None if top is None else top.flatten().tolist(), None if bot is None else bot.flatten().tolist()))
    assert out[0] == out[1], out
    return out[0]


# ----------------------------------------------------------------- tests


def test_layouts():
    assert even_split(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert even_split(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    lay = SlabLayout(3, 6, 10, 52, 80, 4)  # 52 rows: the last slab takes the 4 rows past 48
    assert lay.rows == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert lay.pixel_rows() == [(0, 16), (16, 32), (32, 40), (40, 52)]
    assert lay.rank_rows(1) == (0, 3, 2, 4)
    tl = TimeLayout(5, 2)
    assert tl.latents == [(0, 3), (3, 5)] and tl.frames(0, 3) == (0, 9) and tl.frames(3, 5) == (9, 17)


def test_every_mode_reproduces_reference(clusters):
    results = clusters(3).run(vectors_all_modes)
    for rank, res in enumerate(results):
        for mode, (e_mean, e_logvar, e_dec, report) in res.items():
            assert max(e_mean, e_logvar, e_dec) <= REL, (rank, mode, e_mean, e_logvar, e_dec)
            assert f"mode {mode} (SP=3" in report


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.bitwise
@pytest.mark.parametrize("world,cases", [
    # 3 latent rows over 2 ranks, a clip longer than a chunk; a 5-frame clip with latent frame 0 alone on rank 0
    (2, [(F32, 17, 24, 16), (BF16, 5, 40, 24), (F32, 5, 40, 24)]),
    # 5 latent rows over 3; an image with fewer latent rows (2) than ranks; 9 frames: one latent frame per rank
    (3, [(F32, 5, 44, 24), (F32, 1, 16, 16), (BF16, 9, 52, 16), (BF16, 1, 16, 16)]),
    # 52 rows (4 past the last latent row); 1 latent row and 2 latent frames: empty ranks in both splits
    (4, [(F32, 9, 52, 16), (F32, 5, 8, 24), (BF16, 17, 24, 16)]),
])
def test_sharded_modes_are_bitwise_one_device(clusters, world, cases):
    # bf16 convolutions without oneDNN's bf16 path (CPUs without AVX-512) take F.conv3d's slower kernels
    for rank, rows in enumerate(clusters(world).run(bitwise_cases, cases, timeout_s=200)):
        bad = [r for r in rows if not (r[5] and r[6])]
        assert not bad, (rank, bad)


@pytest.mark.bitwise
def test_encoder_output_left_sharded_and_decoded_from_slabs(clusters):
    results = clusters(3).run(slab_handoff)
    for rank, (held, owned, slab_err, dec_err, shape, whole_err) in enumerate(results):
        assert held == owned
        assert slab_err == 0.0 and dec_err == 0.0 and whole_err == 0.0  # bitwise: the slabs are the one-device rows
        assert shape[3] == 8 * owned


def test_mismatched_modes_raise_on_every_rank(clusters):
    msgs = clusters(2).run(mismatched_modes)
    assert all(m is not None and "ranks disagree on vae.encode request" in m for m in msgs)


def test_halo_exchange_rows(clusters):
    res = clusters(3).run(halo_rows)
    assert res[0] == (None, [100.0, 101.0])
    assert res[1] == ([2.0], [200.0, 201.0])
    assert res[2] == ([105.0], None)
