"""`ditsp upscale INPUT -o OUTPUT`: restore a video, an image or a folder of frames with SeedVR2 under SP.

Everything that can be checked before ranks start is checked, with a
one-line error, by the restoration request (``ditsp/models/seedvr2/job/request.py``,
shared with `ditsp serve`): the input opens and has frames, the output can be
written (and is not overwritten without ``--overwrite``), the model has weights,
the options make sense, and the plan's modelled memory fits each rank. Every
flag's choices and defaults come from that module.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ..argtypes import timeout_seconds
from ..errors import one_line
from ..io.formats import WRITE_IMAGE_EXTS, WRITE_VIDEO_EXTS
from ..models.seedvr2.job import request
from .common import add_capacity_args, add_compile_arg, add_deterministic_arg

_d = request.default  # every flag's default is the request's own


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("upscale", help="restore a video or image with SeedVR2 (DiT under window SP, VAE sharded)",
                       description=__doc__.splitlines()[0])
    p.add_argument("input", help="video file, image, or folder of frames")
    p.add_argument("-o", "--output", required=True,
                   help=f"output {'/'.join(WRITE_VIDEO_EXTS)} (video) or {'/'.join(WRITE_IMAGE_EXTS)} (image)")
    p.add_argument("--sp", type=int, default=_d("sp"), help="sequence-parallel degree: local ranks to spawn (torchrun: joins)")
    p.add_argument("--model", default=_d("model"), choices=request.MODELS,
                   help="DiT and VAE preset (tiny: the small restorer trained in the repo, its weights shipped with "
                        "the package; seedvr2-*: the released models, given --dit and --vae)")
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights where no checkpoint is given (a smoke test or benchmark, not a "
                        "restoration; the report says so)")
    p.add_argument("--dit", metavar="CKPT", help="DiT checkpoint (.pth/.safetensors/.gguf; fp16/bf16/fp32, FP8 or GGUF), "
                                                 "e.g. seedvr2_ema_3b.pth, seedvr2_ema_3b_fp8_e4m3fn.safetensors")
    p.add_argument("--vae", metavar="CKPT", help="VAE checkpoint (.pth/.safetensors/.gguf), e.g. ema_vae.pth")
    p.add_argument("--text-embedding", metavar="FILE", help="text embedding, e.g. pos_emb.pt")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--resolution", metavar="WxH",
                      help="target area W*H, aspect kept (default: the model's; 1280x720 for the released models)")
    size.add_argument("--scale", type=float,
                      help="target area = (scale x width) x (scale x height) (default: the model's; 2 for tiny)")
    size.add_argument("--size", metavar="WxH", help="exact output size (then cropped to the model's multiple)")
    p.add_argument("--seed", type=int, default=_d("seed"))
    p.add_argument("--color-fix", default=_d("color_fix"), choices=request.COLOR_FIX_CHOICES,
                   help="colour correction against the input (default: the model's own: wavelet, none for tiny)")
    p.add_argument("--window-frames", type=int, default=_d("window_frames"),
                   help="temporal window in frames (kn+1, k the VAE's time factor: 4 for the released models, "
                        "1 for tiny); 0 = the whole clip in one window")
    p.add_argument("--overlap", type=int, default=_d("overlap"),
                   help="frames shared (and stitched) by consecutive windows")
    p.add_argument("--stitch", default=_d("stitch"), choices=request.STITCHES,
                   help="how consecutive windows join: cosine (decoded pixels cross-faded with a raised cosine), "
                        "hann (each window's pixels weighted by a Hann window over its length), latent (the "
                        "windows' latents blended, the clip decoded once as one causal stream)")
    p.add_argument("--vae-mode", default=_d("vae_mode"), choices=request.VAE_MODES,
                   help="auto: the first exact mode that fits what the budget leaves after the DiT "
                        "(ditsp/models/seedvr2/vae/modes.py)")
    p.add_argument("--vae-chunk", type=int, default=_d("vae_chunk"),
                   help="latent frames per causal chunk in chunked VAE modes")
    p.add_argument("--dtype", default=_d("dtype"), choices=request.DTYPE_NAMES,
                   help="default: bf16 for seedvr2-*, fp32 for tiny")
    p.add_argument("--weights-dtype", default=_d("weights_dtype"), choices=request.WEIGHTS_DTYPES,
                   help="how the rank keeps float weights: as stored (cast to --dtype; FP8/GGUF files stay "
                        "quantized) or quantized to FP8 at load; dequantized per layer for the arithmetic")
    p.add_argument("--weights-read", default=_d("weights_read"), choices=request.WEIGHTS_READS,
                   help="how the SP ranks read the checkpoints: each from its own memory map (every-rank, the "
                        "default: measured faster on one host) or one rank sending the others each tensor as "
                        "stored (one-reader: the file is read once, e.g. from a slow network mount)")
    p.add_argument("--planner", default=_d("planner"), choices=request.PLANNERS,
                   help="window planner of the DiT (default: the SP path is chosen by the cost model)")
    p.add_argument("--max-memory", type=float, metavar="GiB",
                   help="per-rank memory budget (default: free memory / local ranks)")
    add_capacity_args(p, detected=True)
    p.add_argument("--force", action="store_true", help="run even if the memory estimate exceeds the budget")
    p.add_argument("--fps", type=float, help="output frame rate (default: the input's; 24 for a folder of frames)")
    p.add_argument("--crf", type=int, default=_d("crf"), help="H.264 quality (0-51, lower is better)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--threads", type=int, default=_d("threads"), help="compute threads per rank")
    p.add_argument("--timeout", type=timeout_seconds, default=3600.0,
                   help="seconds a rank may go without progress (no collective, no stage done) before it counts as stuck")
    p.add_argument("--plot", metavar="FILE.png", help="picture of input vs output frames and the stage timeline")
    add_deterministic_arg(p)
    add_compile_arg(p)
    p.add_argument("--check", action="store_true",
                   help="also restore on one device (to a temporary file) and report whether the frames match")
    p.add_argument("--reference", metavar="CLEAN", help="clean video/image/frame folder of the output's size: "
                                                         "PSNR and SSIM of the restored frames and of bicubic")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
    return p


def _fail(msg: str) -> int:
    print(f"ditsp upscale: error: {one_line(msg)}", file=sys.stderr)
    return 1


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..distributed.launcher import RankError
    from ..distributed.dispatch import dispatch
    from ..models.seedvr2.job.restore import format_report, plot_report, rank_upscale, summarize

    try:
        opts = request.from_args(args)
        checked = request.check(opts)
        req, info = checked.req, checked.info
        if args.plot:
            folder = os.path.dirname(os.path.abspath(args.plot))
            if not os.path.isdir(folder):
                raise ValueError(f"--plot {args.plot}: folder {folder} does not exist")
        mem_line = request.check_memory(checked, opts)
    except (ValueError, MemoryError) as e:
        return _fail(str(e))
    from ..distributed.torchrun import under_torchrun
    from ..memory import check_local_cores

    crowded = None if under_torchrun() else check_local_cores(args.sp, args.threads)
    if crowded:
        print(f"ditsp upscale: warning: {crowded}", file=sys.stderr)
    if not args.json:  # what the job will do, before it starts
        if req.weights.random:
            print("RANDOM WEIGHTS: seeded random weights (--random-weights), a smoke test, not a restoration")
        print(f"{args.input}: {info.kind}, {req.plan.describe()}; {mem_line}")
    try:
        # local ranks forked from this process (where safe): they start with its imports, not their own
        results = dispatch(rank_upscale, req, sp=args.sp, threads=args.threads, timeout_s=args.timeout, fork=True)
    except RankError as e:  # its first line names the cause on each failed rank
        return _fail(str(e).splitlines()[0])
    except (ValueError, MemoryError, OSError) as e:
        return _fail(str(e))
    finally:  # a rank killed or hung while writing leaves its hidden temporary file: the ranks are gone now
        _sweep_output(args.output)
    if "output" not in results[0]:  # a torchrun rank other than 0: rank 0 reports
        return 0
    summary = summarize(results)
    summary["memory_estimate"] = mem_line
    if args.check:
        summary["parity"] = parity_vs_one_device(req, summary, args.threads)
        summary["check"] = check_verdict(summary["parity"], req.sp, req.deterministic)
    if args.plot:
        plot_report(summary, args.plot)
    if args.reference:  # quality figures against the clean original (ditsp.io.quality)
        try:
            summary["quality"] = _quality(args, summary)
        except (ValueError, OSError) as e:
            return _fail(f"--reference {args.reference}: {e}")
    summary.pop("samples", None)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_report(summary))
        if args.check:
            print(format_parity(summary["parity"], req.sp))
        if args.plot:
            print(f"wrote {args.plot}")
        if args.reference:
            from ..io.quality import format_report as format_quality

            print(format_quality(summary["quality"]))
    if args.check and summary["check"] != "passed":  # a failed check is a failed run (the output is kept)
        return _fail(f"--check {summary['check']}")
    return 0


def _quality(args, summary: dict) -> dict:
    """PSNR/SSIM of the written frames and of bicubic against ``--reference``; with ``--plot`` also
    ``<plot>-reference.png`` (input, restored, clean original)."""
    from ..io import quality

    from ..io.probe import probe

    restored, source = quality.read_frames(args.output), quality.read_frames(args.input)
    reference = quality.read_frames(args.reference)
    out = probe(args.output)
    baseline = quality.bicubic(source[: len(restored)], restored.shape[1:3])
    if out.kind == "video":  # both as delivered: the bicubic frames through the output's encoder too
        baseline = quality.through_video(baseline, out.fps, args.crf)
    q = quality.report(restored, source, reference, summary.get("windows"), baseline=baseline)
    q["baseline"] = f"bicubic written as the output, H.264 crf {args.crf}" if out.kind == "video" else "bicubic"
    if args.plot:
        q["picture"] = str(Path(args.plot).with_name(Path(args.plot).stem + "-reference.png"))
        quality.plot_compare(source, restored, reference, q["picture"], q, baseline=baseline)
    return q


def _sweep_output(output: str) -> None:
    from ..io.write import sweep_temps

    sweep_temps(os.path.dirname(os.path.abspath(output)), output)


# Under the fast kernel-shape policy SP equals one device within float tolerance (~1e-6 relative), so a
# pixel may round to the neighbouring uint8 level and a lossy encoder may then code a block differently:
# the check passes when the frames agree to at least this PSNR (far above any visible difference).
FAST_MIN_PSNR_DB = 40.0


def check_verdict(parity: dict, sp: int, deterministic: bool = True) -> str:
    """``"passed"``, or ``"failed: ..."`` saying how the SP frames differ from one device's: under the
    deterministic policy only equal bytes pass; under the fast one frames within ``FAST_MIN_PSNR_DB``."""
    if parity["same_frames"]:
        return "passed"
    psnr = parity.get("psnr_vs_one_device")
    if not deterministic and psnr is not None and psnr >= FAST_MIN_PSNR_DB:
        return "passed"
    return (f"failed: SP={sp} frames differ from one device's (max abs difference after encoding "
            f"{parity.get('max_abs_diff_decoded')}, PSNR {psnr} dB)")


def parity_vs_one_device(req, summary: dict, threads: int) -> dict:
    """Restore again on one device into a temporary file; compare the uint8 frames (digest, then values)."""
    import tempfile
    from dataclasses import replace

    import torch

    from ..distributed.dispatch import dispatch
    from ..io.probe import open_media
    from ..models.seedvr2.job.restore import rank_upscale

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(req.output))) as tmp:
        ref_out = os.path.join(tmp, "one-device" + Path(req.output).suffix)
        one = replace(req.plan, sp=1)  # the same plan on one device: its windows and VAE modes are kept
        ref = dispatch(rank_upscale, replace(req, output=ref_out, plan=one, progress=False, sample_frames=0), sp=1,
                       threads=threads)[0]
        out = {"same_frames": ref["sha256"] == summary["sha256"], "one_device_sha256": ref["sha256"]}
        if not out["same_frames"]:  # say how far apart, from the written files
            a = torch.cat(list(open_media(req.output)[1])).int()
            b = torch.cat(list(open_media(ref_out)[1])).int()
            if a.shape == b.shape:
                mse = float(((a - b).double() ** 2).mean())
                out["max_abs_diff_decoded"] = int((a - b).abs().max())
                out["psnr_vs_one_device"] = round(10 * math.log10(255.0 ** 2 / mse), 2)
    return out


def format_parity(p: dict, sp: int) -> str:
    if p["same_frames"]:
        return f"parity vs one device: SP={sp} wrote the same uint8 frames (sha256 {p['one_device_sha256'][:16]})"
    return (f"parity vs one device: frames differ (max abs difference after encoding "
            f"{p.get('max_abs_diff_decoded')}, PSNR {p.get('psnr_vs_one_device')} dB)")
