"""The policy (a diffusers Wan transformer under Ulysses SP, and its VAE) and the flow-matching sampler.

Flow matching here: ``x_t = (1 - t) x_0 + t e`` (``e`` Gaussian noise, ``t``
from 1 to 0), the transformer predicts the velocity ``v = e - x_0`` at
timestep ``1000 t``. The sampler takes ``steps`` Euler steps over the sigmas
``linspace(1, 0)`` shifted by ``s t / (1 + (s - 1) t)`` (``shift`` s, as Wan
samples). Inside the SDE window a step is stochastic instead: the reverse-time
SDE with the same marginals, whose drift adds ``sigma_t^2 / 2`` times the
score ``-(x + (1 - t) v) / t``, with ``sigma_t = a sqrt(t / (1 - t))``
(``noise_level`` a; at ``t = 1`` the next sigma stands in for ``t`` in the
denominator). One Euler-Maruyama step from ``t`` to ``t' < t`` (``dt = t' -
t``) is a Gaussian with

    mean = x + (v + sigma_t^2 / (2 t) (x + (1 - t) v)) dt,   std = sigma_t sqrt(-dt),

so its log-density, the policy's log-probability of the step, is exact. Every
number the sampler draws comes from one CPU generator seeded with the
rollout's seed, so every rank of a group (and every group) draws the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import ParallelConfig
from ..distributed.comm import Comm
from ..distributed.heartbeat import beat
from ..integrations.diffusers import ParallelizeError, parallelize
from ..integrations.diffusers.fixed import check_config, fix_shapes
from ..integrations.diffusers.generate import check_weights, to_uint8
from ..weights.formats import error_line
from .rewards import reward as reward_fn

# The seeded tiny models of ``--random-weights`` (tests and benchmarks): a 2-layer Wan whose widths are
# multiples of 64 (fixed-shape kernel calls need that) and a Wan VAE of 8 base channels, latent 4 channels.
RANDOM_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=32)
RANDOM_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                  latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 1.2])
RANDOM_TEXT_TOKENS = 8  # tokens per seeded prompt embedding


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler: ``steps`` steps, stochastic (SDE) for step indices in ``[window[0], window[1])``."""

    steps: int = 8
    shift: float = 3.0
    window: tuple = (0, 4)
    noise_level: float = 0.7
    frames: int = 5
    height: int = 32
    width: int = 32

    def __post_init__(self):
        object.__setattr__(self, "window", tuple(int(v) for v in self.window))
        for name in ("steps", "frames", "height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        lo, hi = self.window if len(self.window) == 2 else (-1, -1)
        if not 0 <= lo < hi <= self.steps:
            raise ValueError(f"the SDE window must be START:STOP with 0 <= START < STOP <= steps ({self.steps}), "
                             f"got {':'.join(map(str, self.window))}")
        for name, low in (("shift", 0.0), ("noise_level", 0.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > low):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    def sigmas(self) -> list[float]:
        """The ``steps + 1`` shifted sigmas from 1 to 0 (Python floats: the same on every rank)."""
        s = self.shift
        return [s * t / (1 + (s - 1) * t) for t in (1 - i / self.steps for i in range(self.steps + 1))]

    @property
    def sde_steps(self) -> range:
        return range(*self.window)


@dataclass
class Rollout:
    """One sampled trajectory (see the package docstring)."""

    prompt: int
    seed: int
    latents: torch.Tensor  # float32 [steps + 1, C, F, H, W]
    log_probs: torch.Tensor  # float64 [window length]; empty for the ODE sampler
    frames: torch.Tensor | None = None  # uint8 [F, H, W, 3]
    reward: float | None = None


@dataclass
class Models:
    """A Wan transformer and its VAE (not yet under SP), and where they came from."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    source: str


def folder_config(folder: str, flag: str, cls: str) -> dict:
    """The config.json of a ``save_pretrained`` folder that must hold a ``cls`` (one-line errors)."""
    if not Path(folder).is_dir():
        raise ValueError(f"{flag} {folder}: no such folder (a diffusers save_pretrained folder is expected)")
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {folder}: no readable config.json ({error_line(e)})") from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name != cls:
        raise ValueError(f"{flag} {folder}: holds {name}, ditsp rl runs {cls}")
    return config


def latent_shape(cfg: SamplerConfig, channels: int, time_factor: int, space_factor: int,
                 patch: Sequence[int]) -> tuple[int, int, int, int]:
    """``(C, F, H, W)`` of the sampler's clip (one-line error for sizes the VAE and patch cannot make)."""
    k, s = time_factor, space_factor
    _, ph, pw = patch
    if (cfg.frames - 1) % k:
        raise ValueError(f"frames must be {k}n + 1 for this VAE, got {cfg.frames}")
    if cfg.height % (s * ph) or cfg.width % (s * pw):
        raise ValueError(f"the size must be a multiple of {s * pw}x{s * ph} (the VAE's {s}x and the patch), "
                         f"got {cfg.width}x{cfg.height}")
    return (channels, (cfg.frames - 1) // k + 1, cfg.height // s, cfg.width // s)


def _ints(config, key: str, default, n: int, where: str) -> tuple[int, ...]:
    """``config[key]`` (``default`` when absent or None) as ``n`` integers >= 1 (one-line ValueError: a 0
    would divide by zero)."""
    v = config.get(key)
    v = default if v is None else v
    vals = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    if len(vals) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in vals):
        raise ValueError(f"{where}: {key} must be {'an integer' if n == 1 else f'{n} integers'} >= 1, "
                         f"got {json.dumps(v)[:60]}")
    return vals


def _factors(vae_config, where: str = "the VAE's config") -> tuple[int, int]:
    """The VAE's (time, space) factors (diffusers' defaults 4 and 8 when its config leaves them out)."""
    return (_ints(vae_config, "scale_factor_temporal", 4, 1, where)[0],
            _ints(vae_config, "scale_factor_spatial", 8, 1, where)[0])


def check_configs(transformer: dict, vae: dict, cfg: SamplerConfig, deterministic: bool,
                  where: tuple[str, str] = ("the transformer's config", "the VAE's config")) -> int:
    """A transformer's and a VAE's config.json dicts checked against each other, the clip and the kernel
    policy, without any weights; returns the transformer's text width (one-line ValueError)."""
    (channels,) = _ints(transformer, "in_channels", 16, 1, where[0])
    (z,) = _ints(vae, "z_dim", 16, 1, where[1])
    if channels != z:
        raise ValueError(f"the transformer takes {channels} latent channels, the VAE makes {z}")
    latent_shape(cfg, channels, *_factors(vae, where[1]), _ints(transformer, "patch_size", (1, 2, 2), 3, where[0]))
    if deterministic:
        try:
            check_config(transformer)
        except ParallelizeError as e:
            raise ValueError(str(e)) from None
    return _ints(transformer, "text_dim", 4096, 1, where[0])[0]


def check_folders(transformer_dir: str, vae_dir: str, cfg: SamplerConfig, deterministic: bool) -> int:
    """:func:`check_configs` of two ``save_pretrained`` folders."""
    return check_configs(folder_config(transformer_dir, "--transformer", "WanTransformer3DModel"),
                         folder_config(vae_dir, "--vae", "AutoencoderKLWan"), cfg, deterministic,
                         (f"{transformer_dir}/config.json", f"{vae_dir}/config.json"))


def load_models(transformer_dir: str, vae_dir: str) -> Models:
    """The transformer and VAE of two diffusers ``save_pretrained`` folders, local files only (one-line errors)."""
    import diffusers  # local: a heavy optional package, loaded only when a run builds its models

    parts = []
    for folder, flag, cls in ((transformer_dir, "--transformer", "WanTransformer3DModel"),
                              (vae_dir, "--vae", "AutoencoderKLWan")):
        folder_config(folder, flag, cls)
        try:
            m = getattr(diffusers, cls).from_pretrained(folder, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a missing or malformed weights file
            raise ValueError(f"{flag} {folder}: cannot load it ({error_line(e)})") from None
        try:
            check_weights(m, folder)
        except ParallelizeError as e:
            raise ValueError(str(e)) from None
        parts.append(m.float())
    return Models(parts[0], parts[1], f"WanTransformer3DModel from {transformer_dir}, AutoencoderKLWan from {vae_dir}")


def random_models(seed: int = 0) -> Models:
    """The seeded tiny Wan and VAE (:data:`RANDOM_WAN`, :data:`RANDOM_VAE`): the same weights for a seed."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(**RANDOM_WAN)
        vae = AutoencoderKLWan(**RANDOM_VAE)
    return Models(transformer, vae, f"random weights (seed {seed}): a 2-layer Wan, 4 heads x 16, and a tiny Wan VAE")


def seeded_prompts(n: int, dim: int, seed: int = 0, tokens: int = RANDOM_TEXT_TOKENS) -> torch.Tensor:
    """``n`` seeded prompt embeddings ``[n, tokens, dim]`` (tests and benchmarks: no text encoder offline)."""
    return torch.randn(n, tokens, dim, generator=torch.Generator().manual_seed(seed + 101))


class Policy:
    """One rank's share of the policy: the transformer under Ulysses SP on ``group`` (None: one device),
    with fixed-shape kernel calls when ``deterministic``, and the VAE (whole on every rank, frozen)."""

    def __init__(self, models: Models, group=None, deterministic: bool = False):
        self.transformer, self.vae, self.source = models.transformer, models.vae.eval(), models.source
        self.deterministic = deterministic
        self.comm = Comm.of(group)
        self.vae.requires_grad_(False)
        tr = self.transformer.eval()
        config = ParallelConfig(ulysses_degree=self.comm.world_size, advanced_uaa=True)
        parallelize(tr, config, group if self.comm.world_size > 1 else None)
        if deterministic:
            fix_shapes(tr)
        vc = self.vae.config
        self.time_factor, self.space_factor = _factors(dict(vc))
        self.channels = int(tr.config.in_channels)
        if self.channels != int(vc.z_dim):
            raise ValueError(f"the transformer takes {self.channels} latent channels, the VAE makes {vc.z_dim}")
        if len(vc.latents_mean) != self.channels or len(vc.latents_std) != self.channels:
            raise ValueError(f"the VAE's latents_mean/latents_std must hold {self.channels} values")
        self._mean = torch.tensor(vc.latents_mean, dtype=torch.float32).view(-1, 1, 1, 1)
        self._std = torch.tensor(vc.latents_std, dtype=torch.float32).view(-1, 1, 1, 1)

    @property
    def text_dim(self) -> int:
        return int(self.transformer.config.text_dim)

    def latent_shape(self, cfg: SamplerConfig) -> tuple[int, int, int, int]:
        """``(C, F, H, W)`` of the sampler's clip (one-line error for sizes the VAE and patch cannot make)."""
        return latent_shape(cfg, self.channels, self.time_factor, self.space_factor,
                            self.transformer.config.patch_size)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters: every parameter of the transformer."""
        return list(self.transformer.parameters())

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the transformer's weights by name."""
        return {n: p.detach().clone() for n, p in self.transformer.named_parameters()}

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Put ``state`` (names and shapes of :meth:`weights`) into the transformer (one-line error otherwise)."""
        params = dict(self.transformer.named_parameters())
        if set(state) != set(params):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise ValueError(f"weights do not fit the transformer: missing {missing[:3]}, unexpected {extra[:3]}")
        for n, p in params.items():
            if tuple(state[n].shape) != tuple(p.shape):
                raise ValueError(f"weights do not fit the transformer: {n} is {tuple(state[n].shape)}, "
                                 f"the model's {tuple(p.shape)}")
            p.copy_(state[n])

    def velocity(self, latents: torch.Tensor, sigma: float, embeds: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity at ``latents`` ``[C, F, H, W]``, time ``sigma`` (timestep ``1000 sigma``),
        for prompt embeddings ``[1, L, D]``; autograd follows the caller's mode."""
        t = torch.tensor([1000.0 * sigma], dtype=torch.float32)
        out = self.transformer(latents.unsqueeze(0), t, embeds, return_dict=False)[0]
        return out[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[C, F, H, W]`` -> uint8 frames ``[F, H, W, 3]`` through the VAE."""
        video = self.vae.decode((latents * self._std + self._mean).unsqueeze(0), return_dict=False)[0]
        if not bool(torch.isfinite(video).all()):
            raise ValueError("the VAE decoded NaN or Inf")
        return to_uint8(video)


def sde_mean_std(x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, cfg: SamplerConfig,
                 sigmas: Sequence[float]) -> tuple[torch.Tensor, float]:
    """(mean, std) of one SDE step from ``t`` to ``t_next`` (module docstring); coefficients are Python floats."""
    dt = t_next - t
    denom = 1 - (sigmas[1] if t >= 1 else t)
    sig2 = cfg.noise_level ** 2 * t / denom
    mean = x * (1 + sig2 / (2 * t) * dt) + v * ((1 + sig2 * (1 - t) / (2 * t)) * dt)
    return mean, math.sqrt(sig2 * -dt)


def log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Log-density of ``x_next`` under N(mean, std^2), the mean over elements (float64, autograd through mean)."""
    d = x_next.double() - mean.double()
    return (-(d * d) / (2 * std * std)).mean() - math.log(std) - 0.5 * math.log(2 * math.pi)


@torch.no_grad()
def sample(policy: Policy, prompt_embeds: torch.Tensor, seed: int, cfg: SamplerConfig, prompt: int = 0,
           reward: str | Callable | None = None, ode: bool = False, decode: bool = True) -> Rollout:
    """One trajectory from ``seed``: the initial noise, then each SDE step's noise, from one CPU generator.
    ``ode``: the deterministic sampler (no noise; empty ``log_probs``). ``reward`` decodes and scores it."""
    shape = policy.latent_shape(cfg)
    g = torch.Generator().manual_seed(int(seed))
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    sig = cfg.sigmas()
    traj, lps = [x], []
    for i in range(cfg.steps):
        t, tn = sig[i], sig[i + 1]
        v = policy.velocity(x, t, prompt_embeds)
        if not ode and i in cfg.sde_steps:
            mean, std = sde_mean_std(x, v, t, tn, cfg, sig)
            x = mean + std * torch.randn(shape, generator=g, dtype=torch.float32)
            lps.append(log_prob(x, mean, std))
        else:
            x = x + v * (tn - t)
        if not bool(torch.isfinite(x).all()):  # the same latents on every rank: every rank stops here
            raise ValueError(f"seed {seed}, step {i + 1} of {cfg.steps}: the latents turned NaN or Inf")
        traj.append(x)
        beat()
    out = Rollout(prompt, int(seed), torch.stack(traj), torch.stack(lps) if lps else torch.zeros(0, dtype=torch.float64))
    if decode or reward is not None:
        out.frames = policy.decode(x)
    if reward is not None:
        out.reward = _finite(reward_fn(reward)(out.frames), out)
    return out


def _finite(value, rollout: Rollout) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"the reward of prompt {rollout.prompt}, seed {rollout.seed} is {v}")
    return v


def score(policy: Policy, rollouts: Sequence[Rollout], reward: str | Callable) -> list[float]:
    """Decode and score ``rollouts`` (the same list on every rank), rollout i on rank ``i % world``; every
    rank gets every reward, also set on the rollouts. Frames are not kept."""
    fn, comm = reward_fn(reward), policy.comm
    mine = {}
    for i in range(comm.rank, len(rollouts), comm.world_size):
        r = rollouts[i]
        mine[i] = _finite(fn(policy.decode(r.latents[-1])), r)
        beat()
    merged = {}
    for part in comm.all_gather_object(mine):
        merged.update(part)
    for i, r in enumerate(rollouts):
        r.reward = merged[i]
    return [merged[i] for i in range(len(rollouts))]
