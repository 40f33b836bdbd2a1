"""Arguments several commands share: the request (grid or resolution) and how to resolve it, and the
argument types and checks every command uses so a bad value is one line on stderr before any work."""

from __future__ import annotations

import argparse
import os

from ..models.seedvr2.sizing import parse_grid, parse_resolution, request_grid


def _number(kind, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _number(int, text, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _number(int, text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    v = _number(float, text, "a number > 0")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    v = _number(float, text, "a number >= 0")
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (e.g. ``2,4``), at least one."""
    items = [v.strip() for v in text.split(",")]
    if not text.strip() or any(not v for v in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (e.g. 2,4), got {text!r}")
    return [_list_item(v, text) for v in items]


def _list_item(v: str, text: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (e.g. 2,4), got {text!r}")
    return n


def choice_list(choices) -> callable:
    """argparse type: a comma-separated subset of ``choices`` (names checked up front)."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",")]
        bad = [v for v in names if v not in allowed]
        if not text.strip() or bad:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {', '.join(map(repr, bad)) or repr(text)}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(names))

    return parse


def check_layers(parser: argparse.ArgumentParser, layers: int | None, model: str, strict: bool = False) -> None:
    """``--layers`` must be >= 1 and, when ``strict`` (weights from a checkpoint), at most the preset's."""
    from ..models.seedvr2.nadit.config import PRESETS

    if layers is None:
        return
    if layers < 1:
        parser.error(f"--layers must be >= 1, got {layers}")
    preset = PRESETS[model].num_layers if model in PRESETS else None
    if strict and preset is not None and layers > preset:
        parser.error(f"--layers {layers}: {model} has {preset} layers (a checkpoint cannot supply more)")


def check_output_file(parser: argparse.ArgumentParser, path: str | None, flag: str) -> None:
    """The folder of an output file must exist and be writable (checked before any work)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: folder {folder} is not writable")
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder, not a file")


def check_output_folder(parser: argparse.ArgumentParser, path: str, flag: str) -> None:
    """An output folder: created now (before any work) if missing; one line if that fails."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parser.error(f"{flag} {path}: cannot create the folder ({e.strerror or e})")
    if not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: folder is not writable")


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


def add_deterministic_arg(p: argparse.ArgumentParser) -> None:
    """``--deterministic`` / ``--no-deterministic``: fixed-shape kernel calls (ditsp.fixed_shape) or plain ones."""
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="fixed-shape kernel calls, so the output is the same bits at every SP degree on any CPU "
                        "(default); --no-deterministic runs plain calls (equal within tolerance, faster)")


def add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--grid", help="post-patch token grid T,H,W (e.g. 21,45,80)")
    g.add_argument("--resolution", help="pixel resolution WIDTHxHEIGHT (with --frames)")
    p.add_argument("--frames", type=positive_int, help="pixel frames (with --resolution); 4n+1, else padded")


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
