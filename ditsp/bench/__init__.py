"""`ditsp bench ...`: side-by-side benchmarks on local ranks.

Each benchmark imports what it measures inside its functions: every parser is built when ``ditsp``
starts (see ``ditsp.commands``), and a benchmark's modules load only when it runs.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` command group to the top-level subparsers ``sub``."""
    from . import attention, crossover, determinism, forward, link, planners

    p = sub.add_parser("bench", help="benchmark SP paths side by side on local ranks")
    bsub = p.add_subparsers(dest="bench", required=True)
    attention.add_parser(bsub)
    forward.add_parser(bsub)
    planners.add_parser(bsub)
    determinism.add_parser(bsub)
    __import__("ditsp.bench.packed", fromlist=["add_parser"]).add_parser(bsub)
    crossover.add_parser(bsub)
    link.add_parser(bsub)
    from . import vae

    vae.add_parser(bsub)
    from . import elastic  # noqa: E402
    elastic.add_parser(bsub)
    __import__(f"{__name__}.sparse", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.transport", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.overlap", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.diffusers", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.weights", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.weights_sp", fromlist=["add_parser"]).add_parser(bsub)
    __import__(f"{__name__}.speed", fromlist=["add_parser"]).add_parser(bsub)
    return p
