"""Tuning constants of the locality planner (``VERSION`` goes into every plan cache key)."""

VERSION = 1
MAX_IMBALANCE = 1.03
CAP_MARGIN = 1e-9  # keep max/mean strictly inside the cap despite float rounding
SPLIT_SLACK = 0.01  # bisection may miss its token share by this fraction of a rank's share, per rank
FM_PASSES = 8
FM_STALL = 60  # FM stops after this many moves without a new best
RELAX = (0.06, 0.03)  # FM first runs with caps this much (of a rank's share) above the real cap
SECTOR_OFFSETS = 8  # angular starts
ILS_WORK = 12000  # perturbation rounds x vertices on the best start (more rounds for small graphs)
