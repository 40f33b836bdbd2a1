"""The latent stitch (pipeline/latent_stitch.py) and the VAE's continued decode it runs on (vae/sharded.py)."""

from __future__ import annotations

import pytest
import torch

from ditsp.distributed.comm import Comm
from ditsp.fixed_shape import DETERMINISTIC
from ditsp.fixed_shape import use as use_policy
from ditsp.models.seedvr2.pipeline.latent_stitch import LatentStitch, pixel_range
from ditsp.models.seedvr2.pipeline.padding import padded_length
from ditsp.models.seedvr2.pipeline.windows import plan_windows
from ditsp.models.seedvr2.vae import TINY
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.sharded import ParallelVAE, SlabLayout

pytestmark = pytest.mark.timeout(300)


def timeline(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 2, frames, 3, 4, generator=torch.Generator().manual_seed(seed))


def window_latents(plan, k: int, truth: torch.Tensor) -> list[torch.Tensor]:
    """Each window's latent as the clip's own timeline would give it; a window's first latent frame (k > 1: it
    encodes one pixel frame alone) is junk for every window but the first, which the stitch must leave out."""
    out = []
    for w in plan:
        t = (padded_length(w.length, k) - 1) // k + 1
        z = truth[:, :, w.start // k: w.start // k + t].clone()
        if k > 1 and w.index > 0:
            z[:, :, 0] = 1e6
        out.append(z)
    return out


def passthrough(latents, start, carry, last):
    """A decode that returns its latents and counts the frames it saw (the carry)."""
    assert (carry is None) == (start == 0) and (carry or 0) == start
    return latents.clone(), start + latents.shape[2]


@pytest.mark.parametrize("k, frames, window, overlap", [(1, 30, 9, 4), (1, 9, 9, 4), (4, 41, 17, 5), (4, 43, 9, 4),
                                                        (2, 20, 7, 0)])
def test_windows_from_one_timeline_stitch_back_to_it(k, frames, window, overlap):
    plan = plan_windows(frames, window, overlap, temporal_factor=k, stitch="latent")
    stitch = LatentStitch(plan, k)
    truth = timeline(stitch.frames)
    parts, firsts = [], []
    for w, z in zip(plan, window_latents(plan, k, truth)):
        got, first = stitch.window(w.index, z, passthrough)
        assert got is not None and got.shape[2] > 0
        parts.append(got)
        firsts.append(first)
    assert stitch.done and stitch.carry == stitch.frames
    assert torch.allclose(torch.cat(parts, 2), truth, atol=1e-6)  # the weights of every frame sum to one
    emitted = [0] + [p.shape[2] for p in parts]
    assert firsts == [pixel_range(0, sum(emitted[:i + 1]), k)[1] if i else 0 for i in range(len(parts))]
    assert pixel_range(0, stitch.frames, k)[1] >= frames  # the decoded timeline covers the clip


def test_shared_latent_frames_are_blended_not_switched():
    plan = plan_windows(14, 9, 4, temporal_factor=1, stitch="latent")  # windows [0, 9) and [5, 14)
    stitch = LatentStitch(plan, 1)
    a, b = torch.zeros(1, 1, 9, 1, 1), torch.ones(1, 1, 9, 1, 1)
    first, _ = stitch.window(0, a, passthrough)
    second, _ = stitch.window(1, b, passthrough)
    out = torch.cat([first, second], 2).flatten()
    assert out[:5].eq(0).all() and out[9:].eq(1).all()
    shared = out[5:9]
    assert (shared > 0).all() and (shared < 1).all() and (shared.diff() > 0).all()


def test_a_window_whose_decode_failed_can_run_again():
    plan = plan_windows(30, 9, 4, temporal_factor=1, stitch="latent")
    truth = timeline(30, seed=3)
    zs = window_latents(plan, 1, truth)

    def run(fail_at):
        stitch, parts, failed = LatentStitch(plan, 1), [], False
        for w, z in zip(plan, zs):
            if w.index == fail_at and not failed:
                failed = True

                def boom(latents, start, carry, last):
                    raise MemoryError("out of memory")
                with pytest.raises(MemoryError):
                    stitch.window(w.index, z, boom)
            parts.append(stitch.window(w.index, z, passthrough)[0])
        return torch.cat(parts, 2)

    assert torch.equal(run(None), run(2))


def test_refusals():
    plan = plan_windows(30, 9, 4, temporal_factor=1, stitch="latent")
    stitch = LatentStitch(plan, 1)
    with pytest.raises(ValueError, match="in order"):
        stitch.window(1, torch.zeros(1, 1, 9, 1, 1), passthrough)
    with pytest.raises(ValueError, match="latent frames"):
        stitch.window(0, torch.zeros(1, 1, 5, 1, 1), passthrough)
    with pytest.raises(ValueError, match="aligned"):
        LatentStitch(plan_windows(30, 9, 4), 4)  # a cosine plan's starts are not multiples of 4


# -- the continued decode: bitwise the decode of the whole latent at once ------------------------------------


def _latent(t=6, h=4, w=5):
    return torch.randn(1, TINY.latent_channels, t, h, w, generator=torch.Generator().manual_seed(5))


@use_policy(DETERMINISTIC)
def continued_equals_whole(ctx, splits, modes):
    torch.set_num_threads(1)
    vae = seeded_vae(TINY)
    z = _latent()
    whole = ParallelVAE(vae).decode(z, mode="replicated")
    pv = ParallelVAE(vae, Comm(ctx.group if ctx.world_size > 1 else None), chunk=1)
    out = {}
    for mode in modes:
        layout = SlabLayout.for_latent(*z.shape[2:], ctx.world_size, TINY.spatial_factor)
        _, _, h0, h1 = layout.rank_rows(ctx.rank)
        mine = z[:, :, :, h0:h1] if mode.startswith("height") else z
        parts, carry = [], None
        for a, b in zip(splits, splits[1:]):
            got, carry = pv.decode_continued(mine[:, :, a:b], a, carry, mode, layout, last=b == splits[-1])
            parts.append(got)
        got = torch.cat(parts, 2)
        if mode.startswith("height"):
            s = TINY.spatial_factor
            got_rows = got
            want = whole[:, :, :, s * h0: s * h1] if h1 < layout.h else whole[:, :, :, s * h0:]
            out[mode] = torch.equal(got_rows, want)
        else:
            out[mode] = torch.equal(got, whole)
    return out


def test_continued_decode_on_one_device_equals_the_whole_decode():
    from ditsp.distributed.launcher import RankContext

    ctx = RankContext(0, 1, None, torch.device("cpu"))
    before = torch.get_num_threads()
    try:
        for splits in ([0, 6], [0, 1, 6], [0, 2, 3, 6]):
            got = continued_equals_whole(ctx, splits, ["replicated", "chunked", "time", "height", "height+chunks"])
            assert all(got.values()), (splits, got)
    finally:
        torch.set_num_threads(before)


@pytest.mark.bitwise
@pytest.mark.parametrize("sp", [2, 3])
def test_continued_decode_of_slabs_equals_the_whole_decode(clusters, sp):
    for got in clusters(sp).run(continued_equals_whole, [0, 2, 6], ["height", "height+chunks", "chunked"]):
        assert all(got.values()), got


def test_continued_decode_refuses_what_it_cannot_continue():
    pv = ParallelVAE(seeded_vae(TINY))
    z = _latent()
    with pytest.raises(ValueError, match="exact VAE mode"):
        pv.decode_continued(z, 0, None, "tiled")
    with pytest.raises(ValueError, match="without a state"):
        pv.decode_continued(z, 2, None, "chunked")
    with pytest.raises(ValueError, match="layout"):
        pv.decode_continued(z, 0, None, "height")
