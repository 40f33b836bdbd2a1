"""LPT vs locality-aware window planning: a markdown table, plus exact optima on small grids.

    ditsp bench planners [--ilp-seconds 40]   (0: skip the ILPs, a few seconds)

For 720p / 1080p / 2K / 4K at 81 frames (post-patch T = 21) and SP 2, 4, 8 it
prints, per planner: the fraction of all video tokens moved per regular <->
shifted transition, the largest per-rank send+receive of one transition (as a
multiple of one rank's mean share N/P), the imbalance (max/mean tokens, worst
layout) and the cold planning time (plan and geometry caches cleared).

Lower bounds come from an exact integer program (scipy.optimize.milp / HiGHS):
binary x[v, r] puts window v on rank r, y[e] >= |x[u, r] - x[v, r]| marks a cut
overlap edge, the objective is the tokens moved (the weighted cut), and every
layout keeps the planner's per-rank token cap. Where HiGHS proves optimality
within the time limit the optimum is shown, otherwise its dual bound. The
largest per-rank send+receive is at least 2 x moved / P, so a bound on the
moved tokens bounds the peak too. A second table solves tiny grids exactly for
both objectives (moved tokens, and the per-rank peak) and compares.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..argtypes import nonneg_float, nonneg_int
from ..windows.geometry import _layout, window_layout
from ..windows.plan import PLAN_CACHE, TRANSITION_CACHE
from ..windows.planners import locality
from ..windows.schedule import plan_schedule

RESOLUTIONS = {"720p": (21, 45, 80), "1080p": (21, 67, 120), "2K": (21, 90, 160), "4K": (21, 135, 240)}
TINY = [((5, 20, 36), 2), ((5, 20, 36), 3), ((5, 20, 36), 4), ((9, 30, 54), 2), ((9, 30, 54), 3)]
SCHEDULE = ["regular", "shifted"] * 16  # the released 3B: 32 alternating layers


def measure(grid, p: int, planner: str) -> dict:
    PLAN_CACHE.clear()
    TRANSITION_CACHE.clear()
    _layout.cache_clear()
    t0 = time.perf_counter()
    sched = plan_schedule(grid, SCHEDULE, p, planner)
    dt = time.perf_counter() - t0
    t = sched.transition_between("regular", "shifted")
    n = sched.num_tokens
    return {
        "moved": t.tokens_moved,
        "frac": t.fraction_moved,
        "peak": int((t.rank_send + t.rank_recv).max()),
        "peak_share": int((t.rank_send + t.rank_recv).max()) / (n / p),
        "imb": max(pl.imbalance for pl in sched.plans.values()),
        "ms": dt * 1000,
        "n": n,
    }


def exact(grid, p: int, objective: str = "moved", time_limit: float = 20.0):
    """Solve the joint plan exactly with HiGHS: (optimal?, best value found, proven lower bound).

    ``objective`` "moved" minimises tokens moved per transition; "peak" minimises the largest
    per-rank send+receive. Both under the locality planner's per-layout caps. None without scipy.
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    lays = [window_layout(grid, "regular"), window_layout(grid, "shifted")]
    g = locality.Graph(lays)
    caps = locality.layout_caps(lays, p)
    n = g.n
    edges = [(v, u, c) for v in range(n) for u, c in g.nbrs[v] if u > v]
    ne, nx = len(edges), n * p
    peak = objective == "peak"
    # variables: x[v, r] | y[e] (moved) or d[e, r] (peak) | z (peak only)
    nd = ne * p if peak else ne
    nvar = nx + nd + (1 if peak else 0)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(cs, vs, lower, upper):
        r = len(lo)
        rows.extend([r] * len(cs))
        cols.extend(cs)
        vals.extend(vs)
        lo.append(lower)
        hi.append(upper)

    for v in range(n):
        add([v * p + r for r in range(p)], [1] * p, 1, 1)
    for lay, cap in enumerate(caps):
        vs = [v for v in range(n) if g.layer[v] == lay]
        for r in range(p):
            add([v * p + r for v in vs], [int(g.weight[v]) for v in vs], 0, cap)
    for k, (u, v, _w) in enumerate(edges):
        for r in range(p):
            d = nx + (k * p + r if peak else k)
            add([d, u * p + r, v * p + r], [1, -1, 1], 0, np.inf)
            add([d, u * p + r, v * p + r], [1, 1, -1], 0, np.inf)
    c = np.zeros(nvar)
    if peak:
        z = nvar - 1
        c[z] = 1
        for r in range(p):  # z >= sum_e w_e d[e, r]  (= send + recv of rank r)
            add([z] + [nx + k * p + r for k in range(ne)], [1] + [-float(e[2]) for e in edges], 0, np.inf)
    else:
        c[nx:] = [e[2] for e in edges]
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    lb, ub = np.zeros(nvar), np.ones(nvar)
    if peak:
        ub[nx:] = np.inf
    lb[0] = 1  # symmetry: window 0 of the first layout on rank 0
    integ = np.zeros(nvar)
    integ[:nx] = 1
    res = milp(
        c, constraints=LinearConstraint(a, lo, hi), integrality=integ, bounds=Bounds(lb, ub),
        options={"time_limit": time_limit, "disp": False},
    )
    value = None if res.x is None else float(res.fun)
    bound = getattr(res, "mip_dual_bound", None)
    if res.status == 0:
        bound = value
    return res.status == 0, value, (None if bound is None or not np.isfinite(bound) else float(bound))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("planners", help="LPT vs locality planning: tokens moved, peaks, balance, exact optima")
    p.add_argument("--ilp-seconds", type=nonneg_float, default=40.0, help="HiGHS time limit per instance (0: skip)")
    p.add_argument("--ilp-max-binaries", type=nonneg_int, default=400, help="skip the ILP above this many x[v, r]")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser=None) -> int:

    print("### Tokens moved per regular<->shifted transition, 3B geometry, 81 frames\n")
    print(
        "| res | grid | SP | LPT moved | locality moved | lower bound | LPT peak | locality peak "
        "| LPT imb | loc imb | LPT ms | loc ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res, grid in RESOLUTIONS.items():
        for p in (2, 4, 8):
            a, b = measure(grid, p, "lpt"), measure(grid, p, "locality")
            lbtxt = "—"
            nbin = (len(window_layout(grid, "regular")) + len(window_layout(grid, "shifted"))) * p
            if args.ilp_seconds > 0 and nbin <= args.ilp_max_binaries:
                ex = exact(grid, p, "moved", args.ilp_seconds)
                if ex is not None and ex[2] is not None:
                    opt, _val, bound = ex
                    lbtxt = ("= " if opt else ">= ") + _pct(bound / a["n"])
            print(
                f"| {res} | {','.join(map(str, grid))} | {p} | {_pct(a['frac'])} | **{_pct(b['frac'])}** | {lbtxt} "
                f"| {a['peak_share']:.2f} | {b['peak_share']:.2f} | {a['imb']:.4f} | {b['imb']:.4f} "
                f"| {a['ms']:.0f} | {b['ms']:.0f} |"
            )
    print(
        "\npeak = largest per-rank send+recv of one transition, in units of one rank's mean share N/P "
        "(a rank that receives its whole share counts 1.0). imb = max/mean tokens, worst layout. "
        "ms = cold plan_schedule time (caches cleared). lower bound: exact ILP optimum (=) or proven "
        "HiGHS bound (>=) for the moved tokens under the same caps; — where the ILP is too large."
    )

    if args.ilp_seconds > 0:
        print("\n### Exact optima on small grids (ILP, same caps)\n")
        print("| grid | SP | windows | locality moved | optimal moved | locality peak | optimal peak |")
        print("|---|---|---|---|---|---|---|")
        for grid, p in TINY:
            b = measure(grid, p, "locality")
            mv = exact(grid, p, "moved", args.ilp_seconds)
            pk = exact(grid, p, "peak", args.ilp_seconds)
            if mv is None:
                print("(scipy not installed: no ILP)")
                break

            def fmt(ex, scale):
                opt, val, bound = ex
                if opt:
                    return f"{val:.0f} ({_pct(val / scale)})" if scale == b["n"] else f"{val:.0f}"
                return f">= {bound:.0f}" if bound is not None else "?"

            nw = f"{len(window_layout(grid, 'regular'))}+{len(window_layout(grid, 'shifted'))}"
            print(
                f"| {','.join(map(str, grid))} | {p} | {nw} | {b['moved']} ({_pct(b['frac'])}) | {fmt(mv, b['n'])} "
                f"| {b['peak']} | {fmt(pk, 1)} |"
            )
    return 0
