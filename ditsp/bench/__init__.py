"""`ditsp bench ...`: side-by-side benchmarks on local ranks.

Each benchmark imports what it measures inside its functions: every parser is built when ``ditsp``
starts (see ``ditsp.commands``), and a benchmark's modules load only when it runs.
"""

from __future__ import annotations

import argparse


# One module per benchmark, in the order `ditsp bench -h` lists them.
BENCHMARKS = ("attention", "forward", "planners", "determinism", "packed", "crossover", "link", "vae", "elastic",
              "sparse", "transport", "overlap", "diffusers", "weights", "weights_sp", "speed", "winograd", "malloc", "job", "gather",
              "restorer", "capacities", "seams_colour", "rl_spot")


def declare(sub, name: str, help: str, description: str | None, arguments, main) -> argparse.ArgumentParser:
    """One benchmark's subcommand: ``arguments(p)`` adds its options, ``main(args, parser)`` runs it."""
    p = sub.add_parser(name, help=help, description=description)
    arguments(p)
    p.set_defaults(func=main)
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` command group to the top-level subparsers ``sub``."""
    import importlib

    p = sub.add_parser("bench", help="benchmark SP paths side by side on local ranks")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        importlib.import_module(f"{__name__}.{name}").add_parser(bsub)
    return p
