"""`ditsp` command line: each command is a module of :mod:`ditsp.commands`."""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading

from .cpu import malloc as cpu_malloc
from .cpu import settings as cpu_settings
from .commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditsp", description="Sequence parallelism for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).add_parser(sub)
    return parser


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: ranks stopped, temporary files removed


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The command's own parser: its errors print its usage under its name (``ditsp train: error: ...``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    parser = command_parser(parser, args.command)
    if isinstance(getattr(args, "sp", None), int) and args.sp < 1:
        parser.error(f"argument --sp: must be an integer >= 1, got {args.sp}")
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


def run(argv: list[str] | None = None) -> None:
    """The `ditsp` program: the CPU settings read (:mod:`ditsp.cpu.settings`; a bad value is one line and
    code 2), started again under the CPU allocator policy only when ``malloc_restart`` asks for it and the
    command line is this process's own, then :func:`main`, then :func:`fast_exit` with its code."""
    try:
        restart = cpu_settings.process().malloc_restart
    except ValueError as e:  # a CPU setting's environment variable holds no valid value
        print(f"ditsp: {e}", file=sys.stderr)
        fast_exit(2)
    if argv is None and restart:
        cpu_malloc.reexec()
    fast_exit(main(argv))


def fast_exit(code: int | None) -> None:
    """Leave the process as a finished command may: non-daemon threads joined, exit handlers run (the
    multiprocessing ones stop local ranks; temporary folders go), stdout and stderr flushed, then
    ``os._exit`` without the interpreter's teardown of torch's modules, which cost 0.6-1 s at the end of
    every `ditsp upscale`. An exception out of ``main`` is not a code: it takes the ordinary way out."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream: nothing left to say there
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


if __name__ == "__main__":
    run()
