"""ditsp rl on one device: rewards, advantages and the PPO loss against hand-computed values, the sampler's
SDE step, the policy's weights, a short run that raises the held-out reward, resume, the seed chooser, and
the command line's refusals."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.rl import rewards  # noqa: E402
from ditsp.rl.grpo import ADV_EPS, advantages, ppo_loss, shares, step_log_prob  # noqa: E402
from ditsp.rl.loop import RLConfig, Run, SeedRequest, default_seeds  # noqa: E402
from ditsp.rl.policy import (Policy, SamplerConfig, log_prob, random_models, sample, sde_mean_std,  # noqa: E402
                             seeded_prompts)

from .cli_errors import fails  # noqa: E402


def _frames(*values, h=8, w=8) -> torch.Tensor:
    return torch.stack([torch.full((h, w, 3), v, dtype=torch.uint8) for v in values])


# -- rewards ---------------------------------------------------------------------------------------------------


def test_brightness_and_smoothness_match_hand_computed_values():
    assert rewards.brightness(_frames(51, 102)) == pytest.approx(76.5 / 255)  # (51 + 102) / 2 / 255 = 0.3
    assert rewards.brightness(_frames(51, 102)) == pytest.approx(0.3)
    # consecutive changes 51 and 0 levels: mean 25.5 / 255 = 0.1
    assert rewards.smoothness(_frames(0, 51, 51)) == pytest.approx(-0.1)
    assert rewards.smoothness(_frames(200)) == 0.0
    half = _frames(0, 0)
    half[1, :, :4] = 255  # half the pixels jump by the whole range: 0.5
    assert rewards.smoothness(half) == pytest.approx(-0.5)


def test_jpeg_rewards_are_the_mean_pillow_jpeg_size_in_kb():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8)
    flat = torch.full((16, 16, 3), 128, dtype=torch.uint8)
    sizes = []
    for f in (flat, noise):  # by hand: each frame through Pillow at quality 95, bytes counted
        buf = io.BytesIO()
        Image.fromarray(f.numpy()).save(buf, format="JPEG", quality=95)
        sizes.append(len(buf.getvalue()))
    clip = torch.stack([flat, noise])
    assert rewards.jpeg_incompressibility(clip) == pytest.approx((sizes[0] + sizes[1]) / 2 / 1000)
    assert rewards.jpeg_compressibility(clip) == -rewards.jpeg_incompressibility(clip)
    assert sizes[0] < sizes[1]  # a flat frame compresses better than noise: the reward orders them
    assert rewards.jpeg_compressibility(flat[None]) > rewards.jpeg_compressibility(noise[None])


def test_rewards_registry_and_bad_frames():
    assert set(rewards.REWARDS) == {"jpeg-compressibility", "jpeg-incompressibility", "smoothness", "brightness"}
    assert rewards.reward("brightness") is rewards.brightness
    with pytest.raises(ValueError, match="unknown reward 'beauty'"):
        rewards.reward("beauty")
    with pytest.raises(ValueError, match=r"uint8 frames \[F, H, W, 3\]"):
        rewards.brightness(torch.zeros(2, 8, 8, 3))


# -- GRPO ------------------------------------------------------------------------------------------------------


def test_advantages_match_hand_computed_values():
    a = advantages(torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]), 5.0)
    s = math.sqrt(2 / 3)  # the population std of 1, 2, 3
    assert a[0].tolist() == pytest.approx([-1 / (s + ADV_EPS), 0.0, 1 / (s + ADV_EPS)])
    assert a[1].tolist() == [0.0, 0.0, 0.0]  # an all-equal group teaches nothing
    # 0, 0, 0, 10: mean 2.5, std sqrt(18.75) = 4.33; 7.5 / 4.33 = 1.73 is clipped to 1.5
    b = advantages(torch.tensor([[0.0, 0.0, 0.0, 10.0]]), 1.5)
    assert b[0, 3].item() == 1.5 and b[0, 0].item() == pytest.approx(-2.5 / (math.sqrt(18.75) + ADV_EPS))
    with pytest.raises(ValueError, match="group >= 2"):
        advantages(torch.tensor([[1.0], [2.0]]), 1.0)


def test_ppo_loss_clips_the_ratio_on_the_side_the_advantage_pushes():
    lp, old = torch.tensor(math.log(1.5), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    loss, ratio = ppo_loss(lp, old, 2.0, 0.2)  # max(-2 * 1.5, -2 * 1.2) = -2.4
    assert ratio.item() == pytest.approx(1.5) and loss.item() == pytest.approx(-2.4)
    loss, _ = ppo_loss(lp, old, -1.0, 0.2)  # max(1.5, 1.2) = 1.5: a bad action's growth is not clipped away
    assert loss.item() == pytest.approx(1.5)
    loss, ratio = ppo_loss(old, old, 3.0, 1e-4)
    assert ratio.item() == 1.0 and loss.item() == -3.0


def test_shares_split_rollouts_contiguously():
    assert [list(r) for r in shares(5, 2)] == [[0, 1], [2, 3, 4]]
    assert [list(r) for r in shares(2, 4)] == [[0], [1]]


# -- the sampler -----------------------------------------------------------------------------------------------


def test_sigmas_and_the_sde_step_match_hand_computed_values():
    assert SamplerConfig(steps=4, shift=1.0).sigmas() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert SamplerConfig(steps=2, shift=3.0, window=(0, 1)).sigmas()[1] == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    cfg = SamplerConfig(steps=4, noise_level=0.5)
    x, v = torch.tensor([1.0]), torch.tensor([2.0])
    # t 0.5 -> 0.25, a 0.5: sigma_t^2 = 0.25 * 0.5 / 0.5 = 0.25, dt = -0.25;
    # mean = 1 * (1 + 0.25 / 1 * -0.25) + 2 * (1 + 0.25 * 0.5 / 1) * -0.25 = 0.9375 - 0.5625; std = 0.5 * 0.5
    mean, std = sde_mean_std(x, v, 0.5, 0.25, cfg, [1.0, 0.5, 0.25, 0.1, 0.0])
    assert mean.item() == pytest.approx(0.375) and std == pytest.approx(0.25)
    # at t = 1 the next sigma stands in for t in 1 - t: sigma_t^2 = 0.25 * 1 / (1 - 0.5) = 0.5
    _, std = sde_mean_std(x, v, 1.0, 0.5, cfg, [1.0, 0.5, 0.0])
    assert std == pytest.approx(math.sqrt(0.5 * 0.5))
    xn, m = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    want = torch.distributions.Normal(m, 0.3).log_prob(xn).mean()
    assert log_prob(xn, m, 0.3).item() == pytest.approx(want.item(), rel=1e-12)


def test_sampler_config_refuses_bad_windows():
    with pytest.raises(ValueError, match="SDE window must be START:STOP"):
        SamplerConfig(steps=4, window=(2, 6))
    with pytest.raises(ValueError, match="SDE window"):
        SamplerConfig(steps=4, window=(3, 3))
    with pytest.raises(ValueError, match="noise_level must be a finite number > 0"):
        SamplerConfig(noise_level=float("nan"))


SMALL = SamplerConfig(steps=3, window=(0, 2), frames=5, height=16, width=32)


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return Policy(random_models(0), deterministic=True)


def test_sample_is_a_function_of_the_seed_and_its_log_probs_are_the_training_forwards(policy):
    prompts = seeded_prompts(1, policy.text_dim)
    a = sample(policy, prompts, 5, SMALL, reward="brightness")
    b = sample(policy, prompts, 5, SMALL)
    c = sample(policy, prompts, 6, SMALL)
    assert a.latents.shape == (4, 4, 2, 2, 4) and a.log_probs.shape == (2,) and a.frames.shape == (5, 16, 32, 3)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents[-1], c.latents[-1])
    assert a.reward == rewards.brightness(a.frames)
    for i in SMALL.sde_steps:  # with autograd on: the same bits as the sampling forward
        lp, mean, _ = step_log_prob(policy, a, i, prompts, SMALL)
        assert mean.requires_grad and lp.item() == a.log_probs[i].item()
    ode = sample(policy, prompts, 5, SMALL, ode=True, decode=False)
    assert ode.log_probs.numel() == 0 and ode.frames is None
    assert torch.equal(ode.latents, sample(policy, prompts, 5, SMALL, ode=True, decode=False).latents)
    assert torch.equal(ode.latents[0], a.latents[0])  # the same initial noise; the ODE adds none after it


def test_weights_round_trip_and_refuse_other_shapes(policy):
    w = policy.weights()
    before = {k: v.clone() for k, v in w.items()}
    with torch.no_grad():
        next(iter(policy.transformer.parameters())).add_(1.0)
    policy.load_weights(before)
    assert all(torch.equal(before[n], p) for n, p in policy.transformer.named_parameters())
    name = next(iter(before))
    with pytest.raises(ValueError, match=f"{name} is"):
        policy.load_weights({**before, name: torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        policy.load_weights({})


# -- a run -----------------------------------------------------------------------------------------------------


def _cfg(tmp_path, **kw) -> RLConfig:
    base = dict(out=str(tmp_path / "run"), steps=2, random_weights=True, random_prompts=4, holdout=1,
                reward="brightness", prompts_per_step=1, group_size=3, sample_steps=3, window=(0, 2),
                frames=5, size=(16, 32), lr=1e-2, eval_every=1, checkpoint_every=1, progress=False)
    return RLConfig(**{**base, **kw})


def test_resume_equals_an_uninterrupted_run(tmp_path):
    torch.set_num_threads(1)
    whole = Run(_cfg(tmp_path / "a"))
    whole.run()
    Run(_cfg(tmp_path / "b", steps=1)).run()
    resumed = Run(_cfg(tmp_path / "b", resume=True))
    report = resumed.run()
    assert report["resumed_from"] == 1 and report["steps"] == 2
    assert all(torch.equal(p, q) for p, q in zip(whole.policy.parameters(), resumed.policy.parameters()))
    a = json.loads((tmp_path / "a" / "run" / "history.json").read_text())
    b = json.loads((tmp_path / "b" / "run" / "history.json").read_text())
    strip = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in a["train"]]
    assert strip == [{k: v for k, v in r.items() if not k.endswith("_s")} for r in b["train"]]
    assert a["eval"] == b["eval"]


def test_the_seed_chooser_sets_the_rollouts_seeds(tmp_path):
    asked = []

    def choose(req: SeedRequest):
        asked.append(req)
        return [1000 * req.step + k for k in range(req.n)]

    run = Run(_cfg(tmp_path, steps=1), choose_seeds=choose)
    run.run()
    assert [(r.step, r.n, r.default) for r in asked] == [(0, 3, default_seeds(0, 0, asked[0].prompt, 3))]
    assert run.history[0]["seeds"] == [0, 1, 2]
    with pytest.raises(ValueError, match="the seed chooser gave 1 seeds, not 3"):
        Run(_cfg(tmp_path / "bad", steps=1), choose_seeds=lambda req: [7]).run()


def test_config_refusals():
    with pytest.raises(ValueError, match="--random-weights"):
        RLConfig(random_prompts=4)
    with pytest.raises(ValueError, match="--prompts FILE or --random-prompts N"):
        RLConfig(random_weights=True)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        RLConfig(random_weights=True, random_prompts=4, group_size=1)
    with pytest.raises(ValueError, match="unknown reward"):
        RLConfig(random_weights=True, random_prompts=4, reward="beauty")


# -- the command line ------------------------------------------------------------------------------------------


def test_help_documents_the_command(capsys):
    from ditsp.cli import main

    with pytest.raises(SystemExit) as e:
        main(["rl", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "GRPO" in out and "WanTransformer3DModel" in out and "--sde-window" in out


@pytest.mark.parametrize("args,message", [
    (["--random-prompts", "4"], "--random-weights"),
    (["--random-weights"], "--prompts FILE or --random-prompts N"),
    (["--random-weights", "--random-prompts", "4", "--sde-window", "2-3"], "--sde-window must be START:STOP"),
    (["--random-weights", "--random-prompts", "4", "--size", "20x16"], "multiple of 16x16"),
    (["--random-weights", "--random-prompts", "2", "--holdout", "2"], "leaves none to train on"),
    (["--transformer", "/no/such", "--vae", "/no/such", "--random-prompts", "4"], "no such folder"),
    (["--random-weights", "--prompts", "/no/such.safetensors"], "no such file"),
])
def test_bad_arguments_are_one_line(capsys, args, message):
    assert message in fails(capsys, ["rl", *args])


def test_a_prompts_file_of_the_wrong_width_is_refused(capsys, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "p.safetensors"
    save_file({"prompt_embeds": torch.zeros(4, 8, 16)}, str(path))
    assert "width 16, the transformer takes 32" in fails(capsys, ["rl", "--random-weights", "--prompts", str(path)])


def test_a_short_run_raises_the_held_out_reward_and_writes_the_curve(capsys, tmp_path):
    """The command end to end at a tiny size with a fixed seed: the held-out prompts' deterministic samples
    score better after 4 GRPO steps than before (a reward, not a timing); the curve, the history, the report
    and a transformer folder diffusers loads are written."""
    from diffusers import WanTransformer3DModel

    from ditsp.cli import main

    out = tmp_path / "run"
    assert main(["rl", "--random-weights", "--random-prompts", "6", "--reward", "jpeg-compressibility",
                 "--steps", "4", "--sample-steps", "4", "--sde-window", "0:2", "--lr", "1e-3", "--eval-every", "2",
                 "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in report["eval"]] == [0, 2, 4]
    assert report["eval_after"] > report["eval_before"], report["eval"]
    assert report["first_update_ratio"] == [1.0, 1.0]
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(json.loads((out / "history.json").read_text())["train"]) == 4
    trained = WanTransformer3DModel.from_pretrained(str(out / "transformer"), local_files_only=True)
    start = random_models(0).transformer.state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in trained.state_dict().items())


def _one_step(ctx, out):
    run = Run(RLConfig(out=out, steps=1, random_weights=True, random_prompts=4, holdout=1, reward="brightness",
                       prompts_per_step=1, group_size=3, sample_steps=3, window=(0, 2), frames=5, size=(16, 32),
                       deterministic=True, progress=False, plot=False), ctx.group if ctx.world_size > 1 else None)
    report = run.run()
    return report, run.history, [p.detach().clone() for p in run.policy.parameters()]


def test_a_run_at_sp_2_scores_and_updates_as_one_device(clusters, tmp_path):
    """Rollouts scored split across the ranks and the update's gradients summed over the group: the same
    rewards bit for bit (deterministic), every rank the same weights, and one device's within 5% of one
    AdamW step (lr 1e-4: a gradient summed in another order moves an entry by about 3e-7; a gradient not
    summed over the group, by a whole step)."""
    one = _one_step(type("Ctx", (), {"world_size": 1, "group": None})(), str(tmp_path / "one"))
    two = clusters(2).run(_one_step, str(tmp_path / "two"))
    for report, history, params in two:
        assert report["eval"][0] == one[0]["eval"][0] and history[0]["reward"] == one[1][0]["reward"]
        assert history[0]["first_ratio"] == [1.0, 1.0]
        for p, q in zip(params, one[2]):
            assert (p - q).abs().max().item() <= 0.05 * 1e-4
    assert all(torch.equal(p, q) for p, q in zip(two[0][2], two[1][2]))  # every rank keeps the same weights


def test_model_folders_load_and_a_folder_of_another_class_is_refused(capsys, tmp_path):
    models = random_models(0)
    models.transformer.save_pretrained(str(tmp_path / "transformer"))
    models.vae.save_pretrained(str(tmp_path / "vae"))
    line = fails(capsys, ["rl", "--transformer", str(tmp_path / "vae"), "--vae", str(tmp_path / "vae"),
                          "--random-prompts", "4"])
    assert "holds AutoencoderKLWan, ditsp rl runs WanTransformer3DModel" in line
    import shutil

    shutil.copytree(tmp_path / "vae", tmp_path / "vae0")
    config = json.loads((tmp_path / "vae0" / "config.json").read_text())
    (tmp_path / "vae0" / "config.json").write_text(json.dumps({**config, "scale_factor_spatial": 0}))
    line = fails(capsys, ["rl", "--transformer", str(tmp_path / "transformer"), "--vae", str(tmp_path / "vae0"),
                          "--random-prompts", "4"])  # a 0 would divide by zero
    assert line.endswith("vae0/config.json: scale_factor_spatial must be an integer >= 1, got 0"), line
    from ditsp.cli import main

    assert main(["rl", "--transformer", str(tmp_path / "transformer"), "--vae", str(tmp_path / "vae"),
                 "--random-prompts", "4", "--steps", "1", "--sample-steps", "3", "--sde-window", "0:2",
                 "--size", "32x16", "--out", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 1 and str(tmp_path / "transformer") in report["model"]


def test_a_step_that_turns_nan_stops_with_one_line_and_keeps_nothing(capsys, tmp_path):
    line = fails(capsys, ["rl", "--random-weights", "--random-prompts", "4", "--steps", "3", "--sample-steps", "3",
                          "--sde-window", "0:2", "--size", "32x16", "--lr", "1e12", "--out", str(tmp_path / "o"),
                          "--no-progress"], code=1)
    assert line.startswith("ditsp rl: step 1: ") and "training stopped" in line, line
    assert line.endswith("no checkpoint was written"), line
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_the_kl_term_is_the_gaussians_kl_and_zero_before_the_first_update(tmp_path):
    from ditsp.rl.grpo import gaussian_kl

    m, r = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(m, 0.4), torch.distributions.Normal(r, 0.4))
    assert gaussian_kl(m, r, 0.4).item() == pytest.approx(want.mean().item(), rel=1e-12)
    run = Run(_cfg(tmp_path, kl=0.5, updates=1, deterministic=True))
    run.run()
    assert run.history[0]["kl"] == 0.0  # the policy is the reference model until its first update
    assert run.history[1]["kl"] > 0.0
