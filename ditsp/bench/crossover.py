"""Plan A (LPT, locality) vs Plan B (halo slabs) vs Ulysses: bytes, rounds, time, and the auto choice.

    ditsp bench crossover [--measure-grid 5,20,36] [--layers 4] [--out benchmarks/results]

Analytical part (the released 3B, 81 frames, bf16 activations, 720p to 4K at
SP 2/4/8): bytes leaving ranks per forward (summed over ranks), collective
rounds per layer and the predicted time of :func:`ditsp.sp.choice.path_costs`
with the default GPU link, plus the share of that time the exchanges would
take if nothing overlapped them. Measured part: the ``small`` preset at SP=2
on local gloo ranks, every path, forward time and counted bytes, against the
ranking the cost model predicts with the link measured by ``ditsp bench link``
(``benchmarks/results/link.json``, if present). Writes ``crossover.md``,
``crossover.json`` and ``crossover.png``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from ..argtypes import positive_int

RESOLUTIONS = {"720p": (21, 45, 80), "1080p": (21, 67, 120), "2K": (21, 90, 160), "4K": (21, 135, 240)}
SPS = (2, 4, 8)
RUN_PATHS = {"window/lpt": ("window", "lpt"), "window/locality": ("window", "locality"),
             "halo": ("halo", "lpt"), "ulysses": ("ulysses", "lpt")}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("crossover", help="Plan A vs Plan B vs Ulysses: bytes, rounds, time, auto choice")
    p.add_argument("--measure-grid", default="5,20,36", help="post-patch grid of the measured SP=2 runs")
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--link", default="benchmarks/results/link.json")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=main)
    return p


def analytical() -> list[dict]:
    from ..models.seedvr2.nadit.config import get_config
    from ..sp.choice import CANDIDATES, Link, path_costs

    cfg, link, rows = get_config("seedvr2-3b"), Link(), []
    layers = cfg.num_layers
    for res, grid in RESOLUTIONS.items():
        for p in SPS:
            costs = path_costs(cfg, grid, p, link)
            best_t = min(costs, key=lambda c: c.total_s).path
            best_b = min(costs, key=lambda c: c.bytes).path
            for c in costs:
                rows.append({"res": res, "grid": grid, "sp": p, "path": c.path, "gb": c.bytes / 1e9,
                             "rounds_per_layer": c.rounds / layers, "pred_ms": c.total_s * 1e3,
                             "comm_share": (c.comm_s + c.latency_s) / c.total_s, "imbalance": c.imbalance,
                             "fewest_bytes": c.path == best_b, "fastest": c.path == best_t})
            assert len(costs) == len(CANDIDATES)
    return rows


def measured(model: str, layers: int, grid, repeats: int, link_path: str) -> dict:
    from ..models.seedvr2.job.forward import RunSpec, run
    from ..models.seedvr2.nadit.config import get_config
    from ..sp.choice import Link, choose

    base = RunSpec(model, tuple(grid), 2, layers=layers, warmup=1, repeats=repeats)
    rows = {}
    single = run(replace(base, sp=1))
    rows["single device"] = {"ms": min(single["rank_time_s"]) * 1e3, "bytes": 0}
    for name, (path, planner) in RUN_PATHS.items():
        s = run(replace(base, path=path, planner=planner))
        rows[name] = {"ms": max(s["rank_time_s"]) * 1e3, "bytes": s["bytes_moved"], "report": s["path"]}
    link = Link.load(link_path) if os.path.exists(link_path) else Link()
    cfg = get_config(model, layers)
    choice = choose(cfg, grid, 2, link, elem_bytes=4)
    return {"grid": list(grid), "model": model, "layers": layers, "rows": rows, "link": link.as_dict(),
            "predicted": [{"path": c.path, "ms": c.total_s * 1e3} for c in choice.costs],
            "measured_order": sorted(RUN_PATHS, key=lambda k: rows[k]["ms"]),
            "choice": choice.describe()}


def write(out: str, ana: list[dict], meas: dict) -> str:
    lines = ["| res | SP | path | GB / forward | rounds / layer | predicted ms | comm share | imbalance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ana:
        mark = (" **fastest**" if r["fastest"] else "") + (" (fewest bytes)" if r["fewest_bytes"] else "")
        lines.append(f"| {r['res']} | {r['sp']} | {r['path']}{mark} | {r['gb']:.2f} | {r['rounds_per_layer']:.2f} | "
                     f"{r['pred_ms']:.0f} | {r['comm_share']:.1%} | {r['imbalance']:.3f} |")
    lines += ["", f"Measured: `{meas['model']}` ({meas['layers']} layers), grid {tuple(meas['grid'])}, fp32, "
              f"SP=2 on local gloo ranks (1 thread each).", "",
              "| path | forward ms | bytes moved |", "| --- | --- | --- |"]
    for k, v in meas["rows"].items():
        lines.append(f"| {k} | {v['ms']:.1f} | {v['bytes']:,} |")
    pred = " < ".join(c["path"] for c in meas["predicted"])
    lines += ["", f"Predicted ranking (link: {meas['link']['name']}): {pred}",
              f"Measured ranking: {' < '.join(meas['measured_order'])}", f"{meas['choice']}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "crossover.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "crossover.json"), "w") as f:
        json.dump({"analytical": ana, "measured": meas}, f, indent=1, default=list)
    _plot(out, ana)
    return text


def _plot(out: str, ana: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SPS), figsize=(4 * len(SPS), 3.4), sharey=True)
    paths = list(dict.fromkeys(r["path"] for r in ana))
    for ax, p in zip(axes, SPS):
        for path in paths:
            pts = [r for r in ana if r["sp"] == p and r["path"] == path]
            ax.plot([r["res"] for r in pts], [r["gb"] for r in pts], marker="o", label=path)
        ax.set_title(f"SP={p}")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB leaving ranks per forward (3B, bf16)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "crossover.png"), dpi=110)
    plt.close(fig)


def main(args, parser=None) -> int:
    from ..models.seedvr2.job.sizing import parse_grid

    os.makedirs(args.out, exist_ok=True)
    text = write(args.out, analytical(),
                 measured(args.model, args.layers, parse_grid(args.measure_grid), args.repeats, args.link))
    print(text)
    return 0
