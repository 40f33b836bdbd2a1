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

import torch

from ...dtypes import DTYPES, itemsize
from ...memory import available_bytes  # noqa: F401 - re-exported for the upscale command
from .nadit.config import get_config
from .vae.config import PRESETS as VAE_PRESETS
from .vae.modes import AUTO
from .weights import MODELS
from ...weights.sizing import WeightBytes
from .pipeline.padding import padded_length
from .vae.memory import choose_mode
from .vae.memory import estimate as vae_estimate
from .vae.winograd import ENV as WINOGRAD_ENV
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


def estimate(model: str, dtype: str, frames: int, out_hw: tuple[int, int], sp: int, vae_mode: str = "auto",
             budget: int | None = None, vae_chunk: int = 1, weights: WeightBytes | None = None,
             winograd_filters: bool = False, vae_backend: str = "cuda") -> Estimate:
    """Modelled peak bytes per rank for one window of ``frames`` frames at output size ``out_hw``.

    ``weights``: the DiT's weights as kept (:func:`.weight_memory.dit_weights`: stored format and
    dequantization buffer); default: every parameter in ``dtype``. ``winograd_filters``: count the
    VAE's cached Winograd filters (:func:`.vae.memory.counts_winograd`: a CPU run, fast policy).
    ``vae_backend``: what runs the VAE's convs, and how (:func:`.vae.memory.backend_of`)."""

    cfg = get_config(model)
    vcfg = VAE_PRESETS[MODELS[model]]
    e = itemsize(dtype)
    T = padded_length(frames)
    H, W = out_hw
    t, h, w = vcfg.latent_shape(T, H, W)
    tokens = -(-t * (h // 2) * (w // 2) // sp)  # this rank's share (balanced plans)
    hid = cfg.mlp_hidden
    # Per layer: residual, normed input, q/k/v, attention out, two MLP hidden tensors; text is small.
    dit_act = tokens * (6 * cfg.vid_dim + 2 * hid) * e
    latents = t * h * w * (16 * 4 + 33) * 4  # latent, noise, x0, decoder input in fp32 + the 33-channel input
    vdtype = DTYPES[dtype]
    shape = (T, H, W)
    mode = vae_mode
    if mode == AUTO:  # what the restoration's VAE will pick (the one meaning of auto); tiled if nothing fits
        try:
            mode = choose_mode(vcfg, shape, sp, budget, vdtype, vae_chunk, winograd_filters=winograd_filters,
                               backend=vae_backend).mode
        except MemoryError:
            mode = "tiled"
    v = max((vae_estimate(vcfg, op, shape, sp, mode, vdtype, vae_chunk, winograd_filters=winograd_filters,
                          backend=vae_backend)
             for op in ("encode", "decode")), key=lambda m: m.total)
    if weights is None:
        return Estimate(cfg.param_count() * e, int(dit_act), int(latents), int(v.total), mode, vae_filters=v.filters)
    return Estimate(weights.kept, int(dit_act), int(latents), int(v.total), mode, weights.buffer, weights.fmt,
                    v.filters)


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
    f = frames
    while f > 5:
        f = max(5, ((f // 2 - 1) // 4) * 4 + 1)
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
            out.append(f"{WINOGRAD_ENV}=0 ({e.total / GiB:.1f} GiB per rank, a slower VAE)")
    return out


def _smaller_weights(model, dtype, frames, out_hw, sp, vae_mode, budget, weights, fit) -> list[str]:
    """The first smaller DiT format that fits: FP8 at load, then a Q8_0 or Q4_K_M GGUF file."""

    if dtype not in ("bf16", "fp32"):
        return []
    now = weights.kept if weights is not None else get_config(model).param_count() * itemsize(dtype)
    for fmt, hint in (("fp8_e4m3fn", "--weights-dtype fp8"), ("Q8_0", "a Q8_0 GGUF --dit"),
                      ("Q4_K_M", "a Q4_K_M GGUF --dit")):
        w = dit_weights(model, dtype, fmt=fmt)
        if w.kept >= now:
            continue
        e = fit(model, dtype, frames, out_hw, sp, vae_mode, budget, weights=w)
        if e.total <= budget:
            return [f"{hint} ({e.total / GiB:.1f} GiB per rank)"]
    return []
