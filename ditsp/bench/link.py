"""Calibrate the auto path choice's link model on the current group.

    ditsp bench link [--sp 2] [--out benchmarks/results/link.json]

Times, on ``--sp`` local ranks (or the torchrun group), a variable-split
all-to-all of a few bytes (latency: one collective round) and of 16 MiB per
rank (bandwidth: extra bytes over extra time), and one rank's fp32 matmul rate
(FLOP/s). Writes the JSON :class:`ditsp.sp.choice.Link` reads; point
``DITSP_LINK`` at it so ``--path auto`` uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ..argtypes import positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("link", help="measure collective latency, bandwidth and FLOP/s for --path auto")
    p.add_argument("--sp", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--out", default="benchmarks/results/link.json")
    p.set_defaults(func=main)
    return p


def rank_link(ctx, repeats: int, big_bytes: int = 16 << 20) -> dict:
    import torch

    from ..distributed.comm import Comm

    comm = Comm.of(ctx.group if ctx.world_size > 1 else None)
    p = comm.world_size

    def a2a(nbytes: int) -> float:
        rows = max(p, nbytes // 4 // p * p)
        x = torch.zeros(rows, dtype=torch.float32)
        splits = [rows // p] * p
        comm.all_to_all_single(x, splits, splits, kind="link")  # warm
        times = []
        for _ in range(repeats):
            comm.all_reduce(torch.zeros(1), kind="link_barrier")
            t0 = time.perf_counter()
            comm.all_to_all_single(x, splits, splits, kind="link")
            times.append(time.perf_counter() - t0)
        return statistics.median(times), rows * 4 * (p - 1) / p

    small, _ = a2a(64)
    big, sent = a2a(big_bytes)
    a = torch.randn(512, 512)
    a @ a
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ a
    flops = repeats * 2 * 512**3 / (time.perf_counter() - t0)
    return {"latency": small, "bandwidth": sent / max(big - small, 1e-9), "flops": flops}


def main(args, parser=None) -> int:
    from ..distributed.dispatch import dispatch

    res = dispatch(rank_link, args.repeats, sp=args.sp)
    link = {"latency": max(r["latency"] for r in res), "bandwidth": min(r["bandwidth"] for r in res),
            "flops": min(r["flops"] for r in res), "name": f"measured: {args.sp} local ranks (gloo)"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(link, f, indent=1)
    print(f"latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s, "
          f"{link['flops'] / 1e9:.1f} GFLOP/s per rank -> {args.out} (use: DITSP_LINK={args.out})")
    return 0
