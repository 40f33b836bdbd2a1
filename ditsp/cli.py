"""`ditsp` command line: plan a request, run a model, benchmark the paths."""

from __future__ import annotations

import argparse
import json
import sys

from .models.seedvr2.nadit.config import PRESETS, get_config
from .models.seedvr2.sizing import parse_grid, parse_resolution, request_grid


def add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--grid", help="post-patch token grid T,H,W (e.g. 21,45,80)")
    g.add_argument("--resolution", help="pixel resolution WIDTHxHEIGHT (with --frames)")
    p.add_argument("--frames", type=int, help="pixel frames (with --resolution); 4n+1, else padded")


def resolve_grid(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[tuple[int, int, int], list[str]]:
    """The token grid of a request, and notes on what was cropped or padded."""
    try:
        if args.grid:
            if args.frames is not None:
                parser.error("--frames goes with --resolution, not --grid")
            return parse_grid(args.grid), []
        if args.frames is None:
            parser.error("--resolution needs --frames")
        w, h = parse_resolution(args.resolution)
        req = request_grid(w, h, args.frames)
        return req.grid, req.notes()
    except ValueError as e:
        parser.error(str(e))


def cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .models.seedvr2.plan_report import format_summary, plan_request, summarize
    from .windows.planner import planner_names

    grid, notes = resolve_grid(args, parser)
    cfg = get_config(args.model, args.layers)
    planners = planner_names() if args.planner == "all" else [args.planner]
    summaries, schedules = [], []
    for name in planners:
        try:
            schedule = plan_request(grid, cfg, args.sp, name)
        except ValueError as e:
            parser.error(str(e))
        schedules.append(schedule)
        summaries.append(summarize(schedule, cfg))
    if args.json:
        out = summaries[0] if len(summaries) == 1 else {s["planner"]: s for s in summaries}
        if notes:
            (out if len(summaries) == 1 else out).setdefault("notes", notes)
        print(json.dumps(out, indent=None if args.compact else 2))
    else:
        print("\n\n".join(format_summary(s, notes) for s in summaries))
    if args.plot:
        from .windows.viz import plot_schedule

        for schedule in schedules:
            path = args.plot if len(schedules) == 1 else args.plot.replace(".png", f"-{schedule.planner}.png")
            plot_schedule(schedule, path)
            if not args.json:
                print(f"wrote {path}")
    return 0


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .runner import RunSpec, format_run, run

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditsp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan window-aligned SP for one request (no GPU, no model)")
    add_request_args(p)
    p.add_argument("--sp", type=int, required=True, help="sequence-parallel degree")
    p.add_argument("--model", default="seedvr2-3b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="override the model's layer count")
    p.add_argument("--planner", default="lpt", help="window planner (lpt, ...) or 'all' to compare")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compact", action="store_true", help="JSON on one line")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture of the plan")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="run one NaDiT forward under SP (local ranks or a torchrun job)")
    add_request_args(p)
    p.add_argument("--sp", type=int, required=True, help="sequence-parallel degree (ranks)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="override the model's layer count")
    p.add_argument("--checkpoint", help=".pth or .safetensors with the reference key names (else seeded weights)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
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
    p.set_defaults(func=cmd_run)

    from .bench import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "sp", None), int) and args.sp < 1:
        parser.error("--sp must be >= 1")
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
