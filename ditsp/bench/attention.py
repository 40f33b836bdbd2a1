"""`ditsp bench attention`: Ulysses, Ring, USP and AllGather-KV side by side in one process group.

Every strategy runs on the same spawned ranks and the same local shards;
iterations interleave the strategies (round robin) so machine drift hits all
alike. A call's time is the slowest rank's (ranks start together after a
barrier); the table shows the median over the timed iterations. Bytes and
calls are one call's counted collectives on the busiest rank (lengths passed
in, so no length gather). Peak MiB is the most memory one call added on any
rank (:class:`ditsp.memory.PeakMemory`: CUDA peak, else the RSS high-water
mark; ``main`` sets ``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave RSS).

Baselines run in the same rounds (``--baselines``):

- ``a2a-sdpa``: the minimal Ulysses a peer library implements: Q, K and V
  each sent by its own equal-split all-to-all to head shards, one plain
  ``F.scaled_dot_product_attention`` (enable_gqa), one all-to-all back; no
  joint text, no uneven shards (skipped when the shape needs them).
- ``sdpa-1dev``: the whole sequence on rank 0 alone, one SDPA call (the
  other ranks idle): the single-device reference point.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import os

import torch.nn.functional as F

from ..attention.common import even_splits
from ..attention.usp import AllGatherKV, Ring, SPAttention, Ulysses
from ..config import ParallelConfig
from ..dist.groups import build_sp_groups
from ..dist.comm import Comm
from ..commands.common import choice_list, nonneg_int, positive_int
from ..engine import DTYPES
from ..memory import PeakMemory



def strategies_for(sp: int) -> list[tuple[str, int, int]]:
    """(name, ulysses degree, ring degree) for every strategy that fits ``sp`` ranks."""
    out = [("ulysses", sp, 1), ("ring", 1, sp), ("allgather", 1, sp)]
    square = [d for d in range(2, sp) if sp % d == 0 and d * d <= sp]  # the most balanced 2D mesh
    if square:
        u = square[-1]
        out += [("usp-ring", u, sp // u), ("usp-allgather", u, sp // u)]
    return out


BASELINES = ("a2a-sdpa", "sdpa-1dev")


class _A2A(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (its own inverse, so the backward is the same exchange)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        n = comm.world_size
        return comm.all_to_all_single(x.contiguous(), [x.shape[0] // n] * n, [x.shape[0] // n] * n, kind="a2a_sdpa")

    @staticmethod
    def backward(ctx, g):
        n = ctx.comm.world_size
        return ctx.comm.all_to_all_single(g.contiguous(), [g.shape[0] // n] * n, [g.shape[0] // n] * n,
                                          kind="a2a_sdpa_bwd"), None


class A2ASDPA:
    """Baseline: all-to-all Q, K, V separately to head shards, one SDPA, all-to-all back (even shapes only)."""

    def __init__(self, group):
        self.comm = Comm(group)
        self.stats = self.comm.stats

    def _to_heads(self, x):  # [B, s, H, D] -> [B, H/P, P*s, D]
        n, (b, s, h, d) = self.comm.world_size, x.shape
        y = _A2A.apply(x.reshape(b, s, n, h // n, d).permute(2, 0, 3, 1, 4), self.comm)  # [P, B, H/P, s, D]
        return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def __call__(self, q, k, v, text_len=0, seq_lens=None):
        n, (b, s, h, d) = self.comm.world_size, q.shape
        o = F.scaled_dot_product_attention(*(self._to_heads(x) for x in (q, k, v)), enable_gqa=True)
        o = o.reshape(b, h // n, n, s, d).permute(2, 0, 3, 1, 4)  # [P, B, s, H/P, D]
        return _A2A.apply(o, self.comm).permute(1, 2, 0, 3, 4).reshape(b, s, h, d)


class SDPAOneDevice:
    """Baseline: rank 0 attends the whole sequence alone (inputs built once, outside the timing)."""

    def __init__(self, ctx, cfg, dt):
        self.stats, self.rank = Comm.single().stats, ctx.rank
        if ctx.rank == 0:
            S, B, H, Hk, D = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
            g = cfg["backward"]
            self.qkv = [torch.randn(B, h, S + cfg["text"], D, dtype=dt, requires_grad=g) for h in (H, Hk, Hk)]

    def __call__(self, *args, **kw):
        if self.rank:
            return None
        return F.scaled_dot_product_attention(*self.qkv, enable_gqa=True)


def baseline_fits(name: str, cfg: dict) -> str | None:
    """Why a baseline cannot run this configuration (None when it can)."""
    if name == "a2a-sdpa":
        n = cfg["sp"]
        if cfg["text"] or cfg["seq"] % n or cfg["heads"] % n or cfg["kv_heads"] % n:
            return "a2a-sdpa needs no text and sequence, heads and K/V heads divisible by --sp"
    return None


def _build(ctx, name, u, r, cfg=None, dt=None):
    if name == "a2a-sdpa":
        return A2ASDPA(ctx.group)
    if name == "sdpa-1dev":
        return SDPAOneDevice(ctx, cfg, dt)
    if name == "ulysses":
        return Ulysses(ctx.group)
    if name == "ring":
        return Ring(ctx.group)
    if name == "allgather":
        return AllGatherKV(ctx.group)
    cfg = ParallelConfig(ulysses_degree=u, ring_degree=r, use_allgather=name.endswith("allgather"), advanced_uaa=True)
    return SPAttention.from_config(cfg, build_sp_groups(cfg, ctx.group))


def rank_bench(ctx, cfg: dict) -> dict:
    torch.manual_seed(ctx.rank)
    lens = even_splits(cfg["seq"], ctx.world_size)
    n, T, dt = lens[ctx.rank] + cfg["text"], cfg["text"], DTYPES[cfg["dtype"]]
    shape = (cfg["batch"], n, cfg["heads"], cfg["head_dim"])
    kv_shape = shape[:2] + (cfg["kv_heads"], cfg["head_dim"])
    q, k, v = (torch.randn(s, dtype=dt, requires_grad=cfg["backward"]) for s in (shape, kv_shape, kv_shape))
    sync = Comm(ctx.group)  # barrier only; not reported
    names = [tuple(s) for s in cfg["strategies"]]
    attns = {s[0]: _build(ctx, *s, cfg=cfg, dt=dt) for s in names}
    times = {s[0]: [] for s in names}
    peaks = {s[0]: 0 for s in names}
    stats, backends = {}, {}
    mem = PeakMemory(q.device)

    def call(a):
        out = a(q, k, v, text_len=T, seq_lens=lens)
        if out is not None and cfg["backward"]:
            ins = getattr(a, "qkv", None) or (q, k, v)
            torch.autograd.grad(out, ins, torch.ones_like(out))
        del out

    for it in range(cfg["warmup"] + cfg["iters"]):
        for name, a in attns.items():
            sync.all_reduce(torch.zeros(1))
            a.stats.reset()
            mem.start()
            t0 = time.perf_counter()
            call(a)
            dt_s = time.perf_counter() - t0
            if it >= cfg["warmup"]:
                times[name].append(dt_s)
                peaks[name] = max(peaks[name], mem.peak_added())
            stats[name] = (a.stats.bytes_sent, a.stats.bytes_recv, a.stats.calls)
            backends[name] = getattr(a, "backend", None) or "sdpa"
    return {"times": times, "stats": stats, "peaks": peaks, "backends": backends}


def run_bench(cfg: dict, timeout_s: float = 1800.0, cluster=None) -> list[dict]:
    """Rows of the table; ``cluster``: an existing LocalCluster of ``cfg['sp']`` ranks (else one is spawned)."""
    from ..dist.launcher import LocalCluster

    if cluster is not None:
        res = cluster.run(rank_bench, cfg, timeout_s=timeout_s)
    else:
        with LocalCluster(cfg["sp"], timeout_s=timeout_s, threads=cfg["threads"]) as c:
            res = c.run(rank_bench, cfg)
    rows = []
    for name, u, r in cfg["strategies"]:
        per_iter = [max(rk["times"][name][i] for rk in res) for i in range(cfg["iters"])]
        sent, recv, calls = (max(rk["stats"][name][j] for rk in res) for j in range(3))
        rows.append({"strategy": name, "mesh": f"{u}x{r}", "ms": 1e3 * statistics.median(per_iter),
                     "sent_mib": sent / 2**20, "recv_mib": recv / 2**20, "calls": calls,
                     "peak_mib": max(rk["peaks"][name] for rk in res) / 2**20, "backend": res[0]["backends"][name]})
    base = next((row["ms"] for row in rows if row["strategy"] == "ulysses"), rows[0]["ms"])
    for row in rows:
        row["ratio"] = row["ms"] / base
    return rows


def format_table(rows: list[dict], cfg: dict) -> str:
    what = "forward+backward" if cfg["backward"] else "forward"
    head = (f"attention {what}: sp={cfg['sp']} seq={cfg['seq']} text={cfg['text']} batch={cfg['batch']} "
            f"heads={cfg['heads']} kv_heads={cfg['kv_heads']} head_dim={cfg['head_dim']} {cfg['dtype']}, "
            f"median of {cfg['iters']} after {cfg['warmup']} warm-up, {cfg['threads']} thread(s)/rank")
    lines = [head, "", "| strategy | UxR | kernel | ms/call | vs ulysses | peak MiB/rank | MiB sent | MiB recv | calls |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['mesh']} | {r['backend']} | {r['ms']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['peak_mib']:.0f} | {r['sent_mib']:.2f} | {r['recv_mib']:.2f} | {r['calls']} |")
    lines.append("")
    lines.append("bytes and calls: one call, per rank (the busiest rank); peak: the most one call added on any rank")
    return "\n".join(lines)


STRATEGY_NAMES = ("ulysses", "ring", "allgather", "usp-ring", "usp-allgather")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    def fail(msg: str):
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    if args.sp < 1 or args.seq < 1 or args.heads < 1:
        fail("--sp, --seq and --heads must be >= 1")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        fail(f"--kv-heads {kv} must divide --heads {args.heads}")
    strategies = strategies_for(args.sp)
    if args.strategies:
        wanted = args.strategies if isinstance(args.strategies, list) else args.strategies.split(",")
        unknown = [w for w in wanted if w not in STRATEGY_NAMES]
        if unknown:
            fail(f"--strategies: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(STRATEGY_NAMES)}")
        fits = [s[0] for s in strategies]
        misfit = [w for w in wanted if w not in fits]
        if misfit:
            fail(f"--strategies: {', '.join(misfit)} need(s) a 2D mesh that --sp {args.sp} does not have; "
                 f"at --sp {args.sp}: {', '.join(fits)}")
        strategies = [s for s in strategies if s[0] in wanted]
    baselines = getattr(args, "baselines", None) or []
    baselines = baselines.split(",") if isinstance(baselines, str) else baselines
    for b in baselines:
        if b not in BASELINES + ("none",):
            fail(f"--baselines: unknown {b!r}; choose from {', '.join(BASELINES)}, none")
        if b != "none":
            strategies.append((b, args.sp if b == "a2a-sdpa" else 1, 1))
    cfg = {"sp": args.sp, "seq": args.seq, "heads": args.heads, "kv_heads": kv, "head_dim": args.head_dim,
           "batch": args.batch, "text": args.text, "dtype": args.dtype, "backward": args.backward,
           "warmup": args.warmup, "iters": args.iters, "threads": args.threads, "strategies": strategies}
    for name, _, _ in list(strategies):
        why = baseline_fits(name, cfg) if name in BASELINES else None
        if why:
            print(f"skipped {name}: {why}")
            strategies.remove(next(s for s in strategies if s[0] == name))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # freed tensors leave RSS: honest peaks
    print(format_table(run_bench(cfg), cfg))
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("attention", help="global-attention SP strategies side by side (time, bytes, calls)")
    p.add_argument("--sp", type=positive_int, required=True, help="ranks (local gloo processes)")
    p.add_argument("--seq", type=positive_int, required=True, help="video tokens (whole sequence)")
    p.add_argument("--heads", type=positive_int, required=True)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--kv-heads", type=positive_int, help="K/V heads (GQA); default: --heads")
    p.add_argument("--text", type=nonneg_int, default=0, help="replicated joint text tokens")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per rank")
    p.add_argument("--strategies", type=choice_list(STRATEGY_NAMES),
                   help="comma-separated subset (ulysses,ring,allgather,usp-ring,usp-allgather)")
    p.add_argument("--baselines", type=choice_list(BASELINES + ("none",)), default=list(BASELINES),
                   help="comma-separated reference points run alongside (a2a-sdpa,sdpa-1dev), or none")
    p.set_defaults(func=main)
    return p
