"""`ditsp` command line: each command is a module of :mod:`ditsp.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditsp", description="Sequence parallelism for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "sp", None), int) and args.sp < 1:
        parser.error("--sp must be >= 1")
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
