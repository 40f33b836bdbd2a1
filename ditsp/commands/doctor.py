"""`ditsp doctor`: does the bitwise guarantee hold on this machine's kernels, and at what cost?"""

from __future__ import annotations

import argparse
import json
import sys

from .common import positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="probe this machine's kernels: does SP give one device's bits here, at what cost")
    p.add_argument("--model", default="seedvr2-3b",
                   help="whose shapes to probe: seedvr2-3b, seedvr2-7b, tiny, tiny-7b, small (default seedvr2-3b)")
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: torch's current count)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from ..fixed_shape_probe import DTYPES, format_probe, probe
    from ..models.seedvr2.nadit.config import PRESETS

    if args.model not in PRESETS:
        parser.error(f"--model {args.model}: choose from {', '.join(sorted(PRESETS))}")
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        parser.error(f"--dtype {args.dtype}: choose from {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    # each check at the released widths takes a minute or more: say what runs, on stderr (stdout stays the report)
    print(f"ditsp doctor: probing {args.model}'s kernel shapes ({', '.join(dtypes)}, "
          f"{torch.get_num_threads()} thread(s)); a check at the released widths takes a minute or more",
          file=sys.stderr, flush=True)
    result = probe(args.model, dtypes, say=lambda text: print(f"ditsp doctor: {text}", file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else format_probe(result))
    return 0 if result["holds"] else 1
