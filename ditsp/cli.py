"""`ditsp` command line: each command is a module of :mod:`ditsp.commands`."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from .commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditsp", description="Sequence parallelism for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).add_parser(sub)
    return parser


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: ranks stopped, temporary files removed


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "sp", None), int) and args.sp < 1:
        parser.error("--sp must be >= 1")
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return args.func(args, parser)
    except KeyboardInterrupt:  # one line, not a traceback
        print(f"ditsp {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())
