"""`ditsp generate`: text-to-video with a local diffusers Wan pipeline folder under SP and CFG parallel.

Thin: checks the arguments and the folder before any rank starts, runs
:func:`ditsp.integrations.diffusers.generate.rank_generate` on the ranks,
prints the report (``--json`` for one object); ``--check`` runs again on one
device and compares the latents and frames.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..argtypes import finite_float, timeout_seconds
from .common import check_output_file, positive_float, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate a video with a local diffusers pipeline folder under SP")
    p.add_argument("folder", help="a saved diffusers pipeline folder (model_index.json, transformer/, vae/, scheduler/)")
    p.add_argument("--embeds", required=True,
                   help="safetensors with prompt_embeds (and negative_prompt_embeds for guidance): "
                        "the text encoder is not run")
    p.add_argument("-o", "--output", required=True, help="output video (.mp4/.mov/.mkv) or image for 1 frame")
    p.add_argument("--size", default="832x480", help="WIDTHxHEIGHT in pixels")
    p.add_argument("--frames", type=positive_int, default=81, help="pixel frames (4n+1 for Wan)")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--guidance", type=finite_float, default=5.0,
                   help="CFG scale (a finite number); 1 or less runs no unconditional pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ulysses", type=positive_int, default=1, help="Ulysses degree")
    p.add_argument("--ring", type=positive_int, default=1, help="Ring degree (USP when both are > 1)")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="run the conditional and unconditional passes at once on two halves (doubles the ranks)")
    p.add_argument("--fps", type=positive_float, default=16.0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--check", action="store_true", help="also run on one device and compare latents and frames")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per rank")
    p.add_argument("--timeout", type=timeout_seconds, default=3600.0,
                   help="seconds a rank may go without progress (a part loaded, a step done, a collective "
                        "completed) before it counts as stuck")
    p.set_defaults(func=main)
    return p


def _size(parser, text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
        if w > 0 and h > 0:
            return w, h
    except ValueError:
        pass
    parser.error(f"--size {text!r}: expected WIDTHxHEIGHT, e.g. 832x480")


def check_output(parser, path: str, frames: int) -> None:
    """The output is a video file (an image for one frame) in a writable folder: checked before any work."""
    from ..io.formats import WRITE_IMAGE_EXTS, WRITE_VIDEO_EXTS

    ext = os.path.splitext(path)[1].lower()
    if ext not in WRITE_VIDEO_EXTS and not (frames == 1 and ext in WRITE_IMAGE_EXTS):
        images = f", or for --frames 1 an image ({'/'.join(WRITE_IMAGE_EXTS)})"
        parser.error(f"--output {path}: write a video ({'/'.join(WRITE_VIDEO_EXTS)}){images}")
    check_output_file(parser, path, "--output")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    w, h = _size(parser, args.size)  # the arguments first: before diffusers is even imported
    check_output(parser, args.output, args.frames)
    if os.path.exists(args.output) and not args.overwrite:
        parser.error(f"--output {args.output} exists (pass --overwrite)")
    if args.cfg_parallel and args.guidance <= 1:
        parser.error("--cfg-parallel needs --guidance > 1 (there is no unconditional pass otherwise)")
    try:
        from ..integrations.diffusers.generate import GenerateRequest, latent_shape, load_embeds, pipeline_index
    except ImportError as e:  # diffusers missing
        parser.error(f"ditsp generate needs diffusers (pip install 'ditsp[diffusers]'): {e}")
    from ..distributed.dispatch import dispatch
    from ..integrations.diffusers import ParallelizeError

    req = GenerateRequest(folder=args.folder, embeds=args.embeds, output=args.output, height=h, width=w,
                          frames=args.frames, steps=args.steps, guidance=args.guidance, seed=args.seed,
                          ulysses=args.ulysses, ring=args.ring, cfg=2 if args.cfg_parallel else 1, fps=args.fps,
                          overwrite=args.overwrite, progress=not (args.no_progress or args.json))
    try:
        index = pipeline_index(args.folder)
        if not os.path.isfile(args.embeds):
            raise ParallelizeError(f"--embeds {args.embeds}: no such file")
        load_embeds(args.embeds, args.guidance)
        latent_shape(req, index)
    except (ParallelizeError, OSError, ValueError) as e:
        parser.error(str(e))
    ranks = req.ulysses * req.ring * req.cfg
    try:
        report = dispatch(rank_job, req, sp=ranks, threads=args.threads, timeout_s=args.timeout)[0]
        if args.check:
            from dataclasses import replace

            one = replace(req, output=None, ulysses=1, ring=1, cfg=1, progress=False)
            ref = dispatch(rank_job, one, sp=1, threads=args.threads, timeout_s=args.timeout)[0]
            report["check"] = {"latents_rel_err": _rel(report["latents"], ref["latents"]),
                               "frames_max_abs_diff": int((report["frames_u8"].int() - ref["frames_u8"].int())
                                                          .abs().max()),
                               "frames_sha256_one_device": ref["frames_sha256"]}
    except Exception as e:  # one line, non-zero exit, on every failure
        print(f"ditsp generate: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    report.pop("latents", None)
    report.pop("frames_u8", None)
    if args.json:
        print(json.dumps(report))
        return 0
    steps = report["step_s"]
    print(f"{args.folder} -> {report['output']}: {report['frames']} frame(s) {report['size'][0]}x{report['size'][1]}, "
          f"{len(steps)} steps, {ranks} rank(s): SP {report['sp']} ({report['attention']}) x CFG {report['cfg']}")
    print("per-step s: " + " ".join(f"{s:.3f}" for s in steps) + f"; decode {report['decode_s']:.3f} s")
    if "check" in report:
        c = report["check"]
        print(f"check vs one device: latents rel err {c['latents_rel_err']:.2e}, frames max abs diff "
              f"{c['frames_max_abs_diff']} (sha256 {report['frames_sha256']} vs {c['frames_sha256_one_device']})")
    return 0


def rank_job(ctx, req):
    """Every rank's generation (rank 0 also returns its frames for ``--check``)."""
    from dataclasses import replace

    from ..integrations.diffusers.generate import rank_generate

    return rank_generate(ctx, replace(req, return_frames=True))
