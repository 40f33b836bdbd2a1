"""A GRPO run on one SP group: rollouts, rewards, updates, evaluation, checkpoints, the curve.

Step ``s`` (from 0): ``prompts_per_step`` training prompts drawn by a
generator seeded with (seed, s); for each, ``group_size`` seeds (the default
ones, or those ``choose_seeds`` returns: where exploration plugs in); one
rollout per seed with the SDE sampler, all on the whole group (the
transformer under SP); the rollouts decoded and scored split across the ranks;
group advantages; ``updates`` optimizer steps. Held-out prompts are sampled
with the deterministic (ODE) sampler from seeds fixed for the run, so the
evaluation reward is the same samples' reward as training moves them, before
the first step, every ``eval_every`` steps and after the last.

Everything a step draws is a function of (seed, step), so no RNG state is
saved: a checkpoint (``ditsp.train.checkpoint``: atomic, checked, finite) holds
the transformer and AdamW's state, and ``history.json`` (written atomically
before it) the per-step record; ``resume`` continues bit for bit. Rank 0
writes ``OUT/transformer/`` (a diffusers ``from_pretrained`` folder),
``reward.png``, ``history.json`` and ``report.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..distributed.comm import Comm
from ..integrations.diffusers import ParallelizeError
from ..integrations.diffusers.generate import load_embeds
from ..train import checkpoint as ckpt
from ..weights.formats import error_line
from .grpo import GRPOConfig, Trainer, UpdateStats, advantages
from .policy import Policy, SamplerConfig, load_models, random_models, sample, score, seeded_prompts
from .rewards import REWARDS


@dataclass
class RLConfig:
    """Every setting of ``ditsp rl`` (the command's flags; ``size`` is (height, width) in pixels)."""

    out: str = "out/rl"
    steps: int = 20
    transformer: str | None = None
    vae: str | None = None
    random_weights: bool = False
    prompts: str | None = None
    random_prompts: int = 0
    eval_prompts: str | None = None
    holdout: int = 2
    reward: str = "jpeg-compressibility"
    prompts_per_step: int = 2
    group_size: int = 4
    sample_steps: int = SamplerConfig.steps  # the sampler's settings: their defaults live in SamplerConfig
    window: tuple = SamplerConfig.window
    noise_level: float = SamplerConfig.noise_level
    shift: float = SamplerConfig.shift
    frames: int = SamplerConfig.frames
    size: tuple = (SamplerConfig.height, SamplerConfig.width)
    clip: float = GRPOConfig.clip  # the update's settings: their defaults live in GRPOConfig
    adv_clip: float = GRPOConfig.adv_clip
    kl: float = GRPOConfig.kl
    lr: float = GRPOConfig.lr
    weight_decay: float = GRPOConfig.weight_decay
    grad_clip: float = GRPOConfig.grad_clip
    updates: int = GRPOConfig.updates
    seed: int = 0
    sp: int = 1
    deterministic: bool = False
    eval_every: int = 5
    eval_seeds: int = 1
    checkpoint_every: int = 10
    resume: bool = False
    progress: bool = True
    plot: bool = True
    json: bool = False

    def __post_init__(self):
        self.window, self.size = tuple(self.window), tuple(self.size)
        if self.reward not in REWARDS:
            raise ValueError(f"unknown reward {self.reward!r}; choose from {', '.join(REWARDS)}")
        for name in ("steps", "prompts_per_step", "sp", "eval_every", "eval_seeds", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare a prompt's rollouts), got {self.group_size}")
        if self.random_weights == bool(self.transformer or self.vae):
            raise ValueError("give --transformer DIR and --vae DIR, or --random-weights (seeded tiny models)")
        if not self.random_weights and not (self.transformer and self.vae):
            raise ValueError("give both --transformer DIR and --vae DIR")
        if bool(self.prompts) == (self.random_prompts > 0):
            raise ValueError("give --prompts FILE or --random-prompts N (seeded embeddings), one of them")
        if self.holdout < 0 or (self.eval_prompts is None and self.holdout < 1):
            raise ValueError(f"holdout must be >= 1 without --eval-prompts, got {self.holdout}")
        self.sampler  # the sampler's and the update's own checks
        self.grpo

    @property
    def sampler(self) -> SamplerConfig:
        return SamplerConfig(steps=self.sample_steps, shift=self.shift, window=self.window,
                             noise_level=self.noise_level, frames=self.frames, height=self.size[0], width=self.size[1])

    @property
    def grpo(self) -> GRPOConfig:
        return GRPOConfig(clip=self.clip, adv_clip=self.adv_clip, kl=self.kl, lr=self.lr,
                          weight_decay=self.weight_decay, grad_clip=self.grad_clip, updates=self.updates)


@dataclass(frozen=True)
class SeedRequest:
    """What a seed chooser is asked: ``n`` seeds for training prompt ``prompt`` at step ``step``."""

    step: int
    prompt: int
    n: int
    default: tuple


SeedChooser = Callable[[SeedRequest], Sequence[int]]


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def default_seeds(seed: int, step: int, prompt: int, n: int) -> tuple[int, ...]:
    """The rollout seeds of (run seed, step, prompt) without exploration: distinct, a pure function."""
    return tuple(_seed("rollout", seed, step, prompt, k) for k in range(n))


def eval_seeds(seed: int, prompt: int, n: int) -> tuple[int, ...]:
    """The held-out samples' seeds: fixed for the run, so evaluations score the same noise."""
    return tuple(_seed("eval", seed, prompt, k) for k in range(n))


def step_prompts(seed: int, step: int, count: int, available: int) -> list[int]:
    """The training prompts of ``step``: ``count`` distinct indices drawn from (seed, step)."""
    g = torch.Generator().manual_seed(_seed("prompts", seed, step))
    return torch.randperm(available, generator=g)[:count].tolist()


def load_prompts(cfg: RLConfig, text_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) prompt embeddings ``[N, L, D]`` of ``cfg`` (one-line errors)."""
    def read(path: str, flag: str) -> torch.Tensor:
        if not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
        try:
            embeds, _ = load_embeds(path, 1.0)
        except ParallelizeError as e:
            raise ValueError(f"{flag} {e}") from None
        if embeds.shape[-1] != text_dim:
            raise ValueError(f"{flag} {path}: embeddings of width {embeds.shape[-1]}, the transformer takes {text_dim}")
        return embeds

    if cfg.prompts:
        embeds = read(cfg.prompts, "--prompts")
    else:
        embeds = seeded_prompts(cfg.random_prompts, text_dim, cfg.seed)
    if cfg.eval_prompts:
        train, held = embeds, read(cfg.eval_prompts, "--eval-prompts")
        if held.shape[1:] != train.shape[1:]:
            raise ValueError(f"--eval-prompts: shape {tuple(held.shape[1:])} per prompt, the training prompts' "
                             f"{tuple(train.shape[1:])}")
    else:
        if embeds.shape[0] <= cfg.holdout:
            raise ValueError(f"{embeds.shape[0]} prompt(s): holding out {cfg.holdout} leaves none to train on")
        train, held = embeds[:-cfg.holdout], embeds[-cfg.holdout:]
    if cfg.prompts_per_step > train.shape[0]:
        raise ValueError(f"prompts_per_step {cfg.prompts_per_step} exceeds the {train.shape[0]} training prompt(s)")
    return train.contiguous(), held.contiguous()


def build_models(cfg: RLConfig):
    return random_models(cfg.seed) if cfg.random_weights else load_models(cfg.transformer, cfg.vae)


class Run:
    """One rank's run (every rank of ``group`` holds the same state); see the module docstring."""

    def __init__(self, cfg: RLConfig, group=None, choose_seeds: SeedChooser | None = None,
                 after_step: Callable[[int, Policy, UpdateStats], None] | None = None,
                 sample_rollouts: Callable[[int, list], list] | None = None):
        self.cfg, self.choose_seeds, self.after_step = cfg, choose_seeds, after_step
        # sample_rollouts(step, [(prompt, seeds)]) -> the scored rollouts in that order, sampled elsewhere
        # with this step's weights (spot workers: ditsp.rl.spot_run); None: on this group
        self.sample_rollouts = sample_rollouts
        self.comm = Comm.of(group)
        self.sampler = cfg.sampler
        self.policy = Policy(build_models(cfg), group, cfg.deterministic)
        self.policy.latent_shape(self.sampler)  # the size's check, before any work
        reference = Policy(build_models(cfg), group, cfg.deterministic) if cfg.kl > 0 else None
        self.trainer = Trainer(self.policy, self.sampler, cfg.grpo, reference)
        self.train_prompts, self.eval_prompts = load_prompts(cfg, self.policy.text_dim)
        self.step, self.losses, self.history, self.evals = 0, [], [], []
        self.saved = 0  # the step of the last checkpoint written or resumed from (0: none)

    @property
    def rank0(self) -> bool:
        return self.comm.rank == 0

    def seeds(self, step: int, prompt: int) -> list[int]:
        n = self.cfg.group_size
        default = default_seeds(self.cfg.seed, step, prompt, n)
        seeds = list(default) if self.choose_seeds is None else [int(s) for s in
                                                                 self.choose_seeds(SeedRequest(step, prompt, n, default))]
        if len(seeds) != n:
            raise ValueError(f"step {step + 1}, prompt {prompt}: the seed chooser gave {len(seeds)} seeds, not {n}")
        return seeds

    def rollouts(self, step: int) -> list:
        """The step's rollouts, scored: every rank holds all of them."""
        prompts = step_prompts(self.cfg.seed, step, self.cfg.prompts_per_step, self.train_prompts.shape[0])
        chosen = [(p, self.seeds(step, p)) for p in prompts]
        everyone = self.comm.all_gather_object(chosen)
        if any(c != chosen for c in everyone):
            raise ValueError(f"step {step + 1}: the ranks chose different seeds ({everyone})")
        if self.sample_rollouts is not None:
            return self.sample_rollouts(step, chosen)
        out = [sample(self.policy, self.train_prompts[p:p + 1], s, self.sampler, prompt=p, decode=False)
               for p, seeds in chosen for s in seeds]
        score(self.policy, out, self.cfg.reward)
        return out

    def evaluate(self) -> float:
        """Mean reward of the held-out prompts' deterministic samples."""
        out = [sample(self.policy, self.eval_prompts[p:p + 1], s, self.sampler, prompt=p, ode=True, decode=False)
               for p in range(self.eval_prompts.shape[0]) for s in eval_seeds(self.cfg.seed, p, self.cfg.eval_seeds)]
        rewards = score(self.policy, out, self.cfg.reward)
        return sum(rewards) / len(rewards)

    def train_step(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        rollouts = self.rollouts(self.step)
        t1 = time.perf_counter()
        n = cfg.group_size
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64).view(-1, n)
        adv = advantages(rewards, cfg.adv_clip).flatten().tolist()
        stats = self.trainer.update(rollouts, adv, self.train_prompts, self.step)
        t2 = time.perf_counter()
        record = {"step": self.step + 1, "reward": float(rewards.mean()),
                  "reward_std": float(rewards.std(unbiased=False)), "loss": stats.loss, "kl": stats.kl,
                  "clipped": stats.clipped, "grad_norm": stats.grad_norms,
                  "first_ratio": [min(stats.first_ratios), max(stats.first_ratios)] if stats.first_ratios else None,
                  "seeds": [r.seed for r in rollouts], "prompts": sorted({r.prompt for r in rollouts}),
                  "sample_s": round(t1 - t0, 3), "update_s": round(t2 - t1, 3)}
        self.step += 1
        self.losses.append(stats.loss)
        self.history.append(record)
        if self.after_step is not None:
            self.after_step(self.step - 1, self.policy, stats)
        return record

    def _paths(self) -> tuple[Path, Path]:
        out = Path(self.cfg.out)
        return out / "checkpoint.pt", out / "history.json"

    def save(self) -> None:
        self.saved = self.step
        if not self.rank0:
            return
        path, hist = self._paths()
        record = {"train": self.history, "eval": self.evals}
        ckpt.atomic_write(hist, lambda tmp: Path(tmp).write_text(json.dumps(record)))  # first: never behind
        ckpt.save(path, {"transformer": self.policy.transformer}, self.trainer.opt, self.step, self.losses,
                  asdict(self.cfg))

    def restore(self) -> None:
        path, hist = self._paths()
        if not path.exists():
            return
        step, losses = ckpt.load(path, {"transformer": self.policy.transformer}, self.trainer.opt, asdict(self.cfg))
        try:
            record = json.loads(hist.read_text())
            train, evals = record["train"][:step], [e for e in record["eval"] if e["step"] <= step]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{hist}: unreadable run history ({error_line(e)}); it is written with the "
                             f"checkpoint, resume needs both") from None
        if len(train) != step:
            raise ValueError(f"{hist}: {len(train)} step(s) of history, the checkpoint is at step {step}")
        self.step, self.losses, self.history, self.evals = step, losses, train, evals
        self.saved = step

    def run(self) -> dict:
        cfg = self.cfg
        if cfg.resume:
            self.restore()
        start = self.step
        bar = None
        if cfg.progress and self.rank0:
            from tqdm import tqdm  # local: only a run that draws a bar loads it

            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"rl {cfg.reward}", file=sys.stderr,
                       dynamic_ncols=True)
        t0 = time.perf_counter()
        if not any(e["step"] == self.step for e in self.evals):
            self.evals.append({"step": self.step, "reward": self.evaluate()})
        while self.step < cfg.steps:
            try:
                record = self.train_step()
            except ckpt.NonFiniteError as e:  # nothing non-finite was kept; say what is on disk
                kept = f"the last checkpoint, after step {self.saved}, is kept" if self.saved else \
                    "no checkpoint was written"
                raise ckpt.NonFiniteError(f"{e}; {kept}") from None
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                self.evals.append({"step": self.step, "reward": self.evaluate()})
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward']:.4g}", eval=f"{self.evals[-1]['reward']:.4g}")
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t0
        return self.finish(start, elapsed)

    def finish(self, start: int, elapsed: float) -> dict:
        cfg = self.cfg
        ratios = [r["first_ratio"] for r in self.history if r["first_ratio"]]
        report = {"steps": self.step, "resumed_from": start, "sp": self.comm.world_size,
                  "deterministic": cfg.deterministic, "reward": cfg.reward, "model": self.policy.source,
                  "eval": self.evals, "eval_before": self.evals[0]["reward"], "eval_after": self.evals[-1]["reward"],
                  "train_reward_first": self.history[0]["reward"] if self.history else None,
                  "train_reward_last": self.history[-1]["reward"] if self.history else None,
                  "first_update_ratio": [min(r[0] for r in ratios), max(r[1] for r in ratios)] if ratios else None,
                  "seconds": round(elapsed, 2), "s_per_step": round(elapsed / max(1, self.step - start), 3),
                  "out": cfg.out}
        if self.rank0:
            out = Path(cfg.out)
            export_transformer(out / "transformer", self.policy.transformer)
            if cfg.plot and (self.history or self.evals):
                plot_rewards(self.history, self.evals, out / "reward.png", cfg.reward)
            ckpt.atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1)))
        return report


def export_transformer(folder: Path, model: torch.nn.Module) -> None:
    """The transformer as a diffusers ``from_pretrained`` folder (config.json and the safetensors), atomically
    file by file, never NaN or Inf."""
    ckpt.export_weights(folder / "diffusion_pytorch_model.safetensors", model)
    ckpt.atomic_write(folder / "config.json", lambda tmp: Path(tmp).write_text(model.to_json_string()))


def plot_rewards(history: list, evals: list, path: Path, reward: str) -> None:
    import matplotlib  # local: a heavy optional package, loaded only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: a heavy optional package, loaded only when this runs

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if history:
        x = [h["step"] for h in history]
        mean = [h["reward"] for h in history]
        std = [h["reward_std"] for h in history]
        ax.plot(x, mean, lw=1.0, label="training rollouts (SDE), mean")
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    if evals:
        ax.plot([e["step"] for e in evals], [e["reward"] for e in evals], "o-", lw=1.5,
                label="held-out prompts (ODE)")
    ax.set_xlabel("step"), ax.set_ylabel(reward), ax.set_title(f"ditsp rl: {reward}")
    ax.legend()
    fig.tight_layout()
    ckpt.atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def run(cfg: RLConfig, group=None, choose_seeds: SeedChooser | None = None,
        after_step: Callable[[int, Policy, UpdateStats], None] | None = None) -> dict:
    """A whole run on this rank (every rank of ``group`` calls it alike); returns the report."""
    return Run(cfg, group, choose_seeds, after_step).run()


def rank_rl(ctx, cfg: RLConfig) -> dict:
    """Rank function (LocalCluster or torchrun): the run on the context's group."""
    torch.set_num_threads(1)
    return run(cfg, ctx.group if ctx.world_size > 1 else None)
