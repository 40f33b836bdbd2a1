"""Latent-side arithmetic of the SeedVR2 one-step restoration.

Everything between the VAE encoder and the VAE decoder except the DiT call:

* noise, drawn from a CPU generator seeded per window (``make_noise``), so
  every SP degree and every rank sees the same values whatever the device;
* the condition (the LQ latent, optionally noise-augmented) and the
  33-channel DiT input ``[noise 16 | condition 16 | mask 1]``;
* the timestep the DiT sees (1000.0, unshifted, fp32, shape ``(1,)``);
* the lerp / v-prediction Euler sampler (``x0 = noise - v`` for one step);
* the latent handed to the decoder: cast to bf16 **first**, then divided by
  the scaling factor in bf16 (dividing in fp32 and casting differs by one
  bf16 ulp on about a quarter of the elements).

Latents are channels-last ``(T', H', W', 16)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..vae.config import RELEASED, VaeConfig

SCALING_FACTOR = 0.9152  # VAE latent scaling (shift 0.0)
SCHEDULE_T = 1000.0  # continuous lerp schedule length
LATENT_CHANNELS = 16
DIT_IN_CHANNELS = 2 * LATENT_CHANNELS + 1
SEEDVR2_COND_NOISE_SCALE = 0.0  # SeedVR (v1) scripts use 0.1

_MASK64 = (1 << 64) - 1


def window_seed(seed: int, window: int) -> int:
    """Deterministic seed of temporal window ``window`` for the user's ``seed``.

    Window 0 keeps ``seed`` itself (a clip that fits in one window uses the
    plain seed); later windows get a 63-bit value mixed from both numbers, so
    neighbouring windows never share noise by accident.
    """
    if window < 0:
        raise ValueError(f"window index must be >= 0, got {window}")
    if window == 0:
        return int(seed)
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(window) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def make_generator(seed: int) -> torch.Generator:
    """A fresh CPU generator seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & _MASK64)
    return g


def make_noise(
    shape: Sequence[int],
    generator: torch.Generator | int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal noise of ``shape`` drawn on the CPU in fp32, then cast and moved.

    Drawing on the CPU makes the values independent of the accelerator, the
    SP degree and the rank: every rank that draws with the same seed gets the
    same tensor, so no broadcast is needed. ``generator`` may be a seed.
    """
    g = make_generator(generator) if isinstance(generator, int) else generator
    x = torch.randn(tuple(int(s) for s in shape), generator=g, dtype=torch.float32)
    return x.to(dtype=dtype, device=device)


def draw_noises(
    latent: torch.Tensor, generator: torch.Generator | int, *, augmentation: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(noise, aug_noise)`` shaped like ``latent``, in the reference's draw order.

    Same dtype and device as ``latent``. With ``augmentation=False`` the
    second draw is skipped (it is unused when the augmentation scale is 0).
    """
    g = make_generator(generator) if isinstance(generator, int) else generator
    noise = make_noise(latent.shape, g, dtype=latent.dtype, device=latent.device)
    aug = make_noise(latent.shape, g, dtype=latent.dtype, device=latent.device) if augmentation else None
    return noise, aug


def timestep_shift(shape: Sequence[int], vae: VaeConfig = RELEASED) -> torch.Tensor:
    """Resolution-dependent shift for a latent of ``shape = (T', H', W', ...)`` (fp32, shape (1,)).

    Pixel frames ``(T'-1)*4 + 1``, height ``H'*8``, width ``W'*8`` (the released VAE's factors); a linear
    map of the pixel volume (video) or area (single frame) anchored at
    256x256x37 -> 1 and 1280x720x145 -> 5 (video), 256x256 -> 1 and
    1024x1024 -> 3.2 (image).
    """
    s = torch.tensor([list(shape)[:3]], dtype=torch.int64)
    frames = (s[:, 0] - 1) * vae.temporal_factor + 1
    heights = s[:, 1] * vae.spatial_factor
    widths = s[:, 2] * vae.spatial_factor

    def lin(x1: float, y1: float, x2: float, y2: float) -> Callable[[torch.Tensor], torch.Tensor]:
        m = (y2 - y1) / (x2 - x1)
        b = y1 - m * x1
        return lambda x: m * x + b

    img = lin(256 * 256, 1.0, 1024 * 1024, 3.2)
    vid = lin(256 * 256 * 37, 1.0, 1280 * 720 * 145, 5.0)
    return torch.where(frames > 1, vid(heights * widths * frames), img(heights * widths))


def timestep_transform(t: float | torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Shift timestep(s) ``t`` in [0, 1000] for a latent of ``shape`` (fp32).

    Used only for the condition's noise augmentation. The reference passes the
    unbatched latent's ``shape[1:]``, i.e. ``(H', W', 16)``; callers that want
    that quirk pass that shape (see ``augment_condition``).
    """
    shift = timestep_shift(shape)
    u = torch.as_tensor(t, dtype=torch.float32).reshape(-1) / SCHEDULE_T
    u = shift * u / (1 + (shift - 1) * u)
    return u * SCHEDULE_T


def lerp_forward(x_0: torch.Tensor, x_T: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(1 - t/T) x_0 + (t/T) x_T`` with ``t`` broadcast over the trailing dims."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x_0.device)
    t = t.reshape(t.shape + (1,) * (x_0.ndim - t.ndim)) if t.ndim < x_0.ndim else t
    return (1 - t / SCHEDULE_T) * x_0 + (t / SCHEDULE_T) * x_T


def augment_condition(
    latent: torch.Tensor,
    aug_noise: torch.Tensor | None,
    cond_noise_scale: float = SEEDVR2_COND_NOISE_SCALE,
    *,
    reference_shape_quirk: bool = True,
) -> torch.Tensor:
    """The condition: the LQ latent noised to level ``1000 * cond_noise_scale`` (shifted).

    With scale 0 (SeedVR2) this returns ``latent`` itself. The shift uses the
    shape ``(H', W', 16)`` like the reference when ``reference_shape_quirk``,
    else ``(T', H', W')``.
    """
    if cond_noise_scale == 0.0:
        return latent
    if aug_noise is None:
        raise ValueError("cond_noise_scale > 0 needs an aug_noise draw")
    shape = tuple(latent.shape[1:]) if reference_shape_quirk else tuple(latent.shape[:3])
    t = timestep_transform(SCHEDULE_T * cond_noise_scale, shape)
    return lerp_forward(latent, aug_noise, t)


def dit_input(noise: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """The DiT video input ``(T', H', W', 33)``: ``[noise | condition | mask = 1]``."""
    if noise.shape != condition.shape or noise.shape[-1] != LATENT_CHANNELS:
        raise ValueError(
            f"noise {tuple(noise.shape)} and condition {tuple(condition.shape)} must both be "
            f"(T', H', W', {LATENT_CHANNELS})"
        )
    mask = torch.ones(*noise.shape[:-1], 1, dtype=noise.dtype, device=noise.device)
    return torch.cat([noise, condition.to(noise.dtype), mask], dim=-1)


def sampling_timesteps(steps: int = 1) -> torch.Tensor:
    """Uniform trailing timesteps, fp32: [1000] for 1 step, [1000, 750, 500, 250] for 4."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return torch.arange(1.0, 0.0, -1 / steps) * SCHEDULE_T


def dit_timestep(device: torch.device | str | None = None) -> torch.Tensor:
    """What the DiT sees for the one-step sampler: ``tensor([1000.0])`` fp32, unshifted."""
    return torch.tensor([SCHEDULE_T], dtype=torch.float32, device=device)


def euler_step(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One Euler step of the lerp schedule with a v-prediction ``v = x_T - x_0``, from t to s."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x_t.device)
    t = t.reshape(t.shape + (1,) * (x_t.ndim - t.ndim))
    x_0 = x_t - (t / SCHEDULE_T) * v
    x_T = x_t + (1 - t / SCHEDULE_T) * v
    return lerp_forward(x_0, x_T, torch.as_tensor(s, dtype=torch.float32).clamp(0, SCHEDULE_T))


def euler_sample(
    x_T: torch.Tensor, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int = 1
) -> torch.Tensor:
    """Run the Euler sampler from pure noise ``x_T``; ``model(x_t, t)`` returns v.

    For one step this is ``x_T - v`` computed exactly (``t / T == 1``).
    """
    ts = sampling_timesteps(steps).to(x_T.device)
    x = x_T
    for i in range(steps):
        t = ts[i : i + 1]
        v = model(x, t)
        s = ts[i + 1 : i + 2] if i + 1 < steps else torch.zeros_like(t)
        x = euler_step(x, v, t, s)
    return x


def one_step_x0(noise: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The one-step sample ``x0 = noise - v`` (computed in fp32)."""
    return noise.float() - v.float()


def scale_latent(z: torch.Tensor) -> torch.Tensor:
    """Encoder side: ``(z - 0.0) * 0.9152`` in the latent's dtype (bf16 in the reference)."""
    return (z - 0.0) * SCALING_FACTOR


def decoder_latent(x0: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decoder side: channels-last ``x0 (T', H', W', 16)`` -> ``(1, 16, T', H', W')``.

    Cast to ``dtype`` first, then ``/ 0.9152 + 0.0`` in that dtype. A single
    latent frame is returned as ``(1, 16, H', W')`` like the reference.
    """
    x = x0.to(dtype) / SCALING_FACTOR + 0.0
    x = x.permute(3, 0, 1, 2).unsqueeze(0)
    if x.shape[2] == 1:
        x = x.squeeze(2)
    return x
