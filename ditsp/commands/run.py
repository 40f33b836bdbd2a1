"""`ditsp run`: one NaDiT forward under SP on local ranks or in a torchrun job, with a report."""

from __future__ import annotations

import argparse
import json

from ..engine import DTYPES
from ..models.seedvr2.nadit.config import PRESETS
from .common import add_request_args, resolve_grid


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run one NaDiT forward under SP (local ranks or a torchrun job)")
    add_request_args(p)
    p.add_argument("--sp", type=int, required=True, help="sequence-parallel degree (ranks)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="override the model's layer count")
    p.add_argument("--checkpoint", help=".pth or .safetensors with the reference key names (else seeded weights)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--planner", default="lpt", help="window planner")
    p.add_argument("--path", default="window", choices=["window", "ulysses"],
                   help="window-aligned SP, or the reference's Ulysses all-to-alls around window attention")
    p.add_argument("--check", action="store_true", help="also run single-device and print the parity error")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="forwards before the timed ones")
    p.add_argument("--repeats", type=int, default=1, help="timed forwards (the report shows the fastest)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a stuck run is ended")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..engine import RunSpec, run

    grid, notes = resolve_grid(args, parser)
    spec = RunSpec(model=args.model, grid=grid, sp=args.sp, layers=args.layers, checkpoint=args.checkpoint,
                   dtype=args.dtype, planner=args.planner, path=args.path, seed=args.seed,
                   warmup=args.warmup, repeats=args.repeats)
    summary = run(spec, check=args.check, threads=args.threads, timeout_s=args.timeout)
    summary["notes"] = notes
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join([*(f"note: {n}" for n in notes), format_run(summary)]))
    return 0


def format_run(summary: dict) -> str:
    """The text report of `ditsp run`."""
    s = summary["spec"]
    lines = [
        f"{s['model']} ({s['layers'] or 'all'} layers), grid {tuple(s['grid'])}, {s['dtype']}: {summary['path']}",
        f"{'rank':>5} {'time s':>9} {'peak MiB':>9} {'sent MiB':>9} {'calls':>6}",
    ]
    for r, (t, p, b, c) in enumerate(zip(summary["rank_time_s"], summary["rank_peak_bytes"],
                                         summary["rank_bytes_sent"], summary["rank_calls"])):
        lines.append(f"{r:>5} {t:>9.3f} {p / 2**20:>9.1f} {b / 2**20:>9.2f} {c:>6}")
    kinds = ", ".join(f"{k} x{v['calls']}" for k, v in summary["collectives"].items())
    lines.append(f"bytes moved (all ranks): {summary['bytes_moved'] / 2**20:.2f} MiB; rank 0 collectives: {kinds or 'none'}")
    if "max_abs_err" in summary:
        lines.append(
            f"parity vs single device: max abs err {summary['max_abs_err']:.3e} "
            f"(output max {summary['ref_max_abs']:.3f}, relative {summary['rel_err']:.2e})"
        )
    return "\n".join(lines)
