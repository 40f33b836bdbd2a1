"""Rollout/training identity across SP degrees: under the deterministic policy a rollout sampled at one SP
degree and the training forward at another give the same log-probabilities bit for bit, and the first
update's importance ratio is exactly 1 on every (rollout, step). The clip is 4 latent tokens (frames 5,
32x16 pixels), so SP 3 runs shards of 2, 1 and 1 rows: the row counts where a plain GEMM's bits follow the
call's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.rl.grpo import GRPOConfig, Trainer, advantages, step_log_prob  # noqa: E402
from ditsp.rl.policy import Policy, SamplerConfig, random_models, sample, seeded_prompts  # noqa: E402

SAMPLER = SamplerConfig(steps=4, window=(0, 3), frames=5, height=16, width=32)
SEEDS = (11, 12, 13, 14)


def _policy(ctx, deterministic=True):
    return Policy(random_models(0), ctx.group if ctx.world_size > 1 else None, deterministic)


def _rollouts(ctx):
    policy = _policy(ctx)
    prompts = seeded_prompts(2, policy.text_dim)
    return [sample(policy, prompts[k % 2:k % 2 + 1], s, SAMPLER, prompt=k % 2, decode=False)
            for k, s in enumerate(SEEDS)]


def _train(ctx, rollouts):
    """The training forward (autograd on) of every SDE step, then one GRPO batch's updates."""
    policy = _policy(ctx)
    prompts = seeded_prompts(2, policy.text_dim)
    lps = [[step_log_prob(policy, r, i, prompts[r.prompt:r.prompt + 1], SAMPLER)[0].detach()
            for i in SAMPLER.sde_steps] for r in rollouts]
    rewards = torch.tensor([[0.1, 0.3], [0.2, 0.7]], dtype=torch.float64)  # [prompt, its rollouts]
    adv = advantages(rewards, 5.0)
    by_rollout = [float(adv[k % 2, k // 2]) for k in range(len(rollouts))]
    stats = Trainer(policy, SAMPLER, GRPOConfig(updates=2)).update(rollouts, by_rollout, prompts)
    return lps, stats.first_ratios


@pytest.mark.bitwise
def test_rollouts_at_one_degree_train_at_another_with_ratio_exactly_one(clusters):
    rolled = {sp: clusters(sp).run(_rollouts)[0] for sp in (1, 2, 3)}
    for sp in (2, 3):  # the trajectories themselves: the same bits at every degree
        for a, b in zip(rolled[1], rolled[sp]):
            assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs), sp
    for roll_sp, train_sp in ((1, 3), (2, 1), (3, 2)):
        rollouts = rolled[roll_sp]
        for lps, ratios in clusters(train_sp).run(_train, rollouts):
            for r, mine in zip(rollouts, lps):
                assert torch.equal(torch.stack(mine), r.log_probs), (roll_sp, train_sp)
            assert len(ratios) == 2 * len(SAMPLER.sde_steps)  # the first update: the first two rollouts' steps
            assert all(x == 1.0 for x in ratios), (roll_sp, train_sp, ratios)
