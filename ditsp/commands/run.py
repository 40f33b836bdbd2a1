"""`ditsp run`: one NaDiT forward under SP on local ranks or in a torchrun job, with a report.

Before any rank starts, the command checks its arguments, the planner's size
(:mod:`ditsp.windows.schedule`) and the resources: the modelled memory of one
rank (:func:`estimate_rank_memory`) against this machine's available memory
per local rank (or ``--max-memory``), and the local ranks against the CPU
cores. ``--force`` skips the resource check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from ..argtypes import timeout_seconds
from ..dtypes import DTYPES
from ..memory import RANK_BASE_BYTES
from ..weights.fp8 import WEIGHTS_DTYPES
from ..models.seedvr2.nadit.config import PRESETS
from .common import (add_compile_arg, add_deterministic_arg, add_plan_limit_args, add_request_args, check_layers, check_plan_size, check_planner,
                     nonneg_int, positive_float, positive_int, resolve_grid)

GiB = 2**30


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run one NaDiT forward under SP (local ranks or a torchrun job)")
    add_request_args(p)
    p.add_argument("--sp", type=positive_int, required=True, help="sequence-parallel degree (ranks)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=positive_int, help="override the model's layer count")
    p.add_argument("--checkpoint", help=".pth, .safetensors (float or FP8) or .gguf with the reference key names "
                                        "(else seeded weights)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--weights-dtype", default="stored", choices=list(WEIGHTS_DTYPES),
                   help="keep float weights as stored (cast to --dtype) or quantize them to FP8 at load")
    p.add_argument("--offload-blocks", type=nonneg_int, default=0, metavar="N",
                   help="keep the first N DiT blocks in host memory, each brought to the device ahead of its turn")
    p.add_argument("--planner", default=None,
                   help="window planner (lpt, locality); giving one runs Plan A with it even under --path auto")
    p.add_argument("--path", default="auto", choices=["window", "ulysses", "halo", "auto"],
                   help="Plan A (window), Ulysses baseline, halo-slab Plan B, or auto (cost model)")
    p.add_argument("--check", action="store_true", help="also run single-device and print the parity error")
    add_deterministic_arg(p)
    add_compile_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=nonneg_int, default=0, help="forwards before the timed ones")
    p.add_argument("--repeats", type=positive_int, default=1, help="timed forwards (the report shows the fastest)")
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per rank")
    p.add_argument("--timeout", type=timeout_seconds, default=3600.0,
                   help="seconds a rank may go without progress (no collective completed) before it counts as stuck")
    p.add_argument("--max-memory", type=positive_float, metavar="GiB",
                   help="memory one rank may use (default: available memory / local ranks)")
    p.add_argument("--force", action="store_true", help="skip the memory and CPU checks before starting ranks")
    add_plan_limit_args(p)
    p.set_defaults(func=main)
    return p


@dataclass(frozen=True)
class RankMemory:
    """Modelled peak bytes of one rank of `ditsp run` (a model, not a measurement)."""

    base: int  # the process itself (spawned ranks only)
    weights: int  # every rank holds all weights (plus the checkpoint file while loading)
    activations: int  # the largest per-layer tensors of this rank's token share
    io: int  # full-size input and gathered output, held on every rank
    plan: int  # the planner's own memory (every rank plans)
    parent: int  # extra in the launching process (--check: a single-device forward)

    @property
    def total(self) -> int:
        return self.base + self.weights + self.activations + self.io + self.plan

    def describe(self) -> str:
        return (f"{self.total / GiB:.2f} GiB per rank (process {self.base / GiB:.2f}, weights {self.weights / GiB:.2f}, "
                f"activations {self.activations / GiB:.2f}, input/output {self.io / GiB:.2f}, "
                f"plan {self.plan / GiB:.2f})")


def estimate_rank_memory(cfg, dtype: str, grid, sp: int, checkpoint: str | None, plan_bytes: int,
                         spawned: bool, check: bool, weights_dtype: str | None = None) -> RankMemory:
    """Weights as kept (stored format + one layer's dequantization buffer) + activations of the rank's
    token share + the rest."""
    from ..weights.sizing import by_format, of_checkpoint

    e = DTYPES[dtype].itemsize
    tokens = grid[0] * grid[1] * grid[2]
    share = -(-tokens // sp)
    per_token = (6 * cfg.vid_dim + 2 * cfg.mlp_hidden) * e  # residual, norm, q/k/v, attention out, MLP hidden
    weights = cfg.param_count() * e
    if checkpoint and os.path.isfile(checkpoint):
        try:
            weights = of_checkpoint(checkpoint, dtype, weights_dtype).total  # streamed: no second copy
        except ValueError:
            pass  # an unreadable file fails with its own message when the ranks load it
    elif weights_dtype:
        from ..models.seedvr2.job.weight_memory import dit_shapes

        weights = by_format(dict(dit_shapes(cfg.name, cfg.num_layers)) if cfg.name in PRESETS else {}, weights_dtype,
                            dtype).total or weights
    io = tokens * (cfg.patch_channels + 2 * cfg.out_patch_channels) * 4  # fp32 input, output and its gather
    parent = (cfg.param_count() * e + tokens * per_token) if check else 0
    return RankMemory(RANK_BASE_BYTES if spawned else 0, int(weights), int(share * per_token), int(io),
                      int(plan_bytes), int(parent))


def check_resources(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg, grid, plan_bytes: int) -> None:
    """Refuse (one line) a run whose modelled memory per rank exceeds what one rank can use, or with
    far more local ranks than CPU cores; warn (one line) when threads oversubscribe the cores."""
    from ..distributed.torchrun import under_torchrun
    from ..memory import available_bytes, check_local_cores

    torchrun = under_torchrun()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.sp)) if torchrun else args.sp
    spawned = local > 1 and not torchrun
    est = estimate_rank_memory(cfg, args.dtype, grid, args.sp, args.checkpoint, plan_bytes, spawned, args.check,
                               None if args.weights_dtype == "stored" else args.weights_dtype)
    if args.force:
        if spawned:
            from ..memory import check_local_ranks

            try:
                check_local_ranks(local)  # even with --force: the ranks' processes would not fit
            except ValueError as e:
                parser.error(str(e))
        return
    if args.max_memory:
        budget, source = int(args.max_memory * GiB), "--max-memory"
    else:
        budget, source = available_bytes(local), f"available memory / {local} local rank{'s' if local > 1 else ''}"
    need = est.total + -(-est.parent // local)
    if need > budget:
        extra = f" + {est.parent / GiB:.2f} GiB for --check in the launching process" if est.parent else ""
        parser.error(f"not enough memory: the run needs about {est.describe()}{extra}, but {source} is "
                     f"{budget / GiB:.2f} GiB (spread the ranks over more machines, use --dtype bf16 or fewer "
                     f"--layers; --max-memory GiB or --force overrides)")
    try:
        warning = check_local_cores(local, args.threads, what="--sp",
                                    remedy="use fewer ranks, or --force to start them anyway")
    except ValueError as e:
        parser.error(str(e))
    if warning:
        print(f"ditsp run: warning: {warning}", file=sys.stderr)


def _one_line(message: str) -> str:
    """A multi-line error as one line: its first line, plus the titles of the lists below it."""
    lines = str(message).strip().splitlines() or [""]
    titles = [ln.strip().rstrip(":") for ln in lines[1:] if ln.startswith("  ") and not ln.startswith("   ")]
    return lines[0] + (" " + ", ".join(titles) if titles else "")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..distributed.launcher import RankError
    from ..models.seedvr2.job.forward import RunSpec, run
    from ..models.seedvr2.nadit.checkpoint import CheckpointError
    from ..models.seedvr2.nadit.config import get_config
    from ..windows.schedule import plan_limits

    check_layers(parser, args.layers, args.model, strict=bool(args.checkpoint))
    if args.compile:
        from ..models.seedvr2.compiled import check_policy

        try:
            check_policy(args.deterministic)
        except ValueError as e:
            parser.error(str(e))
    if args.planner is not None:
        check_planner(parser, args.planner)
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    grid, notes = resolve_grid(args, parser)  # sized as the released pipeline: run measures a DiT alone
    cfg = get_config(args.model, args.layers)
    if args.offload_blocks > cfg.num_layers:
        parser.error(f"--offload-blocks {args.offload_blocks}: the model has {cfg.num_layers} blocks")
    plan = check_plan_size(parser, args, grid, cfg, args.sp, args.planner or "locality")  # auto plans every path
    check_resources(parser, args, cfg, grid, plan.bytes)
    spec = RunSpec(model=args.model, grid=grid, sp=args.sp, layers=args.layers, checkpoint=args.checkpoint,
                   dtype=args.dtype, planner=args.planner, path=args.path, seed=args.seed,
                   warmup=args.warmup, repeats=args.repeats, deterministic=args.deterministic, compile=args.compile,
                   weights_dtype=None if args.weights_dtype == "stored" else args.weights_dtype,
                   offload_blocks=args.offload_blocks)
    try:
        with plan_limits(args.max_plan_memory, args.max_plan_seconds):
            summary = run(spec, check=args.check, threads=args.threads, timeout_s=args.timeout)
    except CheckpointError as e:
        parser.exit(1, f"ditsp run: error: {_one_line(e)}\n")
    except RankError as e:
        first, _, details = (str(e) or type(e).__name__).partition("\n")
        if "CheckpointError" in first or "PlanTooLargeError" in first:  # a bad input: its line says it all
            details = ""
        # the error line first, then every rank's traceback or stack (not the launcher's own traceback)
        parser.exit(1, f"ditsp run: error: {first}\n" + (f"{details.rstrip()}\n" if details.strip() else ""))
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
        f"kernel calls: {summary['kernel_shapes']}",
        f"compile: {summary.get('compile', 'eager')}"
        + (f" (warm-up compile {max(summary['compile_warmup_s']):.1f} s, max rank)" if summary.get("compile_warmup_s") else ""),
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
