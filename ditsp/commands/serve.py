"""`ditsp serve --sp N`: restore videos sent over HTTP on a persistent SP group that survives losing ranks.

The model is loaded once; jobs queue in SQLite under ``--data-dir`` and
survive a restart. The server listens on 127.0.0.1 unless told otherwise, and
refuses any other address without ``--token-file``. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading

from ..dtypes import NAMES as DTYPE_NAMES
from ..models.seedvr2.presets import MODELS
from ..weights.shared import READS as WEIGHTS_READS
from ..fixed_shape import SERVE_DETERMINISTIC
from .common import add_compile_arg, add_deterministic_arg


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="restoration server (HTTP API) on a persistent, elastic SP group",
                       description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=1, help="ranks of the SP group (local worker processes)")
    p.add_argument("--model", default="tiny", choices=list(MODELS))
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights where no checkpoint is given (a smoke test, not a restoration)")
    p.add_argument("--dit", metavar="CKPT", help="DiT checkpoint")
    p.add_argument("--vae", metavar="CKPT", help="VAE checkpoint")
    p.add_argument("--text-embedding", metavar="FILE", help="text embedding, e.g. pos_emb.pt")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="default: bf16 for seedvr2-*, fp32 otherwise")
    p.add_argument("--weights-read", default=None, choices=WEIGHTS_READS,
                   help="how the ranks read the checkpoints: every-rank (default) or one-reader (see `ditsp upscale`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="another name requests may carry in their Host header (repeatable; '*': any). Default: the "
                        "--host address, and localhost/127.0.0.1/::1 on loopback; a wildcard --host takes any")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page origin (https://app.example:8443) allowed to call the API from a browser "
                        "(repeatable; default: none, cross-origin requests are refused)")
    p.add_argument("--port", type=int, default=8189, help="port (0: any free port; the URL is printed)")
    p.add_argument("--token-file", metavar="F", help="file holding the bearer token every request must carry")
    p.add_argument("--data-dir", default="ditsp-serve", metavar="D", help="jobs database, uploads and results")
    p.add_argument("--allow-input", action="append", default=[], metavar="DIR",
                   help="a folder whose files jobs may name by path (repeatable; default: uploads only)")
    p.add_argument("--max-upload-mb", type=float, default=512.0, metavar="M", help="largest upload accepted")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective fails (finite, > 0)")
    p.add_argument("--job-timeout", type=float, default=3600.0,
                   help="seconds a job may go without progress before it is declared stuck (finite, > 0)")
    p.add_argument("--no-respawn", action="store_true", help="do not replace lost ranks with new workers")
    add_deterministic_arg(p, default=SERVE_DETERMINISTIC)
    add_compile_arg(p)
    p.add_argument("--retention-hours", type=float, metavar="H",
                   help="delete results of jobs finished more than H hours ago (default: keep them)")
    p.set_defaults(func=main)
    return p


def _fail(msg: str) -> int:
    print(f"ditsp serve: error: {msg}", file=sys.stderr)
    return 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def settings_from(args):
    """The server's settings from its flags; ValueError (one line) for any that makes no sense."""
    from ..serve.settings import Settings

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.compile:
        from ..models.seedvr2.compiled import check_policy

        check_policy(args.deterministic)
    for flag, path in (("--dit", args.dit), ("--vae", args.vae), ("--text-embedding", args.text_embedding)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    for d in args.allow_input:
        if not os.path.isdir(d):
            raise ValueError(f"--allow-input {d}: not a folder")
    token = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"--token-file {args.token_file}: {e.strerror}") from None
        if len(token) < 16:
            raise ValueError(f"--token-file {args.token_file}: the token must be at least 16 characters")
    if not _is_loopback(args.host) and token is None:
        raise ValueError(f"--host {args.host} is not a loopback address: refusing to serve it without --token-file")
    return Settings(data_dir=args.data_dir, sp=args.sp, model=args.model, random_weights=args.random_weights,
                    dit=args.dit, vae=args.vae,
                    text_embedding=args.text_embedding, dtype=args.dtype, token=token, host=args.host,
                    allow_hosts=list(args.allow_host), allow_origins=list(args.allow_origin),
                    allow_input=list(args.allow_input), max_upload_mb=args.max_upload_mb, threads=args.threads,
                    timeout_s=args.timeout, job_timeout_s=args.job_timeout, respawn=not args.no_respawn,
                    deterministic=args.deterministic, compile=args.compile, weights_read=args.weights_read,
                    retention_hours=args.retention_hours)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import logging

    try:
        settings = settings_from(args)
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    except ValueError as e:
        return _fail(str(e))
    import uvicorn

    from ..serve.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app = create_app(settings)  # takes the data dir's lock: one server per data dir
    except ValueError as e:
        sock.close()
        return _fail(str(e))
    host, port = sock.getsockname()[:2]
    print(f"ditsp serve: listening on http://{host}:{port} (SP={settings.sp}, model {settings.model}"
          f"{', compiled' if settings.compile else ''}, "
          f"data {os.path.abspath(settings.data_dir)})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    controller = app.state.controller

    def stop_on_failure():  # a group that can never form (weights that do not load...) stops the server
        controller.failed.wait()
        server.should_exit = True

    threading.Thread(target=stop_on_failure, name="ditsp-serve-failure", daemon=True).start()
    server.run(sockets=[sock])
    if controller.error:
        return _fail(controller.error)
    return 0
