"""`ditsp train` (#27): the data pipeline's degradations, the quality metrics, a short training run,
resume equal to an uninterrupted run, and one step under SP against one device."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ditsp.io import quality
from ditsp.train import data
from ditsp.train.loop import TrainConfig, Trainer, check, rank_check

pytestmark = [pytest.mark.timeout(300)]


# -- degradations ------------------------------------------------------------------------------------


def test_blur_keeps_a_constant_image_and_smooths_an_edge():
    flat = torch.full((1, 3, 16, 16), 0.4)
    assert torch.allclose(data.gaussian_blur(flat, 1.0), flat, atol=1e-6)
    edge = torch.zeros(1, 3, 16, 16)
    edge[..., 8:] = 1
    out = data.gaussian_blur(edge, 1.0)
    assert 0 < out[0, 0, 0, 7] < 0.5 < out[0, 0, 0, 8] < 1
    assert torch.equal(data.gaussian_blur(edge, 0), edge)


def test_compression_round_trips_are_real_and_lossy():
    g = torch.Generator().manual_seed(0)
    clip = data.pan_clip(data.photograph("astronaut"), 5, (32, 48), g)
    u8 = data.to_u8(clip)
    for out in (data.h264_roundtrip(u8, 35), data.jpeg_roundtrip(u8, 12)):
        assert out.shape == u8.shape and out.dtype == np.uint8
        err = np.abs(out.astype(int) - u8.astype(int)).mean()
        assert 0.5 < err < 30  # changed by the codec, still the same picture


def test_degradation_is_a_function_of_seed_and_index_and_never_uses_the_held_out_image():
    pairs = data.ClipPairs(frames=5, size=(32, 32), seed=3)
    (a, b), (c, d) = pairs[7], pairs[7]
    assert torch.equal(a, c) and torch.equal(b, d)
    assert a.shape == b.shape == (5, 3, 32, 32)
    assert not torch.equal(pairs[8][1], b)
    assert (a - b).abs().mean() > 0.005  # degraded
    assert data.HELD_OUT not in pairs.names and "cat" not in pairs.names
    with pytest.raises(ValueError, match="held-out"):
        data.ClipPairs(images=("astronaut", "chelsea"))


# -- metrics against hand-computed values --------------------------------------------------------------


def test_psnr_and_ssim_match_hand_computed_values():
    a = np.full((8, 8, 3), 100, np.uint8)
    b = np.full((8, 8, 3), 110, np.uint8)
    assert quality.psnr(a, b) == pytest.approx(10 * math.log10(255 ** 2 / 100))
    c1 = (0.01 * 255) ** 2  # constant frames: no variance, only the luminance term remains
    assert quality.ssim(a, b) == pytest.approx((2 * 100 * 110 + c1) / (100 ** 2 + 110 ** 2 + c1))
    assert quality.ssim(a, a) == pytest.approx(1.0)
    frames = np.stack([a, b])
    r = quality.report(frames, frames[:, ::2, ::2], np.stack([b, a]), [(0, 1), (1, 2)])
    for w in r["restored"]["windows"] + [r["restored"]["overall"]]:
        assert w["psnr"] == pytest.approx(10 * math.log10(255 ** 2 / 100))
    assert r["bicubic"]["overall"]["psnr"] == pytest.approx(r["restored"]["overall"]["psnr"])  # constant frames
    with pytest.raises(ValueError, match="output's size"):
        quality.report(frames, frames, np.zeros((2, 4, 4, 3), np.uint8))


# -- training ---------------------------------------------------------------------------------------


def small(tmp_path, **kw):
    base = dict(out=str(tmp_path), steps=3, batch=1, frames=1, size=(32, 32), progress=False, checkpoint_every=1,
                warmup=1)
    return TrainConfig(**{**base, **kw})


@pytest.mark.usefixtures("one_thread")
def test_three_step_smoke_run_writes_weights_plot_and_report(tmp_path):
    report = Trainer(small(tmp_path)).run()
    assert report["steps"] == 3 and math.isfinite(report["final_loss"])
    for name in ("dit.safetensors", "loss.png", "report.json", "checkpoint.pt"):
        assert (tmp_path / name).exists()
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == 3
    weights = load_file(tmp_path / "dit.safetensors")
    assert "vid_in.proj.weight" in weights


@pytest.mark.usefixtures("one_thread")
def test_resume_equals_an_uninterrupted_run(tmp_path):
    whole = Trainer(small(tmp_path / "a", steps=3, objective="vae"))
    whole.run()
    part = small(tmp_path / "b", steps=2, objective="vae")
    Trainer(part).run()
    resumed = Trainer(replace(part, steps=3, resume=True))
    assert resumed.run()["resumed_from"] == 2
    a, b = whole.vae.state_dict(), resumed.vae.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.losses == resumed.losses


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path):
    Trainer(small(tmp_path, steps=1, objective="vae")).run()
    with pytest.raises(ValueError, match="different settings.*lr"):
        Trainer(small(tmp_path, steps=2, objective="vae", lr=0.5, resume=True)).run()


@pytest.mark.usefixtures("one_thread")
def test_the_dit_loss_distance_is_the_one_asked_for(tmp_path):
    mse = Trainer(small(tmp_path / "mse", steps=1)).run()["final_loss"]
    l1 = Trainer(small(tmp_path / "l1", steps=1, dit_loss="l1")).run()["final_loss"]
    assert math.isfinite(l1) and l1 != mse  # the same first step, scored by another distance
    both = Trainer(small(tmp_path / "l1-ssim", steps=1, dit_loss="l1-ssim", size=(64, 64))).run()["final_loss"]
    assert math.isfinite(both) and both > 0
    with pytest.raises(ValueError, match="unknown DiT loss 'huber'"):
        TrainConfig(dit_loss="huber")


def test_the_vae_refuses_to_train_under_sp():
    with pytest.raises(ValueError, match="one device"):
        TrainConfig(objective="vae", sp=2)


@pytest.mark.usefixtures("one_thread")
def test_one_step_under_sp_matches_one_device(clusters, tmp_path):
    cfg = small(tmp_path, sp=2, path="halo")
    results = clusters(2).run(rank_check, cfg)
    assert all(torch.equal(x, y) for x, y in zip(results[0]["grads"], results[1]["grads"]))
    c = check(cfg, results[0])
    assert c["relative"] < 1e-5, c
    assert c["loss_sp"] == pytest.approx(c["loss_one_device"], rel=1e-6)


def test_a_restorer_from_scratch_starts_as_the_identity_on_the_degraded_latent():
    """init_dit_as_identity: the one-step sample x0 = noise - v is the condition (to about 2% of its
    spread) at the sampling timestep, through the whole forward and the window runtime."""
    import torch

    from ditsp.models.seedvr2.nadit.model import build_model
    from ditsp.models.seedvr2.parallelize import single_runtime
    from ditsp.models.seedvr2.pipeline.condition import SCHEDULE_T, dit_input
    from ditsp.models.seedvr2.presets import dit_config
    from ditsp.train.loop import text_embedding
    from ditsp.train.objective import init_dit_as_identity

    dit = init_dit_as_identity(build_model(dit_config("tiny"), seed=0))
    g = torch.Generator().manual_seed(3)
    noise, cond = torch.randn(5, 12, 16, 16, generator=g), torch.randn(5, 12, 16, 16, generator=g) * 0.8
    with torch.no_grad():
        v = dit(dit_input(noise, cond), text_embedding(dit), SCHEDULE_T,
                runtime=single_runtime(dit.cfg, dit.grid_of(noise.shape)))
    err = ((noise - v) - cond).pow(2).mean().sqrt()
    assert err < 0.02 * cond.std(), err
    seeded = build_model(dit_config("tiny"), seed=0)  # the seeded weights are nowhere near it
    with torch.no_grad():
        v0 = seeded(dit_input(noise, cond), text_embedding(seeded), SCHEDULE_T,
                    runtime=single_runtime(seeded.cfg, seeded.grid_of(noise.shape)))
    assert ((noise - v0) - cond).pow(2).mean().sqrt() > 0.5 * cond.std()


def test_an_identity_start_refuses_a_model_too_narrow_to_carry_the_latent():
    import dataclasses

    import pytest

    from ditsp.models.seedvr2.nadit.model import NaDiT
    from ditsp.models.seedvr2.presets import dit_config
    from ditsp.train.objective import init_dit_as_identity

    narrow = dataclasses.replace(dit_config("tiny"), vid_dim=48, heads=2, head_dim=24, rope_dim=24)
    with pytest.raises(ValueError, match="needs vid_dim >= 65"):
        init_dit_as_identity(NaDiT(narrow))


def test_the_training_ssim_is_the_quality_metric_s():
    from ditsp.train.objective import latent_ssim, ssim

    g = np.random.default_rng(0)
    a = (g.random((40, 56, 3)) * 255).astype(np.uint8)
    b = np.clip(a.astype(int) + g.integers(-30, 30, a.shape), 0, 255).astype(np.uint8)
    as_tensor = lambda f: torch.from_numpy(f).permute(2, 0, 1)[None].double() / 255  # noqa: E731
    assert ssim(as_tensor(a), as_tensor(b)).item() == pytest.approx(quality.ssim(a, b), abs=1e-9)
    z = torch.randn(3, 16, 16, 16)
    z[..., 12:] = 0  # channels the VAE leaves empty are not scored (their SSIM would be 1 whatever x0 holds)
    assert latent_ssim(z, z).item() == pytest.approx(1.0)
    assert latent_ssim(z + 0.1 * torch.randn(z.shape), z).item() < 0.99
