"""Automatic SP path choice for window models: a cost model over the four runtimes.

Candidates: window-aligned Plan A with the LPT planner (``window/lpt``) or the
locality planner (``window/locality``), halo-slab Plan B (``halo``) and the
Ulysses baseline (``ulysses``). All four give the same bits as one device
(tests/test_sp_invariance.py, tests/test_plan_b.py), so the choice only
changes time and memory, never the output.

The predicted time of one forward is, summed over layers,

    max over ranks of compute  +  sum over collectives of (max rank bytes / bandwidth + latency)

- compute: tokenwise FLOPs per row (Q/K/V and output projections, MLP) times
  the rank's rows, plus attention FLOPs ``4 * l * (l + L) * inner`` of every
  window the rank attends (Ulysses: every window, its share of the heads),
  divided by the rank's FLOP rate: the imbalance of a plan costs time here;
- bytes: the larger of what the busiest rank sends and receives in each
  collective (all-to-all count matrices, the fp64 text all-reduce, the
  output gather), over the link bandwidth;
- rounds: one latency per collective round.

Link parameters (:class:`Link`) come from defaults for a GPU node, from a
JSON file written by ``ditsp bench link`` (``DITSP_LINK`` names it), or are
passed in. The choice is made from plans only (pure), then every rank checks
with :func:`ditsp.distributed.agree.agree` that its peers chose the same.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np

from ..attention.common import even_splits
from ..windows.capacity import Shares
from ..windows.geometry import canonical_method
from ..windows.schedule import plan_schedule
from .halo_slab import plan_halo
from ..windows.geometry import window_layout

CANDIDATES = ("window/lpt", "window/locality", "halo", "ulysses")
ENV_LINK = "DITSP_LINK"


@dataclass(frozen=True)
class Link:
    """Per-rank link and compute rates the cost model divides by."""

    bandwidth: float = 100e9  # bytes/s a rank sends (and receives) in a collective
    latency: float = 30e-6  # seconds per collective round
    flops: float = 300e12  # FLOP/s of one rank's attention and matmuls
    name: str = "default GPU node (NVLink-class)"

    @classmethod
    def load(cls, path: str | None = None) -> "Link":
        """From ``path`` or ``$DITSP_LINK`` (JSON of the fields), else the defaults."""
        path = path or os.environ.get(ENV_LINK)
        if not path:
            return cls()
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: data[k] for k in ("bandwidth", "latency", "flops", "name") if k in data})

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PathCost:
    path: str  # one of CANDIDATES
    compute_s: float
    comm_s: float
    latency_s: float
    bytes: int  # bytes leaving ranks, summed over ranks, one forward
    rounds: int  # collective rounds per forward
    imbalance: float  # busiest rank's compute / mean

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.latency_s

    def describe(self) -> str:
        return (f"{self.path} {self.total_s * 1e3:.2f} ms (compute {self.compute_s * 1e3:.2f}, "
                f"bytes {self.comm_s * 1e3:.2f}, rounds {self.latency_s * 1e3:.2f})")


@dataclass(frozen=True)
class Choice:
    costs: tuple[PathCost, ...]  # cheapest first

    @property
    def best(self) -> PathCost:
        return self.costs[0]

    @property
    def runner_up(self) -> PathCost | None:
        return self.costs[1] if len(self.costs) > 1 else None

    def describe(self) -> str:
        ru = f"; runner-up {self.runner_up.describe()}" if self.runner_up else ""
        return f"auto chose {self.best.describe()}{ru}"


def split_path(path: str) -> tuple[str, str]:
    """``"window/locality"`` -> ("window", "locality"); others take the LPT planner name."""
    base, _, planner = path.partition("/")
    return base, planner or "lpt"


# -- model arithmetic ---------------------------------------------------------------------------------


def _token_flops(cfg) -> float:
    d, inner = cfg.vid_dim, cfg.heads * cfg.head_dim
    return 2.0 * (d * 3 * inner + inner * d + 3 * d * cfg.mlp_hidden)


def _attn_flops(lengths: np.ndarray, txt_len: int, inner: int) -> float:
    lengths = np.asarray(lengths, dtype=np.float64)
    return float((4.0 * lengths * (lengths + txt_len) * inner).sum())


def _a2a_time(counts: np.ndarray, row_bytes: float, link: Link) -> tuple[float, int]:
    off = counts - np.diag(np.diag(counts))
    worst = max(int(off.sum(1).max()), int(off.sum(0).max()))
    return worst * row_bytes / link.bandwidth, int(off.sum() * row_bytes)


def capable(candidates: Sequence[str], shares: Shares | None) -> tuple[str, ...]:
    """The candidates that can run ranks of unequal capacity: Plan A (its planners balance modelled time
    under the token caps) and Plan B (slabs in proportion to speed; not under token caps); the Ulysses
    baseline splits rows and heads evenly. Equal ranks: all of them."""
    if shares is None or shares.even:
        return tuple(candidates)
    return tuple(c for c in candidates if c != "ulysses" and not (c == "halo" and shares.max_tokens is not None))


def path_costs(cfg, grid: Sequence[int], world: int, link: Link | None = None, elem_bytes: int = 2,
               candidates: Sequence[str] = CANDIDATES, txt_len: int | None = None,
               shares: Shares | None = None) -> list[PathCost]:
    """Predicted cost of one forward of ``cfg`` on ``grid`` at SP ``world`` for each candidate (``shares``:
    ranks of unequal speed and memory; a rank's compute is divided by its speed)."""
    link = link or Link()
    shares = None if shares is None or shares.even else shares
    rate = (lambda loads: loads) if shares is None else (lambda loads: loads / np.asarray(shares.speed))
    L = cfg.txt_len if txt_len is None else txt_len
    inner, d, p = cfg.heads * cfg.head_dim, cfg.vid_dim, int(world)
    methods = tuple(canonical_method(m) for m in cfg.window_methods)
    layers, n = len(methods), int(np.prod(grid))
    tok = _token_flops(cfg)
    txt_rounds = layers - 1 if p > 1 else 0
    text_s = txt_rounds * (2 * (p - 1) / p * L * d * 8 / link.bandwidth) if p > 1 else 0.0
    text_b = txt_rounds * 2 * (p - 1) * L * d * 8 if p > 1 else 0
    gather_b = (p - 1) * n * cfg.out_patch_channels * elem_bytes
    gather_s = (p - 1) / p * n * cfg.out_patch_channels * elem_bytes / link.bandwidth * (p > 1)
    out = []
    for cand in candidates:
        base, planner = split_path(cand)
        compute = comm = 0.0
        nbytes, rounds, imb = gather_b + text_b, txt_rounds + (p > 1), []
        if base == "window":
            sch = plan_schedule(grid, methods, p, planner, cfg.num_windows, shares=shares)
            per_method = {}
            for m, plan in sch.plans.items():
                counts = plan.layout.token_counts
                loads = np.array([plan.rank_tokens[r] * tok + _attn_flops(counts[list(ws)], L, inner)
                                  for r, ws in enumerate(plan.rank_windows)])
                per_method[m] = rate(loads)
            for m in methods:
                compute += per_method[m].max() / link.flops
                imb.append(per_method[m].max() / per_method[m].mean())
            for _, t in sch.transitions():
                if t.exchange_required:
                    s, b = _a2a_time(t.counts, d * elem_bytes, link)
                    comm, nbytes, rounds = comm + s, nbytes + b, rounds + 1
        elif base == "halo":
            hp = plan_halo(grid, methods, p, cfg.num_windows, speeds=None if shares is None else shares.speed)
            slab_rows = hp.slabs.rank_rows
            for m in methods:
                lc = hp.layouts[m]
                counts = lc.layout.token_counts
                loads = rate(np.array([slab_rows[r] * tok + _attn_flops(counts[lc.window_rank == r], L, inner)
                                       for r in range(p)]))
                compute += loads.max() / link.flops
                imb.append(loads.max() / loads.mean())
                if lc.halo_rows:
                    for t, width in ((hp.fetch(m), 3 * inner), (hp.give_back(m), inner)):
                        s, b = _a2a_time(t.counts, width * elem_bytes, link)
                        comm, nbytes, rounds = comm + s, nbytes + b, rounds + 1
        elif base == "ulysses":
            rows = even_splits(n, p)
            heads = even_splits(cfg.heads, p)
            for m in methods:
                lay = window_layout(grid, m, cfg.num_windows)
                att = _attn_flops(lay.token_counts, L, inner)
                loads = np.array([rows[r] * tok + att * heads[r] / cfg.heads for r in range(p)])
                compute += loads.max() / link.flops
                imb.append(loads.max() / loads.mean())
                if p > 1:
                    for width in (3 * inner, inner):  # Q/K/V in, output back
                        worst = rows[0] * (p - 1) / p * width * elem_bytes
                        comm += worst / link.bandwidth
                        nbytes += int(n * (p - 1) / p * width * elem_bytes)
                        rounds += 1
        else:
            raise ValueError(f"unknown candidate {cand!r}; choose from {', '.join(CANDIDATES)}")
        out.append(PathCost(cand, compute, comm + text_s + gather_s, rounds * link.latency * (p > 1),
                            int(nbytes), int(rounds), float(np.mean(imb))))
    return out


def choose(cfg, grid: Sequence[int], world: int, link: Link | None = None, elem_bytes: int = 2,
           candidates: Sequence[str] = CANDIDATES, shares: Shares | None = None) -> Choice:
    """Candidates by predicted time, cheapest first (ties: the order of ``candidates``); ranks of unequal
    capacity (``shares``) choose among the paths that can run them (:func:`capable`).

    With one rank every path is the same single-device forward: Plan A LPT.
    """
    if int(world) == 1:
        candidates = ("window/lpt",)
    candidates = capable(candidates, shares)
    costs = path_costs(cfg, grid, world, link, elem_bytes, candidates, shares=shares)
    order = sorted(range(len(costs)), key=lambda i: (round(costs[i].total_s, 12), i))
    return Choice(tuple(costs[i] for i in order))


class ChosenRuntime:
    """The runtime the auto choice built, whose report names the choice and the runner-up."""

    def __init__(self, runtime, choice: Choice):
        self._rt, self.choice = runtime, choice

    def __getattr__(self, name):
        return getattr(self._rt, name)

    @property
    def runtime(self):
        return self._rt

    # the protocol, delegated explicitly (isinstance(…, SPRuntime) and attribute writes stay on the runtime)
    comm = property(lambda self: self._rt.comm)
    transport = property(lambda self: self._rt.transport)
    rank = property(lambda self: self._rt.rank)
    world_size = property(lambda self: self._rt.world_size)
    dtype = property(lambda self: self._rt.dtype)
    grid = property(lambda self: self._rt.grid)
    layer_methods = property(lambda self: self._rt.layer_methods)
    kernel_shapes = property(lambda self: self._rt.kernel_shapes,
                             lambda self, v: setattr(self._rt, "kernel_shapes", v))

    def scatter(self, x, layer=0):
        return self._rt.scatter(x, layer)

    def scatter_rows(self, x_rows, src, patch):
        return self._rt.scatter_rows(x_rows, src, patch)

    def gather_rows(self, y_local, dst, patch):
        return self._rt.gather_rows(y_local, dst, patch)

    def enter_layer(self, x, layer):
        return self._rt.enter_layer(x, layer)

    def local_window_shapes(self, layer):
        return self._rt.local_window_shapes(layer)

    def window_pack(self, layer, device):
        return self._rt.window_pack(layer, device)

    def attend(self, q, k, v, tq, tk, tv, pack, rope=None):
        return self._rt.attend(q, k, v, tq, tk, tv, pack, rope)

    def reduce_text(self, txt_sum, layer):
        return self._rt.reduce_text(txt_sum, layer)

    def gather(self, y_local):
        return self._rt.gather(y_local)

    def report(self, heads: int | None = None) -> str:
        return f"{self._rt.report(heads)} [{self.choice.describe()}]"


def with_link(link: Link, **changes) -> Link:
    return replace(link, **changes)


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}" if math.isfinite(x) else "inf"
