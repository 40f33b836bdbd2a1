"""`ditsp bench forward`: single device vs window SP (LPT, locality) vs Ulysses, side by side.

One model, one grid, one run. Every rank and the single device get the same
number of compute threads (one by default), so a time ratio measures parallel
efficiency, not thread count. Bytes and collective calls are exact counts;
times are medians after a warm-up. An analytical table gives bytes per
forward of the full 3B for the same paths at 720p-4K.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

from tqdm import tqdm

from ..argtypes import nonneg_int, positive_int, positive_int_list
from ..distributed.launcher import LocalCluster
from ..models.seedvr2.job.forward import RunSpec, rank_forward
from ..models.seedvr2.nadit.config import PRESETS
from ..windows.schedule import plan_schedule

PATHS = [("window", "lpt"), ("window", "locality"), ("ulysses", "lpt")]
RESOLUTIONS = {"720p": (21, 45, 80), "1080p": (21, 67, 120), "2K": (21, 90, 160), "4K": (21, 135, 240)}


def _label(path: str, planner: str) -> str:
    return "ulysses" if path == "ulysses" else f"window/{planner}"


def _row(label: str, sp: int, results: list[dict], grid, planner: str | None) -> dict:
    medians = [statistics.median(r["times_s"]) for r in results]
    imbalance = 1.0
    if planner:
        sched = plan_schedule(grid, ["regular", "shifted"], sp, planner)
        imbalance = max(p.imbalance for p in sched.plans.values())
    return {
        "path": label,
        "sp": sp,
        "time_s": max(medians),  # a forward ends when its slowest rank does
        "rank_time_s": medians,
        "time_imbalance": max(medians) / (sum(medians) / len(medians)),
        "token_imbalance": imbalance,
        "max_rank_bytes_sent": max(r["bytes_sent"] for r in results),
        "bytes_moved": sum(r["bytes_sent"] for r in results),
        "calls_per_rank": max(r["calls"] for r in results),
        "max_rank_peak_bytes": max(r["peak_bytes"] for r in results),
    }


def measure(spec: RunSpec, sps: list[int], threads: int = 1, timeout_s: float = 1800.0) -> list[dict]:
    """All paths at every SP degree, plus the single device; one row each."""
    from ..distributed.launcher import RankContext
    import torch

    jobs = [(1, "window", "lpt")] + [(sp, p, pl) for sp in sps for p, pl in PATHS]
    rows = []
    bar = tqdm(jobs, desc="bench forward", unit="config")
    torch.set_num_threads(threads)
    for sp, path, planner in bar:
        bar.set_postfix_str(f"SP={sp} {_label(path, planner)}")
        # Every path: exact CPU peaks (tensor bytes, not glibc's heap retention); under SP each rank
        # holds only its shard of the latent in and out (the output is gathered after the measured region).
        s = replace(spec, sp=sp, path=path, planner=planner, exact_memory=True, feed="rows" if sp > 1 else "canonical")
        if sp == 1:
            results = [rank_forward(RankContext(0, 1, None, torch.device("cpu")), s, return_output=False)]
            rows.append(_row("single device", 1, results, spec.grid, None))
            continue
        # A fresh group per configuration: no state carries over between paths.
        with LocalCluster(sp, timeout_s=timeout_s, threads=threads) as cluster:
            results = cluster.run(rank_forward, s, False, timeout_s=timeout_s)
        rows.append(_row(_label(path, planner), sp, results, spec.grid, planner if path == "window" else None))
    single = rows[0]["time_s"]
    from ..models.seedvr2.nadit.config import get_config
    from ..models.seedvr2.job.plan_report import memory_estimate

    cfg = get_config(spec.model, spec.layers)
    for r in rows:
        r["vs_single"] = r["time_s"] / single
        r["peak_vs_single"] = r["max_rank_peak_bytes"] / rows[0]["max_rank_peak_bytes"]
        if r["path"].startswith("window/") or r["sp"] == 1:
            planner = r["path"].split("/")[1] if "/" in r["path"] else "lpt"
            est = memory_estimate(plan_schedule(spec.grid, cfg.window_methods, r["sp"], planner, cfg.num_windows), cfg,
                                  dtype_bytes=4, feed="rows" if r["sp"] > 1 else "canonical")["peak_added"]
            r["estimate_peak_bytes"] = est
            r["estimate_error"] = est / r["max_rank_peak_bytes"] - 1
        uly = next((u for u in rows if u["path"] == "ulysses" and u["sp"] == r["sp"]), None)
        r["vs_ulysses"] = r["time_s"] / uly["time_s"] if uly else None
    return rows


def analytical(sps=(2, 4, 8)) -> list[dict]:
    """Bytes per forward of the full 3B (bf16) for each path, 720p-4K at 81 frames."""
    from ..models.seedvr2.nadit.config import SEEDVR2_3B
    from ..models.seedvr2.job.plan_report import plan_request, summarize

    rows = []
    for name, grid in RESOLUTIONS.items():
        for sp in sps:
            row = {"request": name, "grid": grid, "sp": sp}
            for planner in ("lpt", "locality"):
                s = summarize(plan_request(grid, SEEDVR2_3B, sp, planner), SEEDVR2_3B)
                row[f"window_{planner}"] = s["bytes_per_forward"]["window_sp"]
                row[f"moved_{planner}"] = s["transition"]["regular->shifted"]["fraction_moved"]
                row["ulysses"] = s["bytes_per_forward"]["ulysses"]
            rows.append(row)
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_measured(rows: list[dict], spec: RunSpec, threads: int) -> str:
    head = (
        f"model {spec.model} ({spec.layers or 'all'} layers), grid {spec.grid}, {spec.dtype}, {threads} thread(s) "
        f"per rank, median of {spec.repeats} after {spec.warmup} warm-up\n\n"
        "| path | SP | time s | vs single | vs Ulysses | rank time imbalance | token imbalance "
        "| MiB sent (max rank) | MiB moved (all) | calls/rank | peak MiB (max rank) | peak vs single "
        "| estimate MiB (error) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['path']} | {r['sp']} | {r['time_s']:.2f} | {r['vs_single']:.2f} | {_ratio(r['vs_ulysses'])} "
            f"| {r['time_imbalance']:.3f} | {r['token_imbalance']:.3f} | {_mib(r['max_rank_bytes_sent'])} "
            f"| {_mib(r['bytes_moved'])} | {r['calls_per_rank']} | {_mib(r['max_rank_peak_bytes'])} "
            f"| {r['peak_vs_single']:.3f} | {_est(r)} |"
        )
    return "\n".join(lines)


def _est(r) -> str:
    if "estimate_peak_bytes" not in r:
        return "-"
    return f"{_mib(r['estimate_peak_bytes'])} ({100 * r['estimate_error']:+.1f}%)"


def memory_table(sps=(2, 4, 8)) -> str:
    """Per-rank memory of the released 3B under window SP (locality, bf16, rows feed): the estimate of `ditsp plan`."""
    from ..models.seedvr2.nadit.config import SEEDVR2_3B
    from ..models.seedvr2.job.plan_report import memory_estimate, plan_request

    g = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    lines = ["| request (81 frames) | SP | tokens (max rank) | weights GiB | MLP GiB | attention GiB | exchange GiB "
             "| output GiB | peak added GiB | total GiB |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, grid in RESOLUTIONS.items():
        for sp in sps:
            m = memory_estimate(plan_request(grid, SEEDVR2_3B, sp, "locality"), SEEDVR2_3B)
            lines.append(f"| {name} {grid} | {sp} | {m['rank_tokens']:,} | {g(m['weights'])} | {g(m['mlp'])} "
                         f"| {g(m['attention'])} | {g(m['exchange'])} | {g(m['output'])} | {g(m['peak_added'])} "
                         f"| {g(m['total'])} |")
    return "\n".join(lines)


def format_analytical(rows: list[dict]) -> str:
    lines = [
        "| request (81 frames) | SP | moved/transition LPT | moved/transition locality | window SP LPT GiB "
        "| window SP locality GiB | Ulysses GiB | locality / Ulysses |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['request']} {r['grid']} | {r['sp']} | {100 * r['moved_lpt']:.1f}% | {100 * r['moved_locality']:.1f}% "
            f"| {r['window_lpt'] / 2**30:.2f} | {r['window_locality'] / 2**30:.2f} | {r['ulysses'] / 2**30:.2f} "
            f"| {r['window_locality'] / r['ulysses']:.3f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], ana: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    sps = sorted({r["sp"] for r in rows if r["sp"] > 1})
    labels = [_label(p, pl) for p, pl in PATHS]
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        vals = [next(r["vs_single"] for r in rows if r["sp"] == sp and r["path"] == label) for sp in sps]
        bars = ax1.bar(np.arange(len(sps)) + (k - 1) * width, vals, width, label=label)
        ax1.bar_label(bars, fmt="%.2f", fontsize=8)
    for sp in sps:
        ax1.axhline(1 / sp, color="gray", ls=":", lw=1)
    ax1.axhline(1.0, color="black", lw=1, label="single device")
    ax1.set_xticks(range(len(sps)), [f"SP={sp}" for sp in sps])
    ax1.set_ylabel("forward time / single device (lower is better)")
    ax1.set_title("measured (dotted: ideal 1/SP)", fontsize=10)
    ax1.legend(fontsize=8)
    reqs = list(RESOLUTIONS)
    for key, style in (("window_lpt", "o--"), ("window_locality", "o-"), ("ulysses", "s-")):
        for sp, color in zip((2, 4, 8), ("tab:blue", "tab:orange", "tab:green")):
            vals = [next(r[key] for r in ana if r["request"] == q and r["sp"] == sp) / 2**30 for q in reqs]
            ax2.plot(reqs, vals, style, color=color, label=f"{key.replace('_', ' ')} SP={sp}", ms=4,
                     alpha=0.9 if key != "window_lpt" else 0.5)
    ax2.set_yscale("log")
    ax2.set_ylabel("GiB moved per forward (bf16, all ranks)")
    ax2.set_title("SeedVR2-3B, 81 frames: analytical bytes per forward", fontsize=10)
    ax2.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("forward", help="single device vs window SP (LPT, locality) vs Ulysses on one NaDiT")
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--grid", default="9,45,80", help="post-patch grid T,H,W (default: 720p, 33 frames)")
    p.add_argument("--sp", default="2,4", type=positive_int_list, help="SP degrees, comma separated")
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per rank and for the single device")
    p.add_argument("--out", default="benchmarks/results", help="folder for forward.md, forward.json, forward.png")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, parser=None) -> int:
    from ..argtypes import check_layers, check_output_folder
    from ..models.seedvr2.job.sizing import parse_grid

    def fail(msg: str):
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    try:
        grid = parse_grid(args.grid)
    except ValueError as e:
        fail(f"--grid: {e}")
    if parser is not None:
        check_layers(parser, args.layers, args.model)
        check_output_folder(parser, args.out, "--out")
    spec = RunSpec(model=args.model, grid=grid, sp=1, layers=args.layers,
                   warmup=args.warmup, repeats=args.repeats)
    sps = args.sp if isinstance(args.sp, list) else positive_int_list(args.sp)
    rows = measure(spec, sps, args.threads)
    ana = analytical()
    text = (f"## Measured forward\n\n{format_measured(rows, spec, args.threads)}\n\n"
            f"## Full SeedVR2-3B, bytes per forward (analytical)\n\n{format_analytical(ana)}\n\n"
            f"## Full SeedVR2-3B, memory per rank under window SP (estimate, `ditsp plan`)\n\n{memory_table()}\n")
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "forward.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "forward.json"), "w") as f:
        json.dump({"measured": rows, "analytical": ana}, f, indent=1, default=list)
    plot(rows, ana, os.path.join(args.out, "forward.png"))
    print(f"wrote {args.out}/forward.md, forward.json, forward.png")
    return 0
