"""A lossless start for a one-stage VAE: its encoder a space-to-depth, its decoder the inverse.

A VAE with one 2x spatial stage and no time compression has more latent channels (16) than
pixel values per latent position (3 x 2 x 2 = 12), so it can reconstruct exactly. Trained from
He-normal weights on two CPU cores for 2800 steps it reached 29 dB on the held-out clip, under
what a restorer needs to beat bicubic; written directly, the same structure reconstructs at
about 90 dB (tests/test_vae_start.py), and the DiT then restores pixels, not a lossy code.

Every block's residual branch starts at zero (each resnet's ``conv2``, the attention's output
projection), so the main path is: ``conv_in`` copies RGB, the stride-2 ``Downsample`` gathers
each 2 x 2 block into 12 channels, a 1 x 1 shortcut lays them out for the output norm, and
``conv_out`` writes ``LATENT_SCALE`` x the pixel values into the first 12 latent channels (the
other 4 are zero). The decoder mirrors it with ``Upsample``'s depth-to-space.

The one obstacle is the GroupNorm + SiLU in front of each ``conv_out``: a group's statistics
depend on the clip. Each signal channel therefore shares its group with its own negation and a
pair of constants +-``CONSTANT`` (from biases): the group's mean is then exactly zero and its
spread the constants' (the signal moves it by under 1e-4 relative); the norm's scale undoes
that spread and its shift ``SHIFT`` keeps SiLU on its linear branch; ``conv_out`` reads half
the difference of a channel and its negation, in which the shift cancels.
"""

from __future__ import annotations

import math

import torch

from ..models.seedvr2.vae.model import VideoVAE

LATENT_SCALE = 2.0  # latent = this x pixel in [-1, 1]: natural pictures' pixels spread ~0.5, so unit-scale latents
CONSTANT = 100.0  # the +- constants that fix each output norm's spread
SHIFT = 20.0  # the output norms' shift: SiLU(z) = z to 1e-8 relative for z >= SHIFT - 2
RGB, BLOCK = 3, 4  # pixel channels, pixel positions per 2 x 2 block


def _centre(conv) -> torch.Tensor:
    """A view of ``conv``'s current-frame, centre-pixel tap (cout, cin): causal time padding is in front."""
    kt, kh, kw = conv.kernel
    return conv.weight[:, :, kt - 1, kh // 2, kw // 2]


def _clear(conv) -> None:
    conv.weight.zero_()
    conv.bias.zero_()


def check_lossless(vae: VideoVAE) -> None:
    cfg = vae.cfg
    need = RGB * BLOCK
    if len(cfg.widths) != 2 or cfg.temporal_down_blocks or cfg.in_channels != RGB or cfg.out_channels != RGB:
        raise ValueError("a lossless start needs one 2x spatial stage, no time compression and RGB in and out; "
                         f"widths {cfg.widths}, temporal blocks {cfg.temporal_down_blocks}")
    enc_group, dec_group = cfg.widths[1] // cfg.groups, cfg.widths[0] // cfg.groups
    if cfg.latent_channels < need or enc_group < 4 or enc_group % 2 or dec_group < 4 or dec_group % 2 \
            or cfg.widths[0] == cfg.widths[1] or (enc_group - 2) // 2 * cfg.groups < need \
            or (dec_group - 2) // 2 * cfg.groups < RGB:
        raise ValueError(f"a lossless start needs >= {need} latent channels and groups of an even size >= 4 "
                         f"holding {need} signals; widths {cfg.widths} in {cfg.groups} groups")


def _norm_layout(cout: int, groups: int, signals: int):
    """(channel of signal k, channel of its negation, constant channels) for ``signals`` spread over the
    groups of an output norm: each group holds as many signals as fit beside their negations and the
    constant pair, its other channels zero."""
    size = cout // groups
    per = (size - 2) // 2
    pos, neg, const = [], [], []
    for k in range(signals):
        g, i = divmod(k, per)
        pos.append(g * size + i)
        neg.append(g * size + per + i)
    for g in range(math.ceil(signals / per)):
        const.append((g * size + 2 * per, g * size + 2 * per + 1, size))
    return pos, neg, const


def _place(conv, pos, neg, const, source) -> None:
    """``conv`` (a 1 x 1 x 1 shortcut) writes input channel ``source[k]`` to ``pos[k]``, its negation to
    ``neg[k]``, and the constants' pair."""
    _clear(conv)
    w = conv.weight[:, :, 0, 0, 0]
    for k, src in enumerate(source):
        w[pos[k], src] = 1.0
        w[neg[k], src] = -1.0
    for plus, minus, _ in const:
        conv.bias[plus], conv.bias[minus] = CONSTANT, -CONSTANT


def _out_norm(norm, const) -> None:
    """The output norm undoes the constants' spread on signal channels and shifts every used group."""
    norm.weight.fill_(1.0)
    norm.bias.zero_()
    for plus, minus, size in const:
        spread = CONSTANT * math.sqrt(2.0 / size)  # std of a group of +-CONSTANT and zeros (signals aside)
        g0 = plus - plus % size
        norm.bias[g0: g0 + size] = SHIFT
        for ch in range(g0, g0 + size):
            if ch not in (plus, minus):
                norm.weight[ch] = spread


def _read(conv, pos, neg, gain: float) -> None:
    """``conv_out`` channel k = ``gain`` x half the difference of signal k's channel and its negation."""
    _clear(conv)
    w = _centre(conv)
    for k, (p, n) in enumerate(zip(pos, neg)):
        w[k, p] = 0.5 * gain
        w[k, n] = -0.5 * gain


@torch.no_grad()
def init_vae_lossless(vae: VideoVAE) -> VideoVAE:
    """Write ``vae``'s main path as space-to-depth / depth-to-space (see the module's docstring); the
    residual branches' first layers keep their weights (He-normal after :func:`init_for_training`), so
    training can start from here. The posterior's std is pinned as for training."""
    from .objective import init_for_training, pin_posterior_std

    check_lossless(vae)
    init_for_training(vae)
    cfg, enc, dec = vae.cfg, vae.encoder, vae.decoder
    need = RGB * BLOCK
    signal = [c * BLOCK + p for c in range(RGB) for p in range(BLOCK)]  # channel c * 4 + (2 i + j)

    # encoder: copy RGB, gather each 2x2 block, lay out for the output norm, read the latent
    _clear(enc.conv_in)
    for c in range(RGB):
        _centre(enc.conv_in)[c, c] = 1.0
    down = enc.down_blocks[0].downsamplers[0].conv
    _clear(down)
    for c in range(RGB):
        for i in range(2):
            for j in range(2):
                down.weight[c * BLOCK + 2 * i + j, c, 0, i, j] = 1.0
    pos, neg, const = _norm_layout(cfg.widths[1], cfg.groups, need)
    _place(enc.down_blocks[1].resnets[0].conv_shortcut, pos, neg, const, signal)
    _out_norm(enc.conv_norm_out, const)
    _read(enc.conv_out, pos, neg, LATENT_SCALE)

    # decoder: latent back to the 12 channels, depth-to-space, lay out for the output norm, read RGB
    _clear(dec.conv_in)
    for k in range(need):
        _centre(dec.conv_in)[k, k] = 1.0 / LATENT_SCALE
    up = dec.up_blocks[0].upsamplers[0]
    width = cfg.widths[1]
    _clear(up.upscale_conv)
    for c in range(RGB):
        for p in range(BLOCK):  # depth-to-space reads input channel p * width + c at position p
            up.upscale_conv.weight[p * width + c, c * BLOCK + p, 0, 0, 0] = 1.0
    _clear(up.conv)
    for c in range(RGB):
        _centre(up.conv)[c, c] = 1.0
    pos, neg, const = _norm_layout(cfg.widths[0], cfg.groups, RGB)
    _place(dec.up_blocks[1].resnets[0].conv_shortcut, pos, neg, const, list(range(RGB)))
    _out_norm(dec.conv_norm_out, const)
    _read(dec.conv_out, pos, neg, 1.0)
    return pin_posterior_std(vae)


def main(argv: list[str] | None = None) -> int:
    """``python -m ditsp.train.vae_start OUT.safetensors [--model tiny]``: the lossless VAE of a model's
    preset, written atomically (the first step of ``make train-tiny``)."""
    import argparse
    import sys
    from pathlib import Path

    from ..models.seedvr2.presets import vae_config
    from .checkpoint import export_weights

    ap = argparse.ArgumentParser(prog="python -m ditsp.train.vae_start", description=main.__doc__.splitlines()[0])
    ap.add_argument("out", help="safetensors file to write")
    ap.add_argument("--model", default="tiny", help="the model whose VAE preset to build (default: tiny)")
    a = ap.parse_args(argv)
    try:
        vae = init_vae_lossless(VideoVAE(vae_config(a.model)))
    except ValueError as e:
        print(f"python -m ditsp.train.vae_start: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    export_weights(out, vae)
    print(f"wrote {out} ({sum(p.numel() for p in vae.parameters()) / 1e6:.2f} M parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
