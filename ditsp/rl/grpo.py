"""GRPO on sampled trajectories: group-normalised advantages, the PPO-clip loss, an optional KL, AdamW.

A batch holds ``n`` rollouts of each of ``P`` prompts. A rollout's advantage
is its reward's distance from its own prompt's group mean in units of the
group's standard deviation, clipped to ``+-adv_clip``: no value network, and
prompts of easy and hard rewards count alike. Each SDE step of a rollout is
one action; its importance ratio is ``exp(log p_new - log p_old)`` (both the
step's Gaussian log-density, :func:`ditsp.rl.policy.log_prob`), and its loss is
PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - clip, 1 + clip))`` with a
tiny ``clip`` (the ratios of a diffusion step stay near 1). With ``kl > 0``
the loss adds ``kl`` times the KL divergence from the reference model's step
(the initial weights): two Gaussians of one std, so ``|mean - mean_ref|^2 /
(2 std^2)``, a mean over elements.

One batch makes ``updates`` optimizer steps, each over a contiguous share of
the rollouts (gradients accumulated over its (rollout, step) pairs). The
first is on-policy: its weights are the ones that sampled, so every ratio is
1, exactly when the forward is bit for bit the sampling forward
(``deterministic``, at any SP degree). Gradients are the SP group's partial
gradients summed in rank order (every rank keeps the same weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..distributed.autograd import reduce_gradients
from ..distributed.heartbeat import beat
from ..train import checkpoint as ckpt
from .policy import Policy, Rollout, SamplerConfig, log_prob, sde_mean_std

ADV_EPS = 1e-4  # added to a group's reward std: an all-equal group gets advantages 0, not 0/0


@dataclass(frozen=True)
class GRPOConfig:
    clip: float = 1e-4
    adv_clip: float = 5.0
    kl: float = 0.0
    lr: float = 1e-4
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    updates: int = 2

    def __post_init__(self):
        for name, low, strict in (("clip", 0, True), ("adv_clip", 0, True), ("kl", 0, False), ("lr", 0, True),
                                  ("weight_decay", 0, False), ("grad_clip", 0, True)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > low if strict else v >= low)):
                raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {v!r}")
        if not isinstance(self.updates, int) or self.updates < 1:
            raise ValueError(f"updates must be an integer >= 1, got {self.updates!r}")


def advantages(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    """``[P, n]`` rewards -> advantages: per row, (r - mean) / (std + ADV_EPS) (population std), clipped."""
    r = rewards.to(torch.float64)
    if r.dim() != 2 or r.shape[1] < 2:
        raise ValueError(f"advantages need [prompts, group >= 2] rewards, got {tuple(r.shape)}")
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + ADV_EPS)).clamp(-clip, clip)


def ppo_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: float, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the clipped surrogate loss, the importance ratio) of one action."""
    ratio = torch.exp(lp - old_lp)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)), ratio


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: float) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)), the mean over elements (float64)."""
    d = mean.double() - ref_mean.double()
    return (d * d).mean() / (2 * std * std)


def step_log_prob(policy: Policy, rollout: Rollout, i: int, embeds: torch.Tensor, cfg: SamplerConfig):
    """(log-probability, SDE mean, std) of SDE step ``i`` of ``rollout`` under the policy's weights now;
    autograd follows the caller's mode."""
    sig = cfg.sigmas()
    x, x_next = rollout.latents[i], rollout.latents[i + 1]
    v = policy.velocity(x, sig[i], embeds)
    mean, std = sde_mean_std(x, v, sig[i], sig[i + 1], cfg, sig)
    return log_prob(x_next, mean, std), mean, std


@dataclass
class UpdateStats:
    """One batch's updates: the mean loss and KL over its actions, the ratios of the first update, the
    fraction of clipped ratios, each update's gradient norm (before clipping)."""

    loss: float = 0.0
    kl: float = 0.0
    first_ratios: list = field(default_factory=list)
    clipped: float = 0.0
    grad_norms: list = field(default_factory=list)


def shares(n: int, parts: int) -> list[range]:
    """``n`` rollouts in ``min(parts, n)`` contiguous shares, sizes differing by at most one."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


class Trainer:
    """AdamW on the policy's transformer; ``reference``: the frozen initial policy for the KL term."""

    def __init__(self, policy: Policy, sampler: SamplerConfig, cfg: GRPOConfig, reference: Policy | None = None):
        if cfg.kl > 0 and reference is None:
            raise ValueError("a KL term needs the reference policy")
        self.policy, self.sampler, self.cfg, self.reference = policy, sampler, cfg, reference
        self.params = policy.parameters()
        for p in self.params:
            p.requires_grad_(True)
        if reference is not None:
            reference.transformer.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.names = {id(p): n for n, p in policy.transformer.named_parameters()}

    def update(self, rollouts: Sequence[Rollout], adv: Sequence[float], prompts: torch.Tensor,
               step: int = 0) -> UpdateStats:
        """``cfg.updates`` optimizer steps over ``rollouts`` (advantages ``adv`` in the same order; prompt
        embeddings ``prompts[rollout.prompt]``). Raises :class:`~ditsp.train.checkpoint.NonFiniteError`
        naming ``step`` before a NaN/Inf loss, gradient or weight is kept."""
        cfg, stats = self.cfg, UpdateStats()
        steps = list(self.sampler.sde_steps)
        actions, clipped, losses, kls = 0, 0, [], []
        for k, share in enumerate(shares(len(rollouts), cfg.updates)):
            for p in self.params:
                p.grad = None
            pairs = [(j, i) for j in share for i in steps if adv[j] != 0 or cfg.kl > 0]
            for j, i in pairs:
                r = rollouts[j]
                embeds = prompts[r.prompt:r.prompt + 1]
                ref_mean = None
                if cfg.kl > 0:
                    with torch.no_grad():
                        _, ref_mean, _ = step_log_prob(self.reference, r, i, embeds, self.sampler)
                lp, mean, std = step_log_prob(self.policy, r, i, embeds, self.sampler)
                loss, ratio = ppo_loss(lp, r.log_probs[i - steps[0]], float(adv[j]), cfg.clip)
                if ref_mean is not None:
                    kl = gaussian_kl(mean, ref_mean, std)
                    loss = loss + cfg.kl * kl
                    kls.append(float(kl.detach()))
                (loss / len(pairs)).backward()
                value = float(loss.detach())
                if not math.isfinite(value):
                    self._stop(step, f"the loss is {value} (prompt {r.prompt}, seed {r.seed}, SDE step {i})")
                losses.append(value)
                ratio = float(ratio.detach())
                if k == 0:
                    stats.first_ratios.append(ratio)
                clipped += abs(ratio - 1) > cfg.clip
                actions += 1
                beat()
            reduce_gradients(self.policy.comm, self.params)
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)) if pairs else 0.0
            if not math.isfinite(norm):
                self._stop(step, f"the gradient norm is {norm}")
            stats.grad_norms.append(norm)
            if pairs:
                self.opt.step()
            bad = ckpt.nonfinite((self.names[id(p)], p.detach()) for p in self.params)
            if bad:
                self._stop(step, f"the optimizer step made {len(bad)} weight tensor(s) NaN or Inf "
                                 f"({', '.join(bad[:3])})")
        stats.loss = sum(losses) / len(losses) if losses else 0.0
        stats.kl = sum(kls) / len(kls) if kls else 0.0
        stats.clipped = clipped / actions if actions else 0.0
        return stats

    @staticmethod
    def _stop(step: int, why: str) -> None:
        raise ckpt.NonFiniteError(f"step {step + 1}: {why}; training stopped (a lower --lr may help)")
