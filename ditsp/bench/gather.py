"""All-gathers between local CPU ranks: gloo's sockets against the shared segment, side by side.

Two Comms on the same group in each rank, one held to gloo and one through shared memory
(:mod:`ditsp.distributed.shm_gather`), timed interleaved in one run: the median time of an all-gather
of each payload size, and a height-sharded VAE window (the small restorer's widths, the default 17
frames at 256x256) encoded and decoded with each, best of the rounds, with a check that both give the
same bits. Results: ``benchmarks/results/gather.md`` and ``gather.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..argtypes import positive_int
from ..models.seedvr2.presets import TRAINED
from . import declare

SIZES = (1 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--sp", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=50, help="all-gathers per payload size and route")
    p.add_argument("--rounds", type=positive_int, default=3, help="VAE windows per route, interleaved")
    p.add_argument("--clip", default="17,256,256", help="the VAE window's frames,height,width")
    p.add_argument("--weights", default=str(TRAINED / "tiny"),
                   help="folder with dit.safetensors and vae.safetensors (default: the small restorer's, shipped)")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "gather", "all-gathers between local CPU ranks: gloo vs shared memory", __doc__, _arguments,
                   main)


def rank_gather(ctx, sizes, repeats: int, rounds: int, clip, weights: str) -> dict:
    import torch

    from ..distributed import shm_gather
    from ..distributed.comm import Comm
    from ..fixed_shape import FAST, use
    from ..models.seedvr2.vae.sharded import ParallelVAE
    from ..models.seedvr2.weights import WeightsSpec, load

    torch.set_num_threads(1)
    gloo, shm = Comm(ctx.group), Comm(ctx.group)
    gloo._shm = False  # held to gloo
    shm._shm = shm_gather.open_for(ctx.group)
    routes = {"gloo": gloo, "shm": shm} if shm._shm else {"gloo": gloo}
    latency = {name: {} for name in routes}
    for size in sizes:
        t = torch.full((size // 4,), float(ctx.rank))
        for name, comm in routes.items():
            comm._all_gather(t)  # warm (and a slot grown to the size)
        for name in routes:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                routes[name]._all_gather(t)
                times.append(time.perf_counter() - t0)
            latency[name][size] = statistics.median(times)
    frames, height, width = clip
    folder = Path(weights)
    vae = load(WeightsSpec(dit=str(folder / "dit.safetensors"), vae=str(folder / "vae.safetensors")), "cpu").vae
    x = torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vaes = {name: ParallelVAE(vae, comm) for name, comm in routes.items()}
    window = {name: {"encode": [], "decode": []} for name in routes}
    outs = {}
    with use(FAST), torch.no_grad():
        for name, pv in vaes.items():  # warm: filters, layouts
            pv.decode(pv.encode(x, "height").posterior.mean, "height")
        for r in range(rounds):
            for name in (list(vaes) if r % 2 == 0 else list(vaes)[::-1]):
                pv = vaes[name]
                t0 = time.perf_counter()
                z = pv.encode(x, "height").posterior.mean
                t1 = time.perf_counter()
                y = pv.decode(z, "height")
                window[name]["encode"].append(t1 - t0)
                window[name]["decode"].append(time.perf_counter() - t1)
                outs.setdefault(name, (z, y))
    same = all(torch.equal(a, b) for a, b in zip(outs["gloo"], outs.get("shm", outs["gloo"])))
    return {"latency": latency, "window": {n: {k: min(v) for k, v in w.items()} for n, w in window.items()},
            "same_bits": same, "shm": "shm" in routes}


def main(args=None, parser=None) -> int:
    from ..distributed.launcher import LocalCluster
    from .speed import _cpu_capability

    if args is None:
        args = _arguments(argparse.ArgumentParser()).parse_args()
    clip = tuple(int(v) for v in args.clip.split(","))
    if len(clip) != 3:
        (parser or argparse.ArgumentParser()).error(f"--clip {args.clip}: expected frames,height,width")
    for name in ("dit.safetensors", "vae.safetensors"):
        if not (Path(args.weights) / name).is_file():
            (parser or argparse.ArgumentParser()).error(f"--weights {args.weights}: no {name} there")
    if args.sp < 2:
        (parser or argparse.ArgumentParser()).error("--sp must be at least 2 (an all-gather needs two ranks)")
    with LocalCluster(args.sp, timeout_s=1800, threads=1) as cluster:
        ranks = cluster.run(rank_gather, SIZES, args.repeats, args.rounds, clip, args.weights)
    r0 = ranks[0]
    if not r0["shm"]:
        print("shared memory is not used on this machine (another architecture, or DITSP_SHM_COLLECTIVES=0): "
              "only gloo is measured")
    head = [f"SP={args.sp} local CPU ranks, one thread each; CPU capability usage: {_cpu_capability()}; all-gather "
            f"time: median of {args.repeats}, slowest rank; VAE window {clip[0]}x{clip[1]}x{clip[2]} (height slabs, "
            f"{args.weights}), best of {args.rounds} interleaved rounds, slowest rank; same bits either way: "
            f"{all(r['same_bits'] for r in ranks)}", ""]
    routes = list(r0["latency"])

    def table(first: str, rows, ratio_digits: int) -> list[str]:
        """One table: a row per (label, value of each route from a rank's results, format), the slowest rank's
        value per cell, and shm / gloo beside them when both ran."""
        both = len(routes) > 1
        out = [f"| {first} | " + " | ".join(routes) + (" | shm / gloo |" if both else " |"),
               "| --- |" + " ---: |" * (len(routes) + both)]
        for label, get, fmt in rows:
            vals = [max(get(r, n) for r in ranks) for n in routes]
            out.append(f"| {label} | " + " | ".join(fmt(v) for v in vals) + " |"
                       + (f" {vals[1] / vals[0]:.{ratio_digits}f} |" if both else ""))
        return out

    lines = table("all-gather of", [(f"{size >> 10} KiB per rank", lambda r, n, s=size: r["latency"][n][s],
                                      lambda v: f"{v * 1e3:.3f} ms") for size in SIZES], 3)
    lines += ["", *table("VAE window", [(f"{op} s", lambda r, n, o=op: r["window"][n][o], lambda v: f"{v:.3f}")
                                        for op in ("encode", "decode")], 2)]
    print("\n".join(head + lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gather.md").write_text("\n".join(["# All-gathers between local CPU ranks (`ditsp bench gather`)", "",
                                              *head, *lines]) + "\n")
    (out / "gather.json").write_text(json.dumps({"args": vars(args) | {"func": None}, "ranks": ranks}, indent=1,
                                                default=str) + "\n")
    print(f"wrote {out / 'gather.md'} and gather.json")
    return 0
