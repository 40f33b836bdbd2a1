"""`ditsp bench overlap`: window-SP layout changes inside a forward, per transport policy.

Measured: one model and grid on local gloo ranks, the transport policies
``off`` and ``chunked`` (at ``--capacity-mib``) interleaved (off, chunked,
off, ...) in one run so background load hits both alike; per policy the
forward time and the time spent in layout changes (the exposed exchange: from
entering the change to holding the new rows; the staying rows are placed
while the crossing rows are in flight under both). Analytical: per
layer of the released 3B (bf16), the slowest rank's exchange time on a link
of ``ditsp.sp.choice.Link`` (bytes over bandwidth plus one latency) against
its compute time per layer, and what each kind of overlap could hide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from ..argtypes import positive_int
from .forward import RESOLUTIONS


MODES = ("off", "chunked")


def _rank(ctx, model_name: str, grid, layers: int, planner: str, repeats: int, capacity: int) -> dict:
    import torch

    from ..distributed import transport as tp
    from ..distributed.comm import Comm
    from ..models.seedvr2.job.forward import RunSpec, build_for
    from ..sp.window_aligned import WindowRuntime

    model, vid, txt = build_for(RunSpec(model_name, tuple(grid), ctx.world_size, layers=layers))
    cfg = model.cfg
    rts, out = {}, {}
    for mode in MODES:
        rts[mode] = WindowRuntime(grid, cfg.window_methods, Comm.of(ctx.group), planner, cfg.num_windows,
                                  torch.float64, tp.TransportSettings(policy=mode, capacity_bytes=capacity))
        out[mode] = {"forward": [], "exchange": []}
    with torch.no_grad():
        for mode in MODES:  # warm-up: plans, caches, index tensors, agreement
            model(vid, txt, 1000.0, runtime=rts[mode])
            out[mode]["chunks"] = rts[mode].transport.report().get("chunks", 1)
        for _ in range(repeats):
            for mode in MODES:
                t0 = time.perf_counter()
                model(vid, txt, 1000.0, runtime=rts[mode])
                out[mode]["forward"].append(time.perf_counter() - t0)
                out[mode]["exchange"].append(rts[mode].exposed_s)
    return out


def measure(model: str, grid, layers: int, sp: int, planner: str, repeats: int, threads: int = 1,
            capacity: int = 1 << 20) -> dict:
    from ..distributed.launcher import LocalCluster

    with LocalCluster(sp, timeout_s=1800, threads=threads) as cluster:
        res = cluster.run(_rank, model, tuple(grid), layers, planner, repeats, capacity, timeout_s=1800)
    row = {"model": model, "grid": list(grid), "layers": layers, "sp": sp, "planner": planner, "repeats": repeats,
           "capacity": capacity}
    for mode in MODES:
        # per repeat, the slowest rank (a forward ends with it); then the median over repeats
        fw = [max(r[mode]["forward"][i] for r in res) for i in range(repeats)]
        ex = [max(r[mode]["exchange"][i] for r in res) for i in range(repeats)]
        row[mode] = {"forward_s": statistics.median(fw), "exchange_s": statistics.median(ex),
                     "chunks": max(r[mode]["chunks"] for r in res)}
    row["forward_ratio"] = row["chunked"]["forward_s"] / row["off"]["forward_s"]
    row["exchange_ratio"] = row["chunked"]["exchange_s"] / max(row["off"]["exchange_s"], 1e-12)
    return row


def analytical(sps=(2, 4, 8), planner: str = "locality", link=None) -> list[dict]:
    """Per layer of the released 3B (bf16): exchange vs compute of the slowest rank, and what overlap can hide."""
    from ..models.seedvr2.nadit.config import SEEDVR2_3B as cfg
    from ..sp.choice import Link, _a2a_time, _attn_flops, _token_flops
    from ..windows.schedule import plan_schedule

    link = link or Link()
    inner, tok, L = cfg.heads * cfg.head_dim, _token_flops(cfg), cfg.txt_len
    rows = []
    for name, grid in RESOLUTIONS.items():
        for sp in sps:
            sch = plan_schedule(grid, cfg.window_methods, sp, planner, cfg.num_windows)
            t = next(iter(sch.distinct_transitions().values()))
            plan = t.dst
            counts = plan.layout.token_counts
            loads = np.array([plan.rank_tokens[r] * tok + _attn_flops(counts[list(ws)], L, inner)
                              for r, ws in enumerate(plan.rank_windows)])
            compute = loads.max() / link.flops
            ex, _ = _a2a_time(t.counts, cfg.vid_dim * 2, link)
            ex += link.latency
            stay = float(np.diag(t.counts).min() / t.counts.sum(0).max())  # the least a rank keeps
            rows.append({
                "request": name, "grid": list(grid), "sp": sp, "exchange_ms": 1e3 * ex, "compute_ms": 1e3 * compute,
                "exchange_over_compute": ex / compute, "stay_fraction": stay,
                # stay-windows first: at most the staying rows' share of the layer's compute hides the transfer
                "hideable_split_ms": 1e3 * min(ex, stay * compute),
            })
    return rows


def format_tables(row: dict | None, ana: list[dict], threads: int) -> str:
    out = []
    if row:
        out.append(
            f"model {row['model']} ({row['layers']} layers), grid {tuple(row['grid'])}, SP={row['sp']}, planner "
            f"{row['planner']}, {threads} thread(s) per rank, gloo loopback, policies interleaved, median of "
            f"{row['repeats']} (slowest rank per forward), chunked capacity {row['capacity'] / 2**20:g} MiB\n\n"
            "| transport | chunks per change | forward s | time in layout changes s | share of forward |\n"
            "| --- | ---: | ---: | ---: | ---: |")
        for mode in MODES:
            m = row[mode]
            out.append(f"| {mode} | {m['chunks']} | {m['forward_s']:.3f} | {m['exchange_s']:.3f} "
                       f"| {100 * m['exchange_s'] / m['forward_s']:.1f}% |")
        out.append(f"\nchunked/off: forward {row['forward_ratio']:.3f}, layout changes "
                   f"{row['exchange_ratio']:.3f}\n")
    out.append("| request (81 frames) | SP | exchange ms/layer | compute ms/layer | exchange/compute "
               "| rows kept (min rank) | hideable if stay-windows ran first, ms |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for a in ana:
        out.append(f"| {a['request']} {tuple(a['grid'])} | {a['sp']} | {a['exchange_ms']:.2f} | {a['compute_ms']:.2f} "
                   f"| {a['exchange_over_compute']:.3f} | {100 * a['stay_fraction']:.0f}% | {a['hideable_split_ms']:.2f} |")
    return "\n".join(out)


def add_parser(sub) -> None:
    p = sub.add_parser("overlap", help="window SP layout changes per transport policy (measured) and what "
                       "overlap could hide (analytical)")
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--grid", default="5,45,80", help="post-patch grid T,H,W")
    p.add_argument("--sp", type=positive_int, default=2)
    p.add_argument("--planner", default="lpt")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--capacity-mib", type=float, default=1.0, help="staging capacity of the chunked policy (MiB)")
    p.add_argument("--analytical-only", action="store_true")
    p.add_argument("--out", default="benchmarks/results", help="folder for overlap.md and overlap.json")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, parser=None) -> int:
    from ..models.seedvr2.job.sizing import parse_grid

    grid = parse_grid(args.grid)
    row = None if args.analytical_only else measure(args.model, grid, args.layers, args.sp, args.planner,
                                                    args.repeats, args.threads, int(args.capacity_mib * 2**20))
    ana = analytical()
    text = format_tables(row, ana, args.threads)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overlap.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump({"measured": row, "analytical": ana}, f, indent=1)
    print(f"wrote {args.out}/overlap.md, overlap.json")
    return 0
