"""Arguments several commands share: the request (grid or resolution) and how to resolve it."""

from __future__ import annotations

import argparse

from ..models.seedvr2.sizing import parse_grid, parse_resolution, request_grid

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
