"""Arguments several commands share: the request (grid or resolution) and how to resolve it, and the
argument types and checks every command uses so a bad value is one line on stderr before any work."""

from __future__ import annotations

import argparse

from ..argtypes import (  # noqa: F401 - the argument types live in ditsp.argtypes (benchmarks use them too)
    check_layers,
    check_output_file,
    check_output_folder,
    choice_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    positive_int_list,
    rank_numbers,
)
from ..fixed_shape import DEFAULT_DETERMINISTIC
from ..models.seedvr2.job.sizing import RELEASED_MODEL, parse_grid, parse_resolution, request_grid
from ..models.seedvr2 import presets


def check_planner(parser: argparse.ArgumentParser, name: str, allow_all: bool = False) -> None:
    """``--planner`` must name a registered planner (or ``all`` where comparing)."""
    from ..windows.planners import planner_names

    names = planner_names()
    if name not in names and not (allow_all and name == "all"):
        parser.error(f"--planner: unknown planner {name!r}; choose from {', '.join(names + (['all'] if allow_all else []))}")


def add_plan_limit_args(p: argparse.ArgumentParser) -> None:
    """``--max-plan-memory`` / ``--max-plan-seconds``: the planner's own limits (see :mod:`ditsp.windows.schedule`)."""
    p.add_argument("--max-plan-memory", type=positive_float, metavar="GiB",
                   help="refuse requests whose planning is estimated to need more (default 4 GiB)")
    p.add_argument("--max-plan-seconds", type=positive_float, metavar="S",
                   help="refuse requests whose planning is estimated to take longer (default 600 s)")


def add_capacity_args(p: argparse.ArgumentParser, detected: bool) -> None:
    """``--rank-memory`` / ``--rank-speed``: each rank's capacity, for a group of unequal devices
    (:mod:`ditsp.windows.capacity`); ``detected``: what the command uses when not given."""
    unset = "each rank's free memory, agreed by every rank" if detected else "no rank held to a memory figure"
    p.add_argument("--rank-memory", type=rank_numbers, metavar="GiB,...",
                   help=f"memory each rank may use, in rank order, e.g. 32,24 (default: {unset})")
    p.add_argument("--rank-speed", type=rank_numbers, metavar="X,...",
                   help="relative speed of each rank, e.g. 1,0.55: work is split in proportion, each rank's "
                        "modelled time its tokens / speed (default: each rank's memory over the largest, to "
                        "0.01: equal memory, equal speed)")


def check_capacities(parser: argparse.ArgumentParser, args: argparse.Namespace, sp: int):
    """The :class:`~ditsp.windows.capacity.Capacities` of ``--rank-memory`` / ``--rank-speed`` (None when
    neither is given); a count that is not ``sp``: one line on stderr."""
    from ..windows.capacity import GiB, Capacities

    memory, speed = getattr(args, "rank_memory", None), getattr(args, "rank_speed", None)
    if memory is None and speed is None:
        return None
    for flag, values in (("--rank-memory", memory), ("--rank-speed", speed)):
        if values is not None and len(values) != sp:
            parser.error(f"{flag}: {len(values)} value(s) for --sp {sp}; give one per rank")
    return Capacities.of(sp, None if memory is None else [int(m * GiB) for m in memory], speed)


def add_deterministic_arg(p: argparse.ArgumentParser, default: bool = DEFAULT_DETERMINISTIC) -> None:
    """``--deterministic`` / ``--no-deterministic``: fixed-shape kernel calls (ditsp.fixed_shape) or plain ones."""
    on, off = ("default", "faster") if default else ("about 1.05-1.5x the time", "default")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=default,
                   help=f"fixed-shape kernel calls, so the output is the same bits at every SP degree on any CPU "
                        f"({on}); --no-deterministic runs plain calls, equal within tolerance ({off})")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    """``--compile``: torch.compile of the DiT blocks and the VAE (ditsp.models.seedvr2.compiled). Its help names
    ``--no-deterministic`` only where the command has that flag (add it first)."""
    policy = ("needs --no-deterministic; " if "--no-deterministic" in p._option_string_actions
              else "runs the plain kernel calls (compiled kernels are not fixed-shape calls); ")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (inductor) the DiT blocks and the VAE's GroupNorm+SiLU; the first forward of "
                        f"each shape family compiles; {policy}the report says whether it ran compiled")


def add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--grid", help="post-patch token grid T,H,W (e.g. 21,45,80)")
    g.add_argument("--resolution", help="pixel resolution WIDTHxHEIGHT (with --frames)")
    p.add_argument("--frames", type=positive_int,
                   help="pixel frames (with --resolution); padded to the VAE's kn+1 (4n+1 for the released models)")


def model_name(text: str) -> str:
    """``--model``: a model of the table (:mod:`ditsp.models.seedvr2.presets`); the offered ones are listed, the
    hidden ones accepted."""
    try:
        presets.model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_model_arg(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """``--model NAME`` of the table of models, ``what`` saying what the command takes from it."""
    p.add_argument("--model", default=default, type=model_name, metavar="{" + ",".join(presets.OFFERED) + "}",
                   help=f"the model ({what}; default {default})")


def resolve_grid(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 model: str = RELEASED_MODEL) -> tuple[tuple[int, int, int], list[str]]:
    """The token grid of a request (``--resolution`` sized by ``model``'s VAE and patch), and notes on what was
    cropped or padded."""
    try:
        if args.grid:
            if args.frames is not None:
                parser.error("--frames goes with --resolution, not --grid")
            return parse_grid(args.grid), []
        if args.frames is None:
            parser.error("--resolution needs --frames")
        w, h = parse_resolution(args.resolution)
        req = request_grid(w, h, args.frames, model)
        return req.grid, req.notes()
    except ValueError as e:
        parser.error(str(e))


def check_plan_size(parser: argparse.ArgumentParser, args: argparse.Namespace, grid, cfg, sp: int, planner: str,
                    bytes_per_rank_pair: int = 0):
    """Refuse (one line, exit 2) a request whose planning would exceed the planner limits, before any work.

    ``bytes_per_rank_pair``: what the caller adds per entry of each distinct transition's count
    matrix (a report that lists them).
    """
    from ..windows.schedule import GiB, PlanTooLargeError, estimate_plan
    from ..windows.schedule import check_plan_size as check

    max_gib = getattr(args, "max_plan_memory", None)
    try:
        extra = 0
        if bytes_per_rank_pair:
            est = estimate_plan(grid, cfg.window_methods, sp, planner, cfg.num_windows)
            extra = est.transitions * sp * sp * bytes_per_rank_pair
        return check(grid, cfg.window_methods, sp, planner, cfg.num_windows,
                     max_bytes=None if max_gib is None else int(max_gib * GiB),
                     max_seconds=getattr(args, "max_plan_seconds", None), extra_bytes=extra)
    except (PlanTooLargeError, ValueError) as e:
        parser.error(str(e))
