"""Window stitches and colour fixes side by side: how much each window join stands out, how far the colour drifts,
what each costs, on clips with motion.

Clips (a degraded low-resolution input and its clean original at the output size, made as ``ditsp bench
restorer`` makes them): ``held-out``, the main job's panned crop of ``chelsea`` (never in training), and with
``--video FILE`` frames of a real H.264 video (Big Buck Bunny in the docs), 2x down and compressed.

Each clip is restored by the shipped small restorer (``--model tiny``), one device, ``--deterministic``, in
``--window-frames`` windows sharing ``--overlap`` frames, once per setting:

* stitches (colour fix ``wavelet``): ``cosine``, ``hann``, ``latent``, and ``--overlap 0`` (the windows share
  only the frames the plan has left over, at most a window's step less one: the nearest to a hard cut the
  plan makes) as the reference of a join hardly blended, and the whole clip as one window (no join: what a
  decode that never restarts gives), the last two measured at the cosine plan's joins, as the clean original
  is: what the clip's own motion gives there. Per frame, the PSNR of each against the clean original (the
  ``.json`` and a line of the ``.md``): where in a window the quality lies. Per setting: the seam measure
  (``ditsp.models.seedvr2.pipeline.seams``: per join and overall, the mean frame-to-frame change across the
  join over the median inside windows), the VAE decode's seconds and the job's (the sum of its stages);
* colour fixes (stitch ``cosine``): ``wavelet``, ``adain``, ``lab``, ``none``. Per setting: the colour drift of
  the output against the input's upscale (``pipeline/color_drift.py``: saturation as CIE chroma, hue, lightness),
  PSNR and SSIM against the clean original, the colour fix's seconds. The clean original's own drift against
  the input's upscale is listed beside them: what the degradation took from the colour.

Settings run in rounds (every setting once per round, ``--rounds`` rounds) and each time is the round's
minimum: the machine is shared. Results: ``benchmarks/results/seams-colour.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from . import declare

# "overlap 0": the cosine stitch, nothing shared but leftovers; "one window": the whole clip, no join
STITCH_ROWS = ("overlap 0", "cosine", "hann", "latent", "one window")
COLOR_ROWS = ("wavelet", "adain", "lab", "none")


def add_parser(sub) -> argparse.ArgumentParser:
    def arguments(p):
        p.add_argument("--video", metavar="FILE", help="a real video for the second clip (e.g. an H.264 .mp4)")
        p.add_argument("--video-start", type=int, default=240, help="first frame taken from --video")
        p.add_argument("--video-size", default="320x176", help="output (clean) WxH of the --video clip")
        p.add_argument("--size", default="128x96", help="output (clean) WxH of the held-out clip")
        p.add_argument("--frames", type=int, default=17, help="frames per clip")
        p.add_argument("--window-frames", type=int, default=9, help="frames per window")
        p.add_argument("--overlap", type=int, default=4, help="frames shared by consecutive windows")
        p.add_argument("--crf", type=int, default=35, help="H.264 quality of the --video clip's degraded input")
        p.add_argument("--rounds", type=int, default=1, help="rounds of every setting; times are each's minimum")
        p.add_argument("--threads", type=int, default=1, help="compute threads")
        p.add_argument("--out", default="benchmarks/results", help="folder for seams-colour.md/.json")

    return declare(sub, "seams-colour", "window stitches and colour fixes side by side: seams, colour drift, cost",
                   __doc__.splitlines()[0], arguments, main)


def machine() -> str:
    """The CPU model and cores, as the results header names them."""
    model = platform.processor() or "CPU model not recorded"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def restore(inp: str, out: str, *, stitch: str, color_fix: str, window_frames: int, overlap: int,
            threads: int) -> dict:
    """One restoration on one device in this process: its summarised report, with ``frames_decoded``: the
    frames the VAE decodes (every window's padded frames; the latent stitch: the clip's timeline once)."""
    from ..distributed.dispatch import dispatch
    from ..models.seedvr2.job import request
    from ..models.seedvr2.job.restore import rank_upscale, summarize
    from ..models.seedvr2.pipeline.latent_stitch import LatentStitch, pixel_range
    from ..models.seedvr2.presets import vae_config

    o = request.Options(input=inp, output=out, stitch=stitch, color_fix=color_fix, window_frames=window_frames,
                        overlap=overlap, deterministic=True, overwrite=True, progress=False, threads=threads)
    req = request.prepare(o)
    report = summarize(dispatch(rank_upscale, req, sp=1, threads=threads))
    plan, k = req.plan, vae_config(o.model).temporal_factor
    report["frames_decoded"] = (pixel_range(0, LatentStitch(plan.windows, k).frames, k)[1] if stitch == "latent"
                                else sum(s.padded for s in plan.steps))
    return report


def clean_drift(inp: str, ref: str, size: tuple[int, int]) -> dict:
    """The clean original's colour drift against the input's upscale (the pipeline's own resize to ``size``)."""
    import torch

    from ..io.quality import read_frames
    from ..models.seedvr2.job.sizing import crop_multiple
    from ..models.seedvr2.pipeline.color_drift import color_drift
    from ..models.seedvr2.pipeline.transform import to_uint8, transform_frames
    from ..models.seedvr2.presets import DEFAULT_MODEL

    w, h = size
    low = torch.from_numpy(read_frames(inp)).permute(0, 3, 1, 2)
    up = to_uint8(transform_frames(low, size=(h, w), multiple=crop_multiple(DEFAULT_MODEL)).permute(1, 0, 2, 3))
    clean = torch.from_numpy(read_frames(ref))[: up.shape[0]]
    return color_drift(clean, up)


def settings() -> list[tuple[str, str, str, str]]:
    """(row, stitch, colour fix, windows: "overlap 0", "one window" or "") of every run; cosine + wavelet serves
    both tables."""
    runs = [(row, row if row in ("cosine", "hann", "latent") else "cosine", "wavelet",
             row if row in ("overlap 0", "one window") else "") for row in STITCH_ROWS]
    runs += [(fix, "cosine", fix, "") for fix in COLOR_ROWS if fix != "wavelet"]
    return runs


def measure(name: str, inp: str, ref: str, folder: Path, args) -> dict:
    from ..io import quality

    reports: dict[str, dict] = {}
    times: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for row, stitch, fix, windows in settings():
            out = folder / f"{row.replace(' ', '-')}.mp4"
            rep = restore(inp, str(out), stitch=stitch, color_fix=fix,
                          window_frames=0 if windows == "one window" else args.window_frames,
                          overlap=0 if windows == "overlap 0" else args.overlap, threads=args.threads)
            if row in reports and rep["sha256"] != reports[row]["sha256"]:
                raise RuntimeError(f"{name}, {row}: round {r + 1} wrote other frames than round 1 under --deterministic")
            reports[row] = rep
            got = {"decode": rep["stage_s"]["vae_decode"], "color_fix": rep["stage_s"]["color_fix"],
                   "job": sum(rep["stage_s"].values())}
            times[row] = {k: min(v, times.get(row, {}).get(k, v)) for k, v in got.items()}
            print(f"{name}: round {r + 1}, {row} done", file=sys.stderr)
    import torch

    from ..models.seedvr2.pipeline.seams import seam_measure

    source, clean = quality.read_frames(inp), quality.read_frames(ref)
    wins = reports["cosine"]["windows"]
    spans = [(b[0], max(a[1], b[0]) + 1) for a, b in zip(wins, wins[1:])]  # the cosine plan's joins
    rows = {}
    for row, rep in reports.items():
        restored = quality.read_frames(rep["output"])
        if row == "one window":  # no join of its own: the same measure at the cosine plan's joins
            rep["seams"] = seam_measure(torch.from_numpy(restored), spans)
        q = quality.report(restored, source, clean)["restored"]["overall"]
        q["per_frame"] = [round(p, 2) for p, _ in quality.frame_scores(restored, clean[:restored.shape[0]])]
        rows[row] = {"seams": rep["seams"], "color_drift": rep["color_drift"], "psnr": q["psnr"], "ssim": q["ssim"],
                     "per_frame_psnr": q["per_frame"], "seconds": times[row], "frames_decoded": rep["frames_decoded"],
                     "windows": rep["windows"],
                     "sha256": rep["sha256"]}
    first = next(iter(reports.values()))
    return {"clip": name, "input": first["geometry"], "frames": first["frames_written"], "rows": rows,
            "clean_drift": clean_drift(inp, ref, tuple(first["output_size"])),
            "clean_seams": seam_measure(torch.from_numpy(clean[:first["frames_written"]]), spans),
            "windows": reports["cosine"]["windows"], "latent_windows": reports["latent"]["windows"]}


def _r(v, fmt="{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"


def tables(clip: dict) -> list[str]:
    rows = clip["rows"]
    base = rows["cosine"]["seconds"]
    out = [f"### {clip['clip']}: {clip['input']}, {clip['frames']} frames", "",
           f"Windows (cosine, hann): {clip['windows']}; latent: {clip['latent_windows']}; overlap 0: "
           f"{clip['rows']['overlap 0']['windows']}.", "",
           "| stitch | seam ratio overall | per join | inside median | frames decoded | decode s | job s (x cosine) | "
           "PSNR / SSIM |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for row in STITCH_ROWS:
        r = rows[row]
        m = r["seams"] or {"ratio": None, "each": [], "inside_median": None}
        per = ", ".join(_r(s["ratio"]) for s in m["each"])
        s = r["seconds"]
        label = "one window (at the cosine joins)" if row == "one window" else row
        out.append(f"| {label} | {_r(m['ratio'])} | {per} | {_r(m['inside_median'])} | {r['frames_decoded']} | "
                   f"{s['decode']:.2f} | "
                   f"{s['job']:.2f} ({s['job'] / base['job']:.2f}) | {r['psnr']:.2f} dB / {r['ssim']:.4f} |")
    m = clip["clean_seams"]
    out.append(f"| (the clean original, at the cosine joins) | {_r(m['ratio'])} | "
               f"{', '.join(_r(s['ratio']) for s in m['each'])} | {_r(m['inside_median'])} | | | | |")
    out += ["", "| colour fix | saturation | hue | lightness (L*) | per window saturation | colour fix s | "
                "PSNR / SSIM |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for row in COLOR_ROWS:
        r = rows["cosine" if row == "wavelet" else row]
        d = r["color_drift"]
        per = ", ".join(_pct(w["saturation_shift"]) for w in d["windows"])
        out.append(f"| {row} | {_pct(d['saturation_shift'])} | {_r(d['hue_shift_deg'], '{:+.2f}')} deg | "
                   f"{_r(d['lightness_shift'], '{:+.2f}')} | {per} | {r['seconds']['color_fix']:.2f} | "
                   f"{r['psnr']:.2f} dB / {r['ssim']:.4f} |")
    c = clip["clean_drift"]
    out.append(f"| (the clean original) | {_pct(c['saturation_shift'])} | {_r(c['hue_shift_deg'], '{:+.2f}')} deg | "
               f"{_r(c['lightness_shift'], '{:+.2f}')} | | | |")
    out += ["", "PSNR per frame (dB):", ""]
    out += [f"- {row}: {', '.join(f'{p:.1f}' for p in rows[row]['per_frame_psnr'])}"
            for row in ("cosine", "latent", "one window")]
    return out


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..train.checkpoint import atomic_write
    from .restorer import photo_clip, video_clip

    def wxh(text):
        w, h = (int(v) for v in text.lower().split("x"))
        return w, h

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clips = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("held-out",) + (("video",) if args.video else ()):
            folder = Path(tmp) / name
            folder.mkdir()
            if name == "held-out":
                inp, ref = photo_clip(folder, "chelsea", args.frames, wxh(args.size))
                label = "held-out (chelsea, panned; ditsp.train.heldout's clip)"
            else:
                inp, ref = video_clip(folder, args.video, args.video_start, args.frames, wxh(args.video_size),
                                      args.crf)
                label = (f"video ({Path(args.video).name}: frames {args.video_start}-"
                         f"{args.video_start + args.frames - 1}, centre {args.video_size}, 2x down, H.264 crf "
                         f"{args.crf})")
            clip = measure(label, inp, ref, folder, args)
            clips.append(clip)
    when = datetime.date.today().isoformat()
    cmd = " ".join(["ditsp bench seams-colour"] + sys.argv[sys.argv.index("seams-colour") + 1:]
                   if "seams-colour" in sys.argv else ["ditsp bench seams-colour"])
    head = [
        "# Window stitches and colour fixes side by side (`ditsp bench seams-colour`)", "",
        f"{when}, {machine()}; `{cmd}`: the shipped small restorer (`--model tiny`), one device, "
        f"`--deterministic`, {args.window_frames}-frame windows sharing {args.overlap} frames. Seam ratio: per "
        "window join, the mean frame-to-frame change across it over the median change inside windows (1: the "
        "join moves as much as the clip does). Colour drift: the output against the input's upscale, in CIE "
        "L*a*b* (saturation: mean chroma C*ab, relative; hue: chroma-weighted mean hue-angle change; lightness: "
        "mean L* change). Times: the minimum over "
        f"{args.rounds} round(s), seconds on this shared machine; job s is the sum of the job's stages.", ""]
    text = "\n".join(head + [line for c in clips for line in tables(c) + [""]])
    atomic_write(out / "seams-colour.md", lambda p: Path(p).write_text(text))
    meta = {"date": when, "machine": machine(), "command": cmd, "window_frames": args.window_frames,
            "overlap": args.overlap, "rounds": args.rounds, "clips": clips}
    atomic_write(out / "seams-colour.json", lambda p: Path(p).write_text(json.dumps(meta, indent=1) + "\n"))
    print(text)
    return 0
