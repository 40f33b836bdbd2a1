"""`ditsp plan`: plan window-aligned SP for one request (no GPU, no model) and report it."""

from __future__ import annotations

import argparse
import json

from ..models.gpus import NAMES as GPU_NAMES
from ..models.gpus import gpu as gpu_row
from ..models.seedvr2.job.sizing import RELEASED_MODEL
from ..models.seedvr2.presets import dit_config
from ..weights.sizing import ESTIMATE_FORMATS
from .common import (add_capacity_args, add_model_arg, add_plan_limit_args, add_request_args, check_capacities,
                     check_layers, check_output_file, check_plan_size, check_planner, positive_int, resolve_grid)

REPORT_BYTES_PER_PAIR = 24  # the JSON report's count matrices: a list slot and a few characters per entry


def gpu_name(text: str) -> str:
    """``--gpu``: a row of the GPU table (:mod:`ditsp.models.gpus`)."""
    try:
        return gpu_row(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="plan window-aligned SP for one request (no GPU, no model)")
    add_request_args(p)
    p.add_argument("--sp", type=positive_int, required=True, help="sequence-parallel degree")
    add_model_arg(p, RELEASED_MODEL, "its DiT is planned; --resolution is sized by its VAE's factors and DiT's patch")
    p.add_argument("--layers", type=positive_int, help="override the model's layer count")
    p.add_argument("--planner", default="lpt", help="window planner (lpt, ...) or 'all' to compare")
    p.add_argument("--weights-dtype", default="bf16", choices=list(ESTIMATE_FORMATS),
                   help="how the DiT's weights are stored on each rank, for the memory estimate (FP8 and GGUF: "
                        "quantized, plus one layer's dequantization buffer)")
    add_capacity_args(p, detected=False)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compact", action="store_true", help="JSON on one line")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture of the plan")
    p.add_argument("--gpu", type=gpu_name, metavar="{" + ",".join(GPU_NAMES) + "}",
                   help="size the job on this GPU at SP 1-8 and --sp: per-rank memory, modelled stage times, the "
                        "smallest degree and VAE mode that fit (a model until a GPU measurement calibrates it); "
                        "with --plot, also FILE-gpu.png")
    add_plan_limit_args(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..models.seedvr2.job.plan_report import format_summary, plan_for, plan_request, summarize
    from ..windows.planners import planner_names
    from ..windows.schedule import plan_limits

    check_layers(parser, args.layers, args.model)
    check_planner(parser, args.planner, allow_all=True)
    check_output_file(parser, args.plot, "--plot")
    caps = check_capacities(parser, args, args.sp)
    grid, notes = resolve_grid(args, parser, args.model)
    cfg = dit_config(args.model, args.layers)
    planners = planner_names() if args.planner == "all" else [args.planner]
    for name in planners:  # every refusal before any planning
        check_plan_size(parser, args, grid, cfg, args.sp, name, REPORT_BYTES_PER_PAIR)
    from ..models.seedvr2.job.weight_memory import dit_weights

    weights = None if args.weights_dtype == "bf16" else dit_weights(args.model, "bf16", fmt=args.weights_dtype,
                                                                   layers=args.layers)
    summaries, schedules = [], []
    with plan_limits(args.max_plan_memory, args.max_plan_seconds):
        for name in planners:
            try:
                schedule = plan_request(grid, cfg, args.sp, name) if caps is None else \
                    plan_for(grid, cfg, caps, name, weights)
                even = None if caps is None else plan_request(grid, cfg, args.sp, name)
            except ValueError as e:
                parser.error(str(e))
            schedules.append(schedule)
            summaries.append(summarize(schedule, cfg, weights, caps, even))
        sizing = _gpu_sizing(args, parser, grid, cfg) if args.gpu else None
    if args.json:
        out = summaries[0] if len(summaries) == 1 else {s["planner"]: s for s in summaries}
        if notes:
            (out if len(summaries) == 1 else out).setdefault("notes", notes)
        if sizing:
            out["gpu"] = sizing
        print(json.dumps(out, indent=None if args.compact else 2))
    else:
        print("\n\n".join(format_summary(s, notes) for s in summaries))
        if sizing:
            from ..models.seedvr2.job.gpu_sizing import format_sizing

            print("\n" + format_sizing(sizing))
    if args.plot:
        from ..windows.viz import plot_schedule

        for schedule in schedules:
            path = args.plot if len(schedules) == 1 else args.plot.replace(".png", f"-{schedule.planner}.png")
            plot_schedule(schedule, path)
            if not args.json:
                print(f"wrote {path}")
        if sizing:
            from ..models.seedvr2.job.gpu_sizing import plot_sizing

            path = args.plot.replace(".png", "-gpu.png")
            plot_sizing(sizing, path)
            if not args.json:
                print(f"wrote {path}")
    return 0


def _gpu_sizing(args: argparse.Namespace, parser: argparse.ArgumentParser, grid, cfg) -> dict:
    """The ``--gpu`` sizing at SP 1-8 and ``--sp`` (the lpt planner under ``--planner all``), every degree's
    planning size checked first."""
    from ..models.seedvr2.job.gpu_sizing import DEGREES, size

    planner = "lpt" if args.planner == "all" else args.planner
    degrees = sorted(set(DEGREES) | {args.sp})
    for sp in degrees:
        check_plan_size(parser, args, grid, cfg, sp, planner)
    return size(args.model, grid, gpu_row(args.gpu), planner, degrees, args.weights_dtype, args.layers)
