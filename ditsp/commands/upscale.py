"""`ditsp upscale INPUT -o OUTPUT`: restore a video, an image or a folder of frames with SeedVR2 under SP.

Everything that can be checked before ranks start is checked here, with a
one-line error: the input opens and has frames, the output can be written
(and is not overwritten without ``--overwrite``), checkpoints exist, the
options make sense, and the request's modelled memory fits each rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import add_deterministic_arg
from ..weights.fp8 import WEIGHTS_DTYPES

VIDEO_OUT = (".mp4", ".mov", ".mkv")
IMAGE_OUT = (".png", ".jpg", ".jpeg", ".webp")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("upscale", help="restore a video or image with SeedVR2 (DiT under window SP, VAE sharded)",
                       description=__doc__.splitlines()[0])
    p.add_argument("input", help="video file, image, or folder of frames")
    p.add_argument("-o", "--output", required=True, help="output .mp4/.mov/.mkv (video) or .png/.jpg/.webp (image)")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree: local ranks to spawn (torchrun: joins)")
    p.add_argument("--model", default="tiny", choices=["seedvr2-3b", "seedvr2-7b", "tiny", "tiny-7b"],
                   help="DiT and VAE preset (tiny: seeded tiny models, a smoke test)")
    p.add_argument("--dit", metavar="CKPT", help="DiT checkpoint (.pth/.safetensors/.gguf; fp16/bf16/fp32, FP8 or GGUF), "
                                                 "e.g. seedvr2_ema_3b.pth, seedvr2_ema_3b_fp8_e4m3fn.safetensors")
    p.add_argument("--vae", metavar="CKPT", help="VAE checkpoint (.pth/.safetensors/.gguf), e.g. ema_vae.pth")
    p.add_argument("--text-embedding", metavar="FILE", help="text embedding, e.g. pos_emb.pt")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--resolution", metavar="WxH", help="target area W*H, aspect kept (reference default 1280x720)")
    size.add_argument("--scale", type=float, help="target area = (scale x width) x (scale x height)")
    size.add_argument("--size", metavar="WxH", help="exact output size (then cropped to multiples of 16)")
    p.add_argument("--seed", type=int, default=666)
    p.add_argument("--color-fix", default="wavelet", choices=["wavelet", "adain", "none"])
    p.add_argument("--window-frames", type=int, default=0,
                   help="temporal window in frames (4n+1); 0 = the whole clip in one window")
    p.add_argument("--overlap", type=int, default=4, help="frames shared (and cross-faded) by consecutive windows")
    p.add_argument("--vae-mode", default="auto",
                   choices=["auto", "replicated", "chunked", "time", "height", "height+chunks", "tiled"])
    p.add_argument("--vae-chunk", type=int, default=1, help="latent frames per causal chunk in chunked VAE modes")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 for seedvr2-*, fp32 for tiny")
    p.add_argument("--weights-dtype", default="stored", choices=list(WEIGHTS_DTYPES),
                   help="how the rank keeps float weights: as stored (cast to --dtype; FP8/GGUF files stay "
                        "quantized) or quantized to FP8 at load; dequantized per layer for the arithmetic")
    p.add_argument("--planner", default=None, choices=["lpt", "locality"],
                   help="window planner of the DiT (default: the SP path is chosen by the cost model)")
    p.add_argument("--max-memory", type=float, metavar="GiB",
                   help="per-rank memory budget (default: free memory / local ranks)")
    p.add_argument("--force", action="store_true", help="run even if the memory estimate exceeds the budget")
    p.add_argument("--fps", type=float, help="output frame rate (default: the input's; 24 for a folder of frames)")
    p.add_argument("--crf", type=int, default=18, help="H.264 quality (0-51, lower is better)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds a rank may go without progress (no collective, no stage done) before it counts as stuck")
    p.add_argument("--plot", metavar="FILE.png", help="picture of input vs output frames and the stage timeline")
    add_deterministic_arg(p)
    p.add_argument("--check", action="store_true",
                   help="also restore on one device (to a temporary file) and report whether the frames match")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
    return p


def _wxh(text: str, what: str) -> tuple[int, int]:
    from ..models.seedvr2.sizing import parse_resolution

    try:
        return parse_resolution(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def one_line(msg: str, limit: int = 400) -> str:
    """A multi-line message (a checkpoint report, say) as one line: its lines joined, long ones cut."""
    text = "; ".join(part.strip().rstrip(":") for part in str(msg).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(msg: str) -> int:
    print(f"ditsp upscale: error: {one_line(msg)}", file=sys.stderr)
    return 1


def build_request(args):
    """The request and the input's description, or ValueError with a one-line message."""
    from ..io.video import MediaError, count_frames, probe
    from ..models.seedvr2.pipeline.padding import padded_length
    from ..models.seedvr2.pipeline.sizing import frame_geometry
    from ..models.seedvr2.pipeline.windows import check_window
    from ..models.seedvr2.restore import UpscaleRequest
    from ..models.seedvr2.weights import WeightsSpec

    if args.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {args.sp}")
    if "WORLD_SIZE" not in os.environ:  # local ranks, spawned here: bounded even with --force
        from ..memory import check_local_ranks

        check_local_ranks(args.sp)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.vae_chunk < 1:
        raise ValueError(f"--vae-chunk must be >= 1, got {args.vae_chunk}")
    if args.fps is not None and not 0 < args.fps <= 1000:
        raise ValueError(f"--fps must be in (0, 1000], got {args.fps}")
    if not 0 <= args.crf <= 51:
        raise ValueError(f"--crf must be in 0..51, got {args.crf}")
    for flag, path in (("--dit", args.dit), ("--vae", args.vae), ("--text-embedding", args.text_embedding)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    try:
        info = probe(args.input)
        frames = info.frames if info.frames is not None else count_frames(args.input)
    except MediaError as e:
        raise ValueError(str(e)) from None
    if frames < 1:
        raise ValueError(f"{args.input}: has no frames")
    out = Path(args.output)
    ext = out.suffix.lower()
    allowed = IMAGE_OUT if info.kind == "image" else VIDEO_OUT
    if ext not in allowed:
        kind = "an image" if info.kind == "image" else "a video"
        raise ValueError(f"{args.output}: {kind} input needs an output ending in {', '.join(allowed)}")
    if out.exists() and not args.overwrite:
        raise ValueError(f"{args.output} exists; pass --overwrite to replace it")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{args.output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{args.output}: folder {folder} is not writable")
    if os.path.abspath(args.output) == os.path.abspath(args.input):
        raise ValueError("the output would overwrite the input")
    area = size = None
    if args.resolution:
        area = _wxh(args.resolution, "--resolution")
    elif args.size:
        size = _wxh(args.size, "--size")
    elif args.scale:
        if not 0 < args.scale <= 16:
            raise ValueError(f"--scale must be in (0, 16], got {args.scale}")
        area = (round(info.width * args.scale), round(info.height * args.scale))
    else:
        area = (1280, 720)
    geo = frame_geometry(info.width, info.height, area=area, size=size)
    if geo.out_width < 16 or geo.out_height < 16:
        raise ValueError(f"{geo.describe()}: the output must be at least 16x16 after the crop to multiples of 16")
    if args.window_frames:
        check_window(args.window_frames, args.overlap)
    elif args.overlap < 0:
        raise ValueError(f"--overlap must be >= 0, got {args.overlap}")
    dtype = args.dtype or ("bf16" if args.model.startswith("seedvr2") else "fp32")
    wd = getattr(args, "weights_dtype", "stored")  # serve builds its own Namespace without it
    weights_dtype = None if wd in (None, "stored") else wd
    weights = WeightsSpec(args.model, args.dit, args.vae, args.text_embedding, dtype, weights_dtype=weights_dtype)
    req = UpscaleRequest(
        input=args.input, output=args.output, weights=weights, area=area, size=size, seed=args.seed,
        color_fix=args.color_fix, window_frames=args.window_frames, overlap=args.overlap, vae_mode=args.vae_mode,
        vae_chunk=args.vae_chunk, budget_gib=args.max_memory, planner=args.planner, sp=args.sp, crf=args.crf, fps=args.fps,
        overwrite=args.overwrite, progress=not args.no_progress and not args.json,
        sample_frames=4 if args.plot else 0, deterministic=args.deterministic,
    )
    window = min(args.window_frames or padded_length(frames), padded_length(frames))
    return req, info, frames, geo, window


def check_memory(req, geo, window: int, args) -> str:
    """The estimate's line; raises MemoryError naming what would fit when it does not."""
    from ..models.seedvr2.budget import GiB, available_bytes, estimate, suggestions
    from ..models.seedvr2.weight_memory import dit_weights
    from ..weights import FormatError

    local = 1 if "WORLD_SIZE" in os.environ else req.sp
    budget = int(args.max_memory * GiB) if args.max_memory else available_bytes(local)
    w = req.weights
    try:  # the DiT's weights as the rank will keep them (a checkpoint's header, or the format asked for)
        kept = dit_weights(w.model, w.dtype, checkpoint=w.dit, weights_dtype=w.weights_dtype)
    except FormatError as e:
        raise ValueError(f"--dit {e}") from None
    est = estimate(w.model, w.dtype, window, geo.out_hw, req.sp, req.vae_mode,
                   budget if req.vae_mode == "auto" else None, req.vae_chunk, weights=kept)
    line = f"memory estimate: {est.describe()}; budget {budget / GiB:.2f} GiB per rank"
    if est.total > budget and not args.force:
        fits = suggestions(w.model, w.dtype, window, geo.out_hw, req.sp, req.vae_mode, budget, window, weights=kept)
        hint = ("; would fit: " + ", ".join(fits)) if fits else "; nothing smaller fits (try a smaller --resolution)"
        raise MemoryError(f"{line}: does not fit{hint} (or pass --force)")
    return line


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..distributed.launcher import RankError
    from ..engine import dispatch
    from ..models.seedvr2.restore import format_report, plot_report, rank_upscale, summarize

    try:
        req, info, frames, geo, window = build_request(args)
        if args.plot:
            folder = os.path.dirname(os.path.abspath(args.plot))
            if not os.path.isdir(folder):
                raise ValueError(f"--plot {args.plot}: folder {folder} does not exist")
        mem_line = check_memory(req, geo, window, args)
    except (ValueError, MemoryError) as e:
        return _fail(str(e))
    if not args.json:
        print(f"{args.input}: {info.kind}, {frames} frame(s), {geo.describe()}, SP={args.sp}; {mem_line}")
    try:
        results = dispatch(rank_upscale, req, sp=args.sp, threads=args.threads, timeout_s=args.timeout)
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
        summary["check"] = check_verdict(summary["parity"], req.sp)
    if args.plot:
        plot_report(summary, args.plot)
    summary.pop("samples", None)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_report(summary))
        if args.check:
            print(format_parity(summary["parity"], req.sp))
        if args.plot:
            print(f"wrote {args.plot}")
    if args.check and summary["check"] != "passed":  # a failed check is a failed run (the output is kept)
        return _fail(f"--check {summary['check']}")
    return 0


def _sweep_output(output: str) -> None:
    from ..io.video import sweep_temps

    sweep_temps(os.path.dirname(os.path.abspath(output)), output)


def check_verdict(parity: dict, sp: int) -> str:
    """``"passed"``, or ``"failed: ..."`` saying how the SP frames differ from one device's."""
    if parity["same_frames"]:
        return "passed"
    return (f"failed: SP={sp} frames differ from one device's (max abs difference after encoding "
            f"{parity.get('max_abs_diff_decoded')})")


def parity_vs_one_device(req, summary: dict, threads: int) -> dict:
    """Restore again on one device into a temporary file; compare the uint8 frames (digest, then values)."""
    import tempfile
    from dataclasses import replace

    import torch

    from ..engine import dispatch
    from ..io.video import open_media
    from ..models.seedvr2.restore import rank_upscale

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(req.output))) as tmp:
        ref_out = os.path.join(tmp, "one-device" + Path(req.output).suffix)
        ref = dispatch(rank_upscale, replace(req, output=ref_out, sp=1, progress=False, sample_frames=0), sp=1,
                       threads=threads)[0]
        out = {"same_frames": ref["sha256"] == summary["sha256"], "one_device_sha256": ref["sha256"]}
        if not out["same_frames"]:  # say how far apart, from the written files
            a = torch.cat(list(open_media(req.output)[1])).int()
            b = torch.cat(list(open_media(ref_out)[1])).int()
            out["max_abs_diff_decoded"] = int((a - b).abs().max()) if a.shape == b.shape else None
    return out


def format_parity(p: dict, sp: int) -> str:
    if p["same_frames"]:
        return f"parity vs one device: SP={sp} wrote the same uint8 frames (sha256 {p['one_device_sha256'][:16]})"
    return (f"parity vs one device: frames differ (max abs difference after encoding "
            f"{p.get('max_abs_diff_decoded')})")
