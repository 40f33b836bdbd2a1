"""The exploration and spot-worker settings of a run (``ditsp rl --explore ...``): their flags and checks.

Light (no model code): the command's parser is built whenever ``ditsp`` starts.

- ``none``: each prompt's rollouts use the run's default seeds;
- ``fresh``: before each step the trainer itself scores candidate seeds with the step's own weights and keeps
  the highest-contrast ones (exploration on the critical path, on reserved devices);
- ``stale``: spot workers score the next step's candidates with the weights of the step being trained, while
  it trains, and sample the rollouts too; the trainer only updates (:mod:`ditsp.rl.spot_run`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .bandit import RULES as PLANNERS
from .cost import SPOT_FRACTION

EXPLORE = ("none", "fresh", "stale")


@dataclass
class SpotConfig:
    explore: str = "none"
    candidates: int = 0  # candidate seeds per prompt on average; 0: fresh 2 x group, stale the time model
    planner: str = "bandit"
    workers: int = 2  # a steady spot fleet, when there is no trace
    trace: str | None = None  # join/leave times of the spot workers (ditsp.rl.trace)
    spot_sp: int = 1  # spot workers per SP group
    audit: bool = False  # also score each step's candidates with the fresh weights (the premise, measured)
    spot_fraction: float = SPOT_FRACTION
    timeout_s: float = 600.0  # spot work that commits nothing for this long stops the run

    def check(self, group_size: int, sp: int) -> None:
        """One-line ValueError for settings that cannot run."""
        if self.explore not in EXPLORE:
            raise ValueError(f"--explore must be one of {', '.join(EXPLORE)}, got {self.explore!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"--planner must be one of {', '.join(PLANNERS)}, got {self.planner!r}")
        if self.candidates and self.candidates < group_size:
            raise ValueError(f"--candidates {self.candidates} is below --group-size {group_size}: a prompt's "
                             f"rollouts are chosen among its candidates")
        if self.candidates < 0 or self.workers < 1 or self.spot_sp < 1:
            raise ValueError("--candidates must be >= 0, --spot-workers and --spot-sp >= 1")
        if not (0 < self.spot_fraction <= 1 and math.isfinite(self.spot_fraction)):
            raise ValueError(f"--spot-fraction must be in (0, 1], got {self.spot_fraction!r}")
        if self.explore != "stale" and (self.trace or self.audit):
            raise ValueError("--trace and --audit-premise need --explore stale (spot workers)")
        if self.trace:
            from .trace import load

            load(self.trace)  # a bad trace file is refused before anything starts (TraceError is a ValueError)
        if self.explore == "stale" and sp != 1:
            raise ValueError(f"--explore stale trains at --sp 1 (the spot workers are the trainer's children; "
                             f"their groups take --spot-sp), got --sp {sp}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`SpotConfig` (their defaults are its fields')."""
    d = SpotConfig()
    g = p.add_argument_group("seed exploration and spot workers (docs/rl.md)")
    g.add_argument("--explore", choices=EXPLORE, default=d.explore,
                   help="none: the default seeds; fresh: the trainer scores candidate seeds with the current weights "
                        "before each step; stale: spot workers score the next step's candidates with the previous "
                        "weights while the trainer updates, and sample the rollouts")
    g.add_argument("--candidates", type=int, default=d.candidates, metavar="M",
                   help="candidate seeds per prompt on average (the budget the planner splits); 0: fresh 2x "
                        "--group-size, stale what fits in the training step's time")
    g.add_argument("--planner", choices=PLANNERS, default=d.planner,
                   help="bandit: more candidates to prompts whose rewards spread more across seeds (UCB); uniform")
    g.add_argument("--spot-workers", type=int, default=d.workers, dest="spot_workers", metavar="N",
                   help="spot workers present the whole run (without --trace)")
    g.add_argument("--trace", metavar="FILE",
                   help="spot workers' join/leave times: lines 'time_s join|leave name [grace_s]' (docs/rl.md)")
    g.add_argument("--spot-sp", type=int, default=d.spot_sp, metavar="G", help="spot workers per SP group")
    g.add_argument("--audit-premise", action="store_true", dest="audit_premise",
                   help="also score every step's candidates with the fresh weights: the rank correlation of seed "
                        "rewards between stale and fresh weights, reported")
    g.add_argument("--spot-fraction", type=float, default=d.spot_fraction, metavar="F",
                   help="spot price as a fraction of on-demand, for the run's modelled cost (assumed 0.3)")


def from_args(args) -> SpotConfig:
    return SpotConfig(explore=args.explore, candidates=args.candidates, planner=args.planner,
                      workers=args.spot_workers, trace=args.trace, spot_sp=args.spot_sp, audit=args.audit_premise,
                      spot_fraction=args.spot_fraction)
