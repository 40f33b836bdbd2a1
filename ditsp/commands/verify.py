"""`ditsp verify DIR`: check the port against a reference vector set, on one device and under SP."""

from __future__ import annotations

import argparse
import json
import sys

from .common import positive_int_list


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="check a reference vector set (config.json + weights + io) at SP degrees")
    p.add_argument("dir", help="vector set folder (config.json, weights.safetensors, io.safetensors)")
    p.add_argument("--sp", default="1,2,3", type=positive_int_list, help="SP degrees to run, comma separated (1 = one device)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
    return p


def _fail(msg: str, code: int) -> int:
    print(f"ditsp verify: error: {msg}", file=sys.stderr)
    return code


def check_size(directory: str, degrees: list[int]) -> None:
    """Before anything is built or spawned: the rank count, then the estimated memory of the largest degree
    (the launching process's model plus each rank's), against the available memory."""
    from ..memory import RANK_BASE_BYTES, available_bytes, check_local_ranks
    from ..models.seedvr2.verify import estimate_bytes

    most = max(degrees)
    try:
        check_local_ranks(most)
    except ValueError as e:
        raise MemoryError(str(e)) from None
    one = estimate_bytes(directory)
    need = one + (most * (one + RANK_BASE_BYTES) if most > 1 else 0)
    have = available_bytes(1)
    if need > have:
        raise MemoryError(f"{directory}: checking it at --sp {most} needs about {need / 2**30:.2f} GiB "
                          f"({one / 2**30:.2f} GiB per process for the model config.json describes), but "
                          f"{have / 2**30:.2f} GiB is available")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..distributed.launcher import RankError, error_line
    from ..models.seedvr2.verify import VectorSetError, format_verify, verify_vectors
    from ..errors import one_line

    degrees = args.sp if isinstance(args.sp, list) else positive_int_list(args.sp)
    try:
        check_size(args.dir, degrees)
        result = verify_vectors(args.dir, degrees)
    except (VectorSetError, MemoryError) as e:
        return _fail(one_line(str(e)), 2)
    except RankError as e:  # its first line names the cause on each failed rank
        return _fail(str(e).splitlines()[0], 1)
    except Exception as e:  # noqa: BLE001 - a malformed set (bad shapes, dtypes, files): one line, not a traceback
        return _fail(f"{args.dir}: malformed vector set: {error_line(e)}", 1)
    print(json.dumps(result, indent=2) if args.json else format_verify(result))
    return 0 if result["pass"] else 1
