"""The small restorer's quality: three clips restored by ``ditsp upscale`` at SP 1 and 2, against bicubic.

Clips (each a degraded low-resolution input and its clean original at the output size):

* ``held-out``: the main job's clip, a panned crop of ``chelsea`` (never in training), degraded by the
  training chain (blur, 2x downscale, noise, H.264 or JPEG);
* ``unseen``: the same from a photograph no training saw (matplotlib's ``grace_hopper.jpg``);
* ``video`` (with ``--video FILE``): frames of a real H.264 video, centre-cropped to multiples of 8,
  downscaled 2x (area) and compressed with H.264 at ``--crf`` (35): a user's low-quality clip.

Each is restored by the ``ditsp upscale`` command line in a fresh process at SP 1 and SP 2 under
``--deterministic`` with the default model (the weights the package ships), and the two must write the
same frames. Per clip: restored and bicubic PSNR and SSIM against the clean original (``ditsp.io.quality``;
both as delivered: the bicubic frames through the output's H.264 encoder too, and, for reference, bicubic
before it) and a picture (input / restored / bicubic / clean). Results: ``benchmarks/results/restorer.md`` and ``.json`` and
``restorer-<clip>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import declare


def add_parser(sub) -> argparse.ArgumentParser:
    def arguments(p):
        p.add_argument("--video", metavar="FILE", help="a real video for the third clip (e.g. an H.264 .mp4)")
        p.add_argument("--video-start", type=int, default=0, help="first frame taken from --video")
        p.add_argument("--frames", type=int, default=17, help="frames per clip")
        p.add_argument("--size", default="128x96", help="output (clean) WxH of the photograph clips")
        p.add_argument("--video-size", default="640x352", help="output (clean) WxH of the --video clip")
        p.add_argument("--crf", type=int, default=35, help="H.264 quality of the --video clip's degraded input")
        p.add_argument("--out", default="benchmarks/results", help="folder for restorer.md/.json and pictures")
        p.add_argument("--timeout", type=float, default=1800.0, help="seconds a restoration may take")

    return declare(sub, "restorer", "the small restorer's quality on three clips at SP 1 and 2, against bicubic",
                   __doc__.splitlines()[0], arguments, main)


def _wxh(text: str) -> tuple[int, int]:
    w, h = (int(v) for v in text.lower().split("x"))
    return w, h


def photo_clip(folder: Path, image: str, frames: int, size: tuple[int, int]) -> tuple[str, str]:
    """(degraded input video, clean frame folder) of a held-out photograph."""
    from ..io.write import write_image, write_video
    from ..train.data import held_out_clip, to_u8

    w, h = size
    low, clean = held_out_clip(frames, (h, w), image=image)
    inp, ref = folder / "input.mp4", folder / "clean"
    write_video(str(inp), to_u8(low), 12.0, crf=0, overwrite=True)
    ref.mkdir(exist_ok=True)
    for i, f in enumerate(to_u8(clean)):
        write_image(str(ref / f"{i:04d}.png"), f, overwrite=True)
    return str(inp), str(ref)


def video_clip(folder: Path, video: str, start: int, frames: int, size: tuple[int, int], crf: int) -> tuple[str, str]:
    """(degraded input video, clean frame folder) of ``frames`` frames of a real video: centre crop to
    ``size`` (after an area resize when the video is smaller or larger), 2x area downscale, H.264 at ``crf``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..io.quality import read_frames
    from ..io.write import write_image, write_video
    from ..train.data import h264_roundtrip

    allf = read_frames(video)
    if allf.shape[0] < start + frames:
        raise ValueError(f"{video}: has {allf.shape[0]} frames, {start + frames} needed")
    clip = torch.from_numpy(allf[start:start + frames]).permute(0, 3, 1, 2).float()
    w, h = size
    H, W = clip.shape[-2:]
    if H < h or W < w:
        raise ValueError(f"{video}: {W}x{H} is smaller than --video-size {w}x{h}")
    top, left = (H - h) // 2, (W - w) // 2
    clean = clip[:, :, top:top + h, left:left + w]
    low = F.interpolate(clean, size=(h // 2, w // 2), mode="area").round().clamp(0, 255).to(torch.uint8)
    low = h264_roundtrip(low.permute(0, 2, 3, 1).numpy(), crf)
    inp, ref = folder / "input.mp4", folder / "clean"
    write_video(str(inp), torch.from_numpy(np.ascontiguousarray(low)), 24.0, crf=0, overwrite=True)
    ref.mkdir(exist_ok=True)
    for i, f in enumerate(clean.round().to(torch.uint8).permute(0, 2, 3, 1)):
        write_image(str(ref / f"{i:04d}.png"), f, overwrite=True)
    return str(inp), str(ref)


def restore(inp: str, ref: str, out: str, sp: int, plot: str | None, timeout: float) -> dict:
    """``ditsp upscale`` in a fresh process (the package's default model, --deterministic); its JSON report."""
    cmd = [sys.executable, "-c", "import sys; from ditsp.cli import main; sys.exit(main())", "upscale", inp,
           "-o", out, "--sp", str(sp), "--deterministic", "--reference", ref, "--json", "--overwrite"]
    if plot:
        cmd += ["--plot", plot]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"ditsp upscale at SP={sp} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(p.stdout)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..io import quality
    from ..train.checkpoint import atomic_write

    clips = [("held-out", "chelsea"), ("unseen", "mpl:grace_hopper.jpg")] + ([("video", None)] if args.video else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, image in clips:
            folder = Path(tmp) / name
            folder.mkdir()
            if image:
                inp, ref = photo_clip(folder, image, args.frames, _wxh(args.size))
            else:
                inp, ref = video_clip(folder, args.video, args.video_start, args.frames, _wxh(args.video_size),
                                      args.crf)
            reports = {}
            for sp in (1, 2):
                plot = str(out / f"restorer-{name}.png") if sp == 2 else None
                reports[sp] = restore(inp, ref, str(folder / f"restored-sp{sp}.mp4"), sp, plot, args.timeout)
                print(f"{name}: SP={sp} done", file=sys.stderr)
            q = reports[2]["quality"]
            r, b = q["restored"]["overall"], q["bicubic"]["overall"]
            t, clean = reports[2]["frames_written"], quality.read_frames(ref)
            raw = quality.summarize(quality.frame_scores(quality.bicubic(quality.read_frames(inp)[:t], clean.shape[1:3]),
                                                         clean[:t]), [])["overall"]  # not through the encoder
            rows.append({"clip": name, "source": args.video if image is None else image,
                         "input": reports[2]["geometry"], "frames": reports[2]["frames_written"],
                         "restored_psnr": r["psnr"], "restored_ssim": r["ssim"],
                         "bicubic_psnr": b["psnr"], "bicubic_ssim": b["ssim"],
                         "bicubic_unencoded_psnr": raw["psnr"], "bicubic_unencoded_ssim": raw["ssim"],
                         "same_bytes_sp1_sp2": reports[1]["sha256"] == reports[2]["sha256"],
                         "picture": f"restorer-{name}.png"})
            if os.path.exists(out / f"restorer-{name}-reference.png"):
                os.replace(out / f"restorer-{name}-reference.png", out / f"restorer-{name}.png")
    lines = ["| clip | input -> output | frames | restored PSNR / SSIM | bicubic PSNR / SSIM | above bicubic | "
             "bicubic before the encoder | SP 1 = SP 2 bytes |", "| --- | --- | ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        above = "yes" if r["restored_psnr"] > r["bicubic_psnr"] and r["restored_ssim"] > r["bicubic_ssim"] else "no"
        lines.append(f"| {r['clip']} ({r['source']}) | {r['input']} | {r['frames']} | {r['restored_psnr']:.2f} dB / "
                     f"{r['restored_ssim']:.4f} | {r['bicubic_psnr']:.2f} dB / {r['bicubic_ssim']:.4f} | {above} | "
                     f"{r['bicubic_unencoded_psnr']:.2f} dB / {r['bicubic_unencoded_ssim']:.4f} | "
                     f"{'yes' if r['same_bytes_sp1_sp2'] else 'NO'} |")
    table = "\n".join(lines)
    text = "# The small restorer against bicubic (`ditsp bench restorer`)\n\n" + table + "\n"
    atomic_write(out / "restorer.md", lambda tmp: Path(tmp).write_text(text))
    atomic_write(out / "restorer.json", lambda tmp: Path(tmp).write_text(json.dumps(rows, indent=1) + "\n"))
    print(table)
    return 0
