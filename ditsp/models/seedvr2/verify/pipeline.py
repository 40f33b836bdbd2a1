"""The pipeline-arithmetic checker: transforms, conditioning, sampling and colour fixes against the
reference's tensors (one device)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .vectors import ClusterFactory, VectorSetError, read_config, rel_err
from ..pipeline import color_fix as cf
from ..pipeline import condition as cond
from ..pipeline.padding import reference_pad
from ..pipeline.transform import area_resize, to_uint8, to_uint8_values, transform_frames
from safetensors.torch import load_file


def check_pipeline(directory: str | os.PathLike, degrees: Sequence[int] = (1,),
                   cluster_factory: ClusterFactory | None = None) -> dict:
    """Check a pipeline-arithmetic vector set (transform, padding, condition, sampler, decoder latent,
    colour fix, uint8) at the tolerances its README states: resize 1e-5, transform 2e-5, colour fix
    1e-6 (absolute), everything else exact. Nothing here depends on the SP degree: one run is reported,
    and its ``rel_err`` is the worst error as a fraction of that check's tolerance (an exact check
    that differs counts as infinity), so the bar is 1."""

    directory = os.fspath(directory)
    config = read_config(directory)
    io = load_file(str(Path(directory) / "io.safetensors"))
    errs: dict[str, float] = {}

    def close(name, a, b, tol):
        if tuple(a.shape) != tuple(b.shape):
            errs[name] = float("inf")
            return
        e = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        errs[name] = e / tol

    def exact(name, ok):
        errs[name] = 0.0 if ok else float("inf")

    for case in config.get("transform", {}).get("cases", []):
        n = case["name"]
        x = io[f"{n}.in_u8"]
        close(f"{n}.resized", area_resize(x.float() / 255.0, case["res_h"], case["res_w"]), io[f"{n}.resized"], 1e-5)
        close(f"{n}.out", transform_frames(x, case["res_h"], case["res_w"]), io[f"{n}.out"], 2e-5)
    for sp in (1, 2, 4):
        if f"pad.out_sp{sp}" in io:
            exact(f"pad.out_sp{sp}", torch.equal(reference_pad(io["pad.in"], sp), io[f"pad.out_sp{sp}"]))
    for case in config.get("condition", {}).get("cases", []):
        n = case["name"]
        latent, noise, v = io[f"{n}.latent"], io[f"{n}.noise"], io[f"{n}.v"]
        got_noise, got_aug = cond.draw_noises(latent, case["seed"])
        exact(f"{n}.noise", torch.equal(got_noise, noise) and torch.equal(got_aug, io[f"{n}.aug_noise"]))
        scale = 0.1 if "inference_seedvr_" in case["script"] else cond.SEEDVR2_COND_NOISE_SCALE
        c = cond.augment_condition(latent, io[f"{n}.aug_noise"], scale)
        exact(f"{n}.dit_vid_in", torch.equal(cond.dit_input(noise, c), io[f"{n}.dit_vid_in"]))
        x0 = cond.one_step_x0(noise, v)
        exact(f"{n}.x0", torch.equal(x0, io[f"{n}.x0"]))
        exact(f"{n}.vae_decode_in", torch.equal(cond.decoder_latent(x0).float(), io[f"{n}.vae_decode_in"]))
    if "euler4.x_T" in io:
        calls = iter(range(4))
        x0 = cond.euler_sample(io["euler4.x_T"], lambda x, t: io["euler4.v"][next(calls)], steps=4)
        exact("euler4.x0", torch.equal(x0, io["euler4.x0"]))
    for n in ("cf0", "cf1"):
        if f"{n}.content" in io:
            content, style = io[f"{n}.content"], io[f"{n}.style"]
            close(f"{n}.wavelet", cf.apply_color_fix(content, style, "wavelet"), io[f"{n}.wavelet"], 1e-6)
            close(f"{n}.wavelet_bf16content", cf.apply_color_fix(content.bfloat16(), style, "wavelet"),
                  io[f"{n}.wavelet_bf16content"], 1e-6)
            close(f"{n}.adain", cf.apply_color_fix(content, style, "adain"), io[f"{n}.adain"], 1e-6)
    if "u8.in" in io:
        exact("u8.out", torch.equal(to_uint8_values(io["u8.in"]), io["u8.out"]))
    if "post.decoded" in io:
        ori = io["post.u8_fp32decoded"].shape[0]
        decoded = io["post.decoded"][:ori]
        style = io["post.input_CTHW"].permute(1, 0, 2, 3)
        exact("post.u8_fp32decoded", torch.equal(to_uint8(cf.apply_color_fix(decoded, style)), io["post.u8_fp32decoded"]))
    if not errs:
        raise VectorSetError(f"{directory}: no pipeline vectors found in io.safetensors")
    worst = max(errs, key=errs.get)
    run = {"degree": 1, "path": f"pipeline arithmetic, {len(errs)} checks", "rel_err": errs[worst],
           "ranks_agree": True, "errors": errs}
    run["pass"] = errs[worst] <= 1.0
    if not run["pass"]:
        run["first_divergence"] = worst
    return {"kind": "pipeline", "dir": directory, "threshold": 1.0, "ref_max_abs": 1.0, "runs": [run],
            "pass": run["pass"]}
