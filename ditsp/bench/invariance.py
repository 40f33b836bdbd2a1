"""`ditsp bench invariance`: the cost of the degree-invariant NaDiT path vs the previous one.

    ditsp bench invariance [--model small] [--layers 4] [--cases 1,21,21@4;5,20,36@4] [--repeats 5]

Two arms, run side by side on the same ranks, interleaved repeat by repeat:

- ``previous``: per-rank text sums reduced across ranks in fp32, tokenwise
  linears called on whatever row count the rank holds;
- ``invariant`` (the default path): text sums reduced in fp64, tokenwise
  linears in calls of a multiple of 4 rows (:mod:`ditsp.models.seedvr2.nadit.tokenwise`).

Per case it reports the per-rank forward time (minimum and median over the
repeats, slowest rank), the bytes every rank sent (all collectives, and the
text all-reduce alone) and whether the output equals the one-device output of
the same arm bit for bit. One compute thread per rank and for the one-device
output. Writes ``invariance.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ..commands.common import positive_int
from ..dist.comm import Comm
from ..dist.launcher import LocalCluster
from ..engine import RunSpec, build_for
from ..models.seedvr2.nadit.config import PRESETS
from ..models.seedvr2.nadit.tokenwise import row_guard
from ..sp import WindowRuntime

ARMS = {"previous": (torch.float32, False), "invariant": (torch.float64, True)}


def _parse_cases(text: str) -> list[tuple[tuple[int, int, int], int]]:
    cases = []
    for item in text.split(";"):
        grid, sp = item.split("@")
        cases.append((tuple(int(v) for v in grid.split(",")), int(sp)))
    return cases


@torch.no_grad()
def _rank(ctx, spec: RunSpec, repeats: int) -> dict:
    model, vid, txt = build_for(spec)
    cfg = model.cfg
    out, times, sent, text = {}, {a: [] for a in ARMS}, {}, {}
    rts = {a: WindowRuntime(spec.grid, cfg.window_methods, Comm.of(ctx.group if ctx.world_size > 1 else None),
                            spec.planner, cfg.num_windows, dt) for a, (dt, _) in ARMS.items()}
    for i in range(repeats + 1):  # the first round warms up
        for arm, (_, guard) in ARMS.items():
            rt = rts[arm]
            rt.comm.stats.reset()
            with row_guard(guard):
                t0 = time.perf_counter()
                y = model(vid, txt, 1000.0, runtime=rt)
                dt = time.perf_counter() - t0
            if i:
                times[arm].append(dt)
            out[arm] = y
            stats = rt.comm.stats.as_dict()
            sent[arm] = sum(v["bytes_sent"] for v in stats.values())
            text[arm] = stats.get("text_all_reduce", {}).get("bytes_sent", 0)
    return {"times": times, "sent": sent, "text": text, "out": out if ctx.rank == 0 else None,
            "rows": [int(rts["invariant"].num_local_rows(i)) for i in range(len(cfg.window_methods))]}


def _single(spec: RunSpec) -> dict:
    torch.set_num_threads(1)
    from ..dist.launcher import RankContext

    return _rank(RankContext(0, 1, None, torch.device("cpu")), spec, 0)["out"]


def run(model: str, layers: int, cases, repeats: int, dtype: str = "fp32") -> list[dict]:
    rows = []
    for grid, sp in cases:
        spec = RunSpec(model, grid, sp, layers=layers, dtype=dtype)
        ref = _single(RunSpec(model, grid, 1, layers=layers, dtype=dtype))
        with LocalCluster(sp, threads=1, timeout_s=600) as cluster:
            res = cluster.run(_rank, spec, repeats)
        for arm in ARMS:
            per_rank_min = [min(r["times"][arm]) for r in res]
            per_rank_med = [statistics.median(r["times"][arm]) for r in res]
            rows.append({
                "grid": grid, "sp": sp, "arm": arm, "min_s": max(per_rank_min), "median_s": max(per_rank_med),
                "bytes_sent": sum(r["sent"][arm] for r in res), "text_bytes": sum(r["text"][arm] for r in res),
                "bitwise": bool(torch.equal(res[0]["out"][arm], ref[arm])),
                "min_rows": min(min(r["rows"]) for r in res),
            })
    return rows


def format_md(rows: list[dict], model: str, layers: int, dtype: str, repeats: int) -> str:
    lines = [f"# Degree invariance: cost of the invariant path ({model}, {layers} layers, {dtype})", "",
             f"`ditsp bench invariance`: one compute thread per rank, {repeats} interleaved repeats after a warm-up; "
             "time = slowest rank's min (median); bytes = all ranks' collective sends of one forward.", "",
             "| grid | SP | smallest rank rows | arm | time min s | time median s | bytes sent | text all-reduce bytes "
             "| bitwise = SP 1 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {'x'.join(map(str, r['grid']))} | {r['sp']} | {r['min_rows']} | {r['arm']} | {r['min_s']:.4f} "
                     f"| {r['median_s']:.4f} | {r['bytes_sent']:,} | {r['text_bytes']:,} | {r['bitwise']} |")
    lines.append("")
    for grid, sp in dict.fromkeys((r["grid"], r["sp"]) for r in rows):
        a, b = (next(r for r in rows if r["grid"] == grid and r["sp"] == sp and r["arm"] == k)
                for k in ("previous", "invariant"))
        lines.append(f"- {'x'.join(map(str, grid))} SP={sp}: time x{b['min_s'] / a['min_s']:.3f} (min), "
                     f"x{b['median_s'] / a['median_s']:.3f} (median); bytes +{b['bytes_sent'] - a['bytes_sent']:,} "
                     f"(x{b['bytes_sent'] / max(a['bytes_sent'], 1):.4f})")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("invariance", help="cost of the SP-degree-invariant path vs the previous one")
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--cases", default="1,21,21@4;5,20,36@4", help="grid@SP items separated by ';'")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--out", default="benchmarks/results", help="folder for invariance.md")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, parser=None) -> int:
    rows = run(args.model, args.layers, _parse_cases(args.cases), args.repeats, args.dtype)
    text = format_md(rows, args.model, args.layers, args.dtype, args.repeats)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "invariance.md").write_text(text)
    return 0
