"""`ditsp verify DIR`: check the port against a reference vector set, on one device and under SP."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="check a reference vector set (config.json + weights + io) at SP degrees")
    p.add_argument("dir", help="vector set folder (config.json, weights.safetensors, io.safetensors)")
    p.add_argument("--sp", default="1,2,3", help="SP degrees to run, comma separated (1 = one device)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..models.seedvr2.verify import VectorSetError, format_verify, verify_vectors

    try:
        degrees = [int(v) for v in args.sp.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--sp must be comma-separated integers, got {args.sp!r}")
    if not degrees or min(degrees) < 1:
        parser.error(f"--sp degrees must be >= 1, got {args.sp!r}")
    try:
        result = verify_vectors(args.dir, degrees)
    except VectorSetError as e:
        parser.exit(2, f"ditsp verify: error: {e}\n")
    print(json.dumps(result, indent=2) if args.json else format_verify(result))
    return 0 if result["pass"] else 1
