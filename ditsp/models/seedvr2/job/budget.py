"""Per-rank memory of a restoration, estimated before any work, and what would fit instead.

The estimate adds the DiT weights (every rank holds all of them), the DiT's
largest per-layer activations for this rank's share of the tokens, the
window's latent-side tensors, and the VAE's modelled peak in the mode it will
run (:mod:`.vae.memory`). It is a model, not a measurement: `ditsp upscale
--json` reports the measured peaks next to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ....dtypes import DTYPES, itemsize
from ....memory import available_bytes  # noqa: F401 - re-exported for the upscale command
from ..vae.modes import AUTO, AUTO_ORDER, BY_NAME, FALLBACK
from ....windows.capacity import Capacities, Shares, proportional_split
from ..presets import dit_config, vae_config
from ....weights.sizing import WeightBytes
from ..pipeline.padding import padded_length
from ..vae.memory import choose_mode
from ..vae.memory import estimate as vae_estimate
from ....cpu.settings import ENV as CPU_ENV
from .weight_memory import dit_weights

GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    dit_weights: int  # as kept: quantized weights at their stored size
    dit_activations: int
    latents: int
    vae: int
    vae_mode: str
    dit_dequant: int = 0  # one layer's dequantized weight (quantized formats only)
    weights_fmt: str = ""
    vae_filters: int = 0  # part of ``vae``: the Winograd convs' cached filters (CPU, fast policy)

    @property
    def total(self) -> int:
        return self.dit_weights + self.dit_dequant + self.dit_activations + self.latents + self.vae

    def describe(self) -> str:
        fmt = f" {self.weights_fmt}" if self.weights_fmt else ""
        dq = f" + dequant buffer {self.dit_dequant / GiB:.2f}" if self.dit_dequant else ""
        return (f"{self.total / GiB:.2f} GiB per rank (DiT weights{fmt} {self.dit_weights / GiB:.2f}{dq}, DiT "
                f"activations {self.dit_activations / GiB:.2f}, latents {self.latents / GiB:.2f}, VAE {self.vae_mode} "
                f"{self.vae / GiB:.2f}{f' incl. cached conv filters {self.vae_filters / GiB:.2f}' if self.vae_filters else ''})")


@dataclass(frozen=True)
class _Window:
    """The sizes of one window that every estimate reads."""

    pixels: tuple[int, int, int]  # (T, H, W), T padded to the VAE's time factor
    latent: tuple[int, int, int]  # (t, h, w)
    tokens: int  # the DiT's tokens over the whole window
    per_token: int  # DiT activation bytes per token: residual, normed input, q/k/v, attention out, two MLP hidden
    latents: int  # latent, noise, x0, decoder input in fp32, and the DiT's 2c+1-channel input


def _window(model: str, dtype: str, frames: int, out_hw: tuple[int, int]) -> _Window:
    cfg, vcfg = dit_config(model), vae_config(model)
    T = padded_length(frames, vcfg.temporal_factor)
    H, W = out_hw
    t, h, w = vcfg.latent_shape(T, H, W)
    _, ph, pw = cfg.patch_size
    c = vcfg.latent_channels
    return _Window((T, H, W), (t, h, w), t * (h // ph) * (w // pw),
                   (6 * cfg.vid_dim + 2 * cfg.mlp_hidden) * itemsize(dtype), int(t * h * w * (c * 4 + 2 * c + 1) * 4))


def estimate(model: str, dtype: str, frames: int, out_hw: tuple[int, int], sp: int, vae_mode: str = "auto",
             budget: int | None = None, vae_chunk: int = 1, weights: WeightBytes | None = None,
             winograd_filters: bool = False, vae_backend: str = "cuda") -> Estimate:
    """Modelled peak bytes per rank for one window of ``frames`` frames at output size ``out_hw``.

    ``weights``: the DiT's weights as kept (:func:`.weight_memory.dit_weights`: stored format and
    dequantization buffer); default: every parameter in ``dtype``. ``winograd_filters``: count the
    VAE's cached Winograd filters (:func:`.vae.memory.counts_winograd`: a CPU run, fast policy).
    ``vae_backend``: what runs the VAE's convs, and how (:func:`.vae.memory.backend_of`). With
    ``vae_mode`` auto the VAE's mode is chosen against what ``budget`` leaves after the DiT's weights,
    activations and the latents, never against the whole budget (so more memory never turns a run that
    fits into a refusal)."""

    cfg, vcfg, e = dit_config(model), vae_config(model), itemsize(dtype)
    win = _window(model, dtype, frames, out_hw)
    T, H, W = win.pixels
    dit_act = int(-(-win.tokens // sp) * win.per_token)  # this rank's share (balanced plans)
    latents = win.latents
    if weights is None:
        kept, buffer, fmt = cfg.param_count() * e, 0, ""
    else:
        kept, buffer, fmt = weights.kept, weights.buffer, weights.fmt
    left = None if budget is None else budget - (kept + buffer + dit_act + latents)
    mode, _ = choose_vae_mode(model, dtype, (T, H, W), sp, vae_mode, left, vae_chunk,
                              winograd_filters=winograd_filters, vae_backend=vae_backend)
    v = max((vae_estimate(vcfg, op, (T, H, W), sp, mode, DTYPES[dtype], vae_chunk, winograd_filters=winograd_filters,
                          backend=vae_backend)
             for op in ("encode", "decode")), key=lambda m: m.total)
    return Estimate(kept, dit_act, latents, int(v.total), mode, buffer, fmt, v.filters)


def rank_estimates(model: str, dtype: str, frames: int, out_hw: tuple[int, int], caps: Capacities,
                   vae_mode: str = "auto", vae_chunk: int = 1, weights: WeightBytes | None = None,
                   winograd_filters: bool = False, vae_backend: str = "cuda",
                   ) -> tuple[tuple[Estimate, ...], tuple[int, ...] | None]:
    """Per rank of ``caps`` (its memory the rank's budget, None: no budget), the modelled peak of one window,
    and the DiT token caps the window planners must keep (None: none needed).

    Equal ranks: :func:`estimate` for every rank, no caps. Unequal ones: the VAE's height slabs and the DiT's
    tokens in proportion to speed; ``auto`` takes the first mode of the VAE's order (exact ones, then tiled)
    for which every rank's VAE peak plus its share of the DiT fits its own budget, where the DiT's tokens
    may move off a rank whose memory is short onto ranks with room (each rank's cap: the tokens what its
    budget leaves after the weights, the latents and its VAE peak holds). When no mode fits, the split in
    proportion to speed in the requested mode (``auto``: tiled), so the estimate shows what does not fit."""
    n = caps.world_size
    budgets = caps.memory
    if caps.even and caps.uniform_memory:
        e = estimate(model, dtype, frames, out_hw, n, vae_mode, None if budgets is None else budgets[0], vae_chunk,
                     weights=weights, winograd_filters=winograd_filters, vae_backend=vae_backend)
        return (e,) * n, None
    cfg, vcfg = dit_config(model), vae_config(model)
    e = itemsize(dtype)
    win = _window(model, dtype, frames, out_hw)
    (T, H, W), (t, h, _) = win.pixels, win.latent
    tokens, per_token, latents = win.tokens, win.per_token, win.latents
    kept, buffer, fmt = (cfg.param_count() * e, 0, "") if weights is None else (weights.kept, weights.buffer,
                                                                              weights.fmt)
    rows = proportional_split(h, caps.speed, minimum=1)  # the VAE's slabs (vae/layouts.py SlabLayout)
    order = AUTO_ORDER + FALLBACK if vae_mode == AUTO else (vae_mode,)

    def vae_peaks(mode: str) -> list:
        slab = BY_NAME[mode].slab
        return [max((vae_estimate(vcfg, op, (T, H, W), n, mode, DTYPES[dtype], vae_chunk, rows=rows[r] if slab else None,
                                  winograd_filters=winograd_filters, backend=vae_backend) for op in ("encode", "decode")),
                    key=lambda m: m.total) for r in range(n)]

    def estimates(mode, vae, dit_tokens):
        return tuple(Estimate(kept, int(k * per_token), latents, int(v.total), mode, buffer, fmt, v.filters)
                     for k, v in zip(dit_tokens, vae))

    by_speed = proportional_split(tokens, caps.speed)
    for mode in order:
        if t < BY_NAME[mode].min_latent_frames:
            continue
        vae = vae_peaks(mode)
        if budgets is None:
            return estimates(mode, vae, by_speed), None
        room = [int(b - kept - buffer - latents - int(v.total)) // per_token for b, v in zip(budgets, vae)]
        if min(room) < 0 or sum(room) < tokens:
            continue
        targets = Shares(caps.speed, tuple(room)).targets(tokens)  # in proportion to speed, none above its room
        split = [int(x) for x in targets]
        for r in sorted(range(n), key=lambda r: (-(targets[r] - split[r]), r))[:tokens - sum(split)]:
            split[r] += 1
        if all(k <= r for k, r in zip(split, room)):
            return estimates(mode, vae, split), tuple(room)
    mode = "tiled" if vae_mode == AUTO else vae_mode
    return estimates(mode, vae_peaks(mode), by_speed), None


def choose_vae_mode(model: str, dtype: str, shape: tuple[int, int, int], sp: int, vae_mode: str, budget,
                    vae_chunk: int = 1, winograd_filters: bool = False, vae_backend: str = "cuda",
                    rows=None) -> tuple[str, str]:
    """(mode, why) of a clip of padded pixel ``shape`` (T, H, W): ``vae_mode`` itself, or what ``auto`` means
    (:func:`.vae.memory.choose_mode`) against ``budget``, the bytes left for the VAE (ranks of unequal
    capacity: one per rank, with ``rows`` each rank's latent slab rows); tiled when nothing fits (the
    estimate then says the job does not fit)."""
    if vae_mode != AUTO:
        return vae_mode, "requested"
    if budget is not None:
        budget = max(0, budget) if isinstance(budget, int) else [max(0, b) for b in budget]
    try:
        c = choose_mode(vae_config(model), shape, sp, budget, DTYPES[dtype],
                        vae_chunk, winograd_filters=winograd_filters, backend=vae_backend, rows=rows)
        return c.mode, c.report
    except MemoryError as e:
        return "tiled", f"auto: {e}"


def suggestions(model: str, dtype: str, frames: int, out_hw, sp: int, vae_mode: str, budget: int,
                window_frames: int, weights: WeightBytes | None = None, winograd_filters: bool = False,
                vae_backend: str = "cuda") -> list[str]:
    """What would fit ``budget`` per rank: more ranks, another VAE mode, shorter windows, smaller weights,
    no Winograd filters."""
    fit = functools.partial(estimate, winograd_filters=winograd_filters, vae_backend=vae_backend)
    out = []
    for more in (2 * sp, 4 * sp, 8 * sp):
        e = fit(model, dtype, frames, out_hw, more, vae_mode, budget, weights=weights)
        if e.total <= budget:
            out.append(f"--sp {more} ({e.total / GiB:.1f} GiB per rank)")
            break
    for mode in ("height+chunks", "chunked", "tiled"):
        if mode != vae_mode:
            e = fit(model, dtype, frames, out_hw, sp, mode, budget, weights=weights)
            if e.total <= budget:
                out.append(f"--vae-mode {mode} ({e.total / GiB:.1f} GiB per rank"
                           f"{', approximate' if mode == 'tiled' else ''})")
                break
    f, k = frames, vae_config(model).temporal_factor
    while f > k + 1:
        f = max(k + 1, ((f // 2 - 1) // k) * k + 1)
        e = fit(model, dtype, f, out_hw, sp, vae_mode, budget, weights=weights)
        if e.total <= budget:
            out.append(f"--window-frames {f} ({e.total / GiB:.1f} GiB per rank)")
            break
    if dtype == "fp32":
        e = fit(model, "bf16", frames, out_hw, sp, vae_mode, budget)
        if e.total <= budget:
            out.append(f"--dtype bf16 ({e.total / GiB:.1f} GiB per rank)")
    out += _smaller_weights(model, dtype, frames, out_hw, sp, vae_mode, budget, weights, fit)
    if winograd_filters:
        e = estimate(model, dtype, frames, out_hw, sp, vae_mode, budget, weights=weights, vae_backend=vae_backend)
        if e.total <= budget:
            out.append(f"{CPU_ENV['vae_winograd']}=0 ({e.total / GiB:.1f} GiB per rank, a slower VAE)")
    return out


def rank_suggestions(model: str, dtype: str, frames: int, out_hw, caps: Capacities, vae_mode: str,
                     weights: WeightBytes | None = None, winograd_filters: bool = False,
                     vae_backend: str = "cuda") -> list[str]:
    """What would fit every rank of ``caps`` its own budget (:func:`rank_estimates`): another VAE mode,
    shorter windows, bf16, smaller weights; each with the tightest rank's figure."""
    fit = functools.partial(rank_estimates, caps=caps, vae_chunk=1, winograd_filters=winograd_filters,
                            vae_backend=vae_backend)

    def fits(frames_, mode, dtype_=dtype, weights_=weights) -> str | None:
        ests, _ = fit(model, dtype_, frames_, out_hw, vae_mode=mode, weights=weights_)
        if all(e.total <= b for e, b in zip(ests, caps.memory)):
            return ", ".join(f"{e.total / GiB:.1f}" for e in ests) + " GiB"
        return None

    out = []
    for mode in ("height+chunks", "chunked", "tiled"):
        if mode != vae_mode and (got := fits(frames, mode)):
            out.append(f"--vae-mode {mode} ({got}{', approximate' if mode == 'tiled' else ''})")
            break
    f, k = frames, vae_config(model).temporal_factor
    while f > k + 1:
        f = max(k + 1, ((f // 2 - 1) // k) * k + 1)
        if got := fits(f, vae_mode):
            out.append(f"--window-frames {f} ({got})")
            break
    if dtype == "fp32" and (got := fits(frames, vae_mode, "bf16", None)):
        out.append(f"--dtype bf16 ({got})")
    if dtype in ("bf16", "fp32"):
        now = weights.kept if weights is not None else dit_config(model).param_count() * itemsize(dtype)
        for fmt, hint in (("fp8_e4m3fn", "--weights-dtype fp8"), ("Q8_0", "a Q8_0 GGUF --dit"),
                          ("Q4_K_M", "a Q4_K_M GGUF --dit")):
            w = dit_weights(model, dtype, fmt=fmt)
            if w.kept < now and (got := fits(frames, vae_mode, dtype, w)):
                out.append(f"{hint} ({got})")
                break
    return out


def _smaller_weights(model, dtype, frames, out_hw, sp, vae_mode, budget, weights, fit) -> list[str]:
    """The first smaller DiT format that fits: FP8 at load, then a Q8_0 or Q4_K_M GGUF file."""

    if dtype not in ("bf16", "fp32"):
        return []
    now = weights.kept if weights is not None else dit_config(model).param_count() * itemsize(dtype)
    for fmt, hint in (("fp8_e4m3fn", "--weights-dtype fp8"), ("Q8_0", "a Q8_0 GGUF --dit"),
                      ("Q4_K_M", "a Q4_K_M GGUF --dit")):
        w = dit_weights(model, dtype, fmt=fmt)
        if w.kept >= now:
            continue
        e = fit(model, dtype, frames, out_hw, sp, vae_mode, budget, weights=w)
        if e.total <= budget:
            return [f"{hint} ({e.total / GiB:.1f} GiB per rank)"]
    return []
