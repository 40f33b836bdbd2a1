"""`ditsp verify DIR`: check the port against a reference vector set, on one device and under SP."""

from __future__ import annotations

import argparse
import json

from .common import positive_int_list


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="check a reference vector set (config.json + weights + io) at SP degrees")
    p.add_argument("dir", help="vector set folder (config.json, weights.safetensors, io.safetensors)")
    p.add_argument("--sp", default="1,2,3", type=positive_int_list, help="SP degrees to run, comma separated (1 = one device)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..models.seedvr2.verify import VectorSetError, format_verify, verify_vectors

    degrees = args.sp if isinstance(args.sp, list) else positive_int_list(args.sp)
    try:
        result = verify_vectors(args.dir, degrees)
    except VectorSetError as e:
        parser.exit(2, f"ditsp verify: error: {e}\n")
    print(json.dumps(result, indent=2) if args.json else format_verify(result))
    return 0 if result["pass"] else 1
