"""Ranks of unequal capacity on real ranks: they move work, never arithmetic. The DiT under every path that
takes capacities, and `ditsp upscale` at SP 2 and 3 with unequal memory and speed, give one device's bytes
under the deterministic policy; a plan no rank can hold is refused naming the rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditsp.config import ParallelConfig
from ditsp.distributed.comm import Comm
from ditsp.fixed_shape import DETERMINISTIC
from ditsp.fixed_shape import use as use_policy
from ditsp.io.testclip import make_test_clip
from ditsp.models.seedvr2.job.request import Options, check, check_memory
from ditsp.models.seedvr2.job.restore import rank_upscale, summarize
from ditsp.models.seedvr2.nadit import NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.config import TINY
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime
from ditsp.models.seedvr2.vae import TINY as VAE_TINY
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.sharded import ParallelVAE
from ditsp.windows.capacity import GiB, Shares

pytestmark = [pytest.mark.bitwise, pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

VECTORS = Path(__file__).parent / "data" / "nadit-3b-tiny"


def _model():
    model = NaDiT(TINY).eval()
    load_checkpoint(model, VECTORS / "weights.safetensors")
    return model, load_file(VECTORS / "io.safetensors")


@torch.no_grad()
def forward_with_shares(ctx, cases):
    """Every rank's output of the reference vectors' forward for each (path, planner, shares), and the tokens
    this rank held in layer 0."""
    model, d = _model()
    outs = []
    for path, planner, shares in cases:
        pc = ParallelConfig.window(ctx.world_size, window_planner=planner, window_path=path, deterministic=True)
        rt = parallelize(TINY, pc, model.grid_of(d["vid_in"].shape), ctx.group, shares)
        outs.append((model(d["vid_in"], d["txt_in"], d["timestep"], runtime=rt), rt.num_local_rows(0),
                     rt.report()))
    return outs


@torch.no_grad()
def test_the_dit_gives_one_devices_bits_whatever_the_capacities(clusters):
    model, d = _model()
    grid = model.grid_of(d["vid_in"].shape)
    ref = model(d["vid_in"], d["txt_in"], d["timestep"], runtime=single_runtime(TINY, grid, deterministic=True))
    n = grid[0] * grid[1] * grid[2]
    for sp, speeds, caps in ((2, (1.0, 0.4), None), (3, (1.0, 0.3, 0.6), (n // 5, n, n))):
        shares = Shares(speeds, caps)
        cases = [("window", "lpt", shares), ("window", "locality", shares), ("auto", None, Shares(speeds)),
                 ("halo", None, Shares(speeds))]
        results = clusters(sp).run(forward_with_shares, cases)
        for rank, outs in enumerate(results):
            for (path, planner, _), (out, _, report) in zip(cases, outs):
                assert torch.equal(out, ref), (sp, rank, path, planner, report)
        held = [[outs[i][1] for outs in results] for i in range(len(cases))]
        if caps:  # the capped fast rank holds what its cap allows; the rest goes to the others by speed
            assert held[0][0] <= n // 5 and held[1][0] <= n // 5 and sum(held[0]) == n
        else:  # tokens follow speed
            assert all(h[0] > h[1] for h in held), held
        assert "halo-slab" in results[0][3][2] and "by speed" in results[0][3][2]
        assert "by speed" in results[0][0][2] and ("token cap" in results[0][0][2]) == bool(caps)


@use_policy(DETERMINISTIC)
def vae_slabs_by_speed(ctx, speeds, shape):
    """Every rank's (latent rows held, encode and decode equal to one device's) with slabs cut by ``speeds``."""
    torch.set_num_threads(1)
    vae = seeded_vae(VAE_TINY)
    x = torch.rand((1, 3, *shape), generator=torch.Generator().manual_seed(3)) * 2 - 1
    one = ParallelVAE(vae)
    ref = one.encode(x, mode="replicated").posterior.mean
    ref_d = one.decode(ref, mode="replicated")
    pv = ParallelVAE(vae, Comm.of(ctx.group), speeds=speeds)
    out = []
    for mode in ("height", "height+chunks"):
        enc = pv.encode(x, mode=mode, keep_sharded=True)
        _, _, h0, h1 = enc.layout.rank_rows(ctx.rank)
        whole = pv.encode(x, mode=mode).posterior.mean
        mine = pv.decode_slab(ref[:, :, :, h0:h1], enc.layout, chunked=mode == "height+chunks")
        out.append((h1 - h0, torch.equal(whole, ref) and torch.equal(enc.posterior.mean, ref[:, :, :, h0:h1]),
                    torch.equal(mine, ref_d) and torch.equal(pv.decode(ref, mode=mode), ref_d)))
    return out


def test_vae_slabs_follow_speed_and_keep_one_devices_bits(clusters):
    for speeds, rows in (((1.0, 0.5), [5, 3]), ((1.0, 0.2, 0.6), [4, 1, 3])):
        results = clusters(len(speeds)).run(vae_slabs_by_speed, speeds, (5, 64, 48))  # 8 latent rows
        for mode in range(2):
            assert [r[mode][0] for r in results] == rows
            assert all(r[mode][1] and r[mode][2] for r in results), results


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    return str(make_test_clip(str(d / "in.mp4"), width=64, height=48, frames=9, fps=12, audio=False))


def _run(clusters, o: Options, handoff: bool = True):
    req = replace(check(o).req, handoff=handoff)
    if o.sp == 1:
        from ditsp.distributed.launcher import RankContext

        return summarize([rank_upscale(RankContext(0, 1, None, torch.device("cpu")), req)]), req
    return summarize(clusters(o.sp).run(rank_upscale, req)), req


def _options(clip, out, **kw):
    return Options(input=clip, output=str(out), model="tiny-8x", random_weights=True, resolution="128x96",
                   progress=False, overwrite=True, deterministic=True, **kw)


@pytest.mark.parametrize("vae_mode", ["auto", "chunked"])
def test_upscale_with_unequal_capacities_writes_one_devices_bytes(clusters, clip, tmp_path, vae_mode):
    """SP 2 and 3 with unequal memory and speed: the VAE's slabs (auto: height) and the DiT's tokens cut in
    proportion to speed, the frames the same bytes as one device's."""
    one, _ = _run(clusters, _options(clip, tmp_path / "one.mp4", vae_mode=vae_mode))
    for sp, memory, speed in ((2, (8.0, 4.0), None), (3, (8.0, 4.0, 6.0), (1.0, 0.3, 0.6))):
        o = _options(clip, tmp_path / f"sp{sp}.mp4", sp=sp, rank_memory=memory, rank_speed=speed, vae_mode=vae_mode)
        report, req = _run(clusters, o)
        assert report["sha256"] == one["sha256"], (sp, vae_mode)
        assert "by speed" in report["dit_path"], report["dit_path"]  # the ranks' runtime got the shares
        p = req.plan
        assert p.uneven and p.vae_speeds == (speed or (1.0, 0.5)) and p.dit_shares is not None
        assert len(p.rank_memory) == sp and p.capacities.memory == tuple(int(m * GiB) for m in memory)
        if vae_mode == "auto":
            assert p.steps[0].vae_mode == "height" and "every rank" in p.steps[0].vae_reason
        assert "rank 1 (speed" in check_memory(check(o), o)


def test_a_rank_that_cannot_hold_its_share_is_named(clip, tmp_path):
    o = _options(clip, tmp_path / "o.mp4", sp=2, rank_memory=(8.0, 0.001), vae_mode="height")
    with pytest.raises(MemoryError, match=r"^rank 1 needs [\d.]+ GiB of its 0\.00: does not fit") as e:
        check_memory(check(o), o)
    assert "\n" not in str(e.value)
    for bad, match in (({"rank_memory": (8.0,)}, "--rank-memory: 1 value.*--sp 2"),
                       ({"rank_speed": (1.0, float("nan"))}, "--rank-speed: every value must be a finite"),
                       ({"rank_memory": (8.0, 4.0), "max_memory": 4.0}, "not both")):
        with pytest.raises(ValueError, match=match):
            check(_options(clip, tmp_path / "o.mp4", sp=2, **bad))
