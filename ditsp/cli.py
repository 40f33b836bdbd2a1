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


def run(argv: list[str] | None = None) -> None:
    """The `ditsp` program: started again under the CPU allocator policy (:mod:`ditsp.cpu_malloc`)
    when the command line is this process's own, then :func:`main`, then :func:`fast_exit` with its code."""
    if argv is None:
        try:
            cpu_malloc.reexec()
        except ValueError as e:  # an unknown DITSP_CPU_MALLOC
            print(f"ditsp: {e}", file=sys.stderr)
            fast_exit(2)
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
