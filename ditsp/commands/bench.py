"""`ditsp bench ...`: side-by-side benchmarks (the code lives in :mod:`ditsp.bench`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from ..bench import add_parser as add_bench_parser

    return add_bench_parser(sub)
