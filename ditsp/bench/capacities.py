"""Ranks of unequal capacity: an equal split against the capacity-aware one, measured on CPU and modelled on GPUs.

    ditsp bench capacities [--repeats 3] [--grid 5,30,54] [--no-measure]

**Measured** (CPU, two local ranks): the ranks are made unequal for real: each is pinned to a core of
its own and rank 1 shares its core with a spinning process it starts (and ends), so it gets about
half the core. A short probe (a fixed run of matmuls on each rank at once) measures
each rank's speed; then a DiT forward (the ``small`` preset, seeded random weights, Plan A LPT, fast
kernel calls) runs with the tokens split evenly and split by the probed speeds, interleaved, the
median of ``--repeats``. Per rank: the tokens it held, its modelled time (tokens / speed), the main
thread's CPU seconds, and its busy time (CPU seconds / probed speed: a rank's compute gets the share of
its core the probe measured, and a waiting rank uses none); per split the forward's wall time and the
busy times' imbalance (max / mean). Without two cores of its own to pin to, the run says so and the
ranks are not made unequal.

**Modelled** (no device): the released 3B in bf16 at 1080p and 4K (81 frames, one window), for a
32 + 24 GiB pair and an 80 + 80 + 24 + 24 GiB group, with speeds from memory (ditsp's default) and from
the GPU table's dense bf16 rates (``ditsp/models/gpus.py``: RTX 5090 + RTX 3090; A100 80 GB x 2 +
RTX 4090 x 2). The equal split gives every rank the same tokens, slabs and VAE mode (auto against the
smallest rank's memory); the capacity split is the restoration's plan (``job/budget.rank_estimates``,
the planner under its token caps). Per rank: DiT tokens (LPT's plan, the most over layouts), VAE slab
rows (all rows where the VAE's mode runs whole frames on every rank: tiled, chunked), modelled peak memory against the rank's memory, and modelled DiT and VAE time (tokens or rows /
speed; units: all the work on one speed-1 rank).

Results: ``benchmarks/results/capacities.md`` and ``capacities.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from ..argtypes import positive_int
from . import declare

MODEL = "seedvr2-3b"
RESOLUTIONS = {"1080p": (1072, 1920), "4K": (2160, 3840)}
FRAMES = 81
GROUPS = (  # name, memory GiB per rank, the GPU table's cards for the second speed assumption
    ("32 + 24 GiB", (32, 24), ("5090", "3090")),
    ("80 + 80 + 24 + 24 GiB", (80, 80, 24, 24), ("a100", "a100", "4090", "4090")),
)
PROBE = (256, 40)  # matmul size, matmuls per timed run


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--repeats", type=positive_int, default=3, help="forwards per split (median), interleaved")
    p.add_argument("--grid", default="5,30,54", help="the measured DiT forward's post-patch grid T,H,W")
    p.add_argument("--model", default="small", help="the measured DiT preset (seeded random weights)")
    p.add_argument("--no-measure", action="store_true", help="the modelled tables only (no ranks)")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "capacities", "ranks of unequal capacity: equal vs capacity-aware split, measured and modelled",
                   __doc__, _arguments, main)


# -- measured ------------------------------------------------------------------------------------------------


# The load on rank 1's core: a process of its own (a thread of the rank would fight it for the GIL, not the
# core) that spins in plain Python until the rank ends (the kernel's parent-death signal, its parent's pid
# checked as it spins) or its time is up.
SPINNER = """
import ctypes, os, signal, sys, time
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
parent, end = int(sys.argv[1]), time.time() + float(sys.argv[2])
os.sched_setaffinity(0, {int(sys.argv[3])})
while time.time() < end and os.getppid() == parent:
    for _ in range(100000):
        pass
"""


def _probe() -> float:
    """Matmuls per second of this rank, the median of five timed runs (the share of its core it gets, on a
    machine others use too, moves from run to run)."""
    import time

    import torch

    n, k = PROBE
    a = torch.rand(n, n)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        runs.append(time.perf_counter() - t0)
    return k / statistics.median(runs)


def rank_measure(ctx, model: str, grid, repeats: int) -> dict:
    """One rank's probe and timed forwards under each split (every rank runs the same calls)."""
    import subprocess
    import sys
    import time

    import torch

    from ..config import ParallelConfig
    from ..distributed.comm import Comm
    from ..models.seedvr2.job.forward import RunSpec, build_for
    from ..models.seedvr2.parallelize import parallelize
    from ..windows.capacity import Shares

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= ctx.world_size
    if pinned:
        os.sched_setaffinity(0, {cores[ctx.rank]})
    load = None
    if pinned and ctx.rank == 1:  # (the affinity and the thread count are this process's again at the end)
        load = subprocess.Popen([sys.executable, "-c", SPINNER, str(os.getpid()), "1800", str(cores[ctx.rank])])
    try:
        comm = Comm.of(ctx.group)
        rates = comm.all_gather_object(_probe())
        speed = tuple(max(0.01, round(r / max(rates), 2)) for r in rates)
        m, vid, txt = build_for(RunSpec(model, tuple(grid), ctx.world_size, seed=0))
        splits = {"equal": None, "capacity": Shares(speed)}
        runtimes, tokens = {}, {}
        for name, shares in splits.items():
            pc = ParallelConfig.window(ctx.world_size, window_planner="lpt")
            rt = runtimes[name] = parallelize(m.cfg, pc, m.grid_of(vid.shape), comm, shares)
            tokens[name] = [rt.num_local_rows(i) for i in range(rt.num_layers)]
            with torch.no_grad():
                m(vid, txt, 1000.0, runtime=rt)  # warm-up
        wall = {n: [] for n in splits}
        cpu = {n: [] for n in splits}
        for _ in range(repeats):
            for name in splits:
                comm.all_gather_object(None)  # every rank starts together
                t0, c0 = time.perf_counter(), time.thread_time()
                with torch.no_grad():
                    m(vid, txt, 1000.0, runtime=runtimes[name])
                cpu[name].append(time.thread_time() - c0)
                comm.all_gather_object(None)  # the forward is done when the last rank is
                wall[name].append(time.perf_counter() - t0)
    finally:
        if load is not None:
            load.kill()
            load.wait()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    return {"rank": ctx.rank, "pinned": pinned, "rate": rates[ctx.rank], "speed": speed, "tokens": tokens,
            "wall": {n: statistics.median(v) for n, v in wall.items()},
            "cpu": {n: statistics.median(v) for n, v in cpu.items()}}


def measured_table(ranks: list[dict]) -> list[str]:
    speed = ranks[0]["speed"]
    out = ["| split | rank | speed (probed) | tokens (mean per layer) | modelled time (tokens / speed) | CPU s | "
           "busy s (CPU / speed) | forward wall s | busy imbalance (max / mean) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("equal", "capacity"):
        busy = [r["cpu"][name] / speed[r["rank"]] for r in ranks]
        wall = max(r["wall"][name] for r in ranks)
        imb = max(busy) / statistics.mean(busy)
        for r in ranks:
            tok = statistics.mean(r["tokens"][name])
            out.append(f"| {name} | {r['rank']} | {speed[r['rank']]:g} | {tok:,.0f} | {tok / speed[r['rank']]:,.0f} | "
                       f"{r['cpu'][name]:.3f} | {busy[r['rank']]:.3f} | {wall:.3f} | {imb:.2f} |")
    return out


# -- modelled ------------------------------------------------------------------------------------------------


def modelled(res: str, memory_gib, speeds) -> dict:
    """The equal and the capacity split of one request on one group (see the module's docstring)."""
    from ..models.seedvr2.job.budget import GiB, estimate, rank_estimates
    from ..models.seedvr2.job.sizing import clip_grid
    from ..models.seedvr2.presets import dit_config
    from ..models.seedvr2.vae.layouts import even_split
    from ..models.seedvr2.vae.modes import BY_NAME
    from ..windows.capacity import Capacities, proportional_split
    from ..windows.schedule import plan_schedule

    hw = RESOLUTIONS[res]
    cfg = dit_config(MODEL)
    _, latent, grid = clip_grid(MODEL, FRAMES, hw)
    memory = tuple(int(m * GiB) for m in memory_gib)
    caps = Capacities.of(len(memory), memory, speeds)
    p, h = caps.world_size, latent[1]
    out = {}
    even = estimate(MODEL, "bf16", FRAMES, hw, p, "auto", min(memory))
    for split in ("equal", "capacity"):
        if split == "equal":
            ests, shares, rows = (even,) * p, None, [b - a for a, b in even_split(h, p)]
        else:
            ests, limits = rank_estimates(MODEL, "bf16", FRAMES, hw, caps)
            shares, rows = caps.shares(limits), proportional_split(h, caps.speed, minimum=1)
        if not BY_NAME[ests[0].vae_mode].slab:  # replicated, chunked, tiled: whole frames on every rank
            rows = [h] * p  # (time: the frames split evenly, the rows whole)
        sch = plan_schedule(grid, cfg.window_methods, p, "lpt", cfg.num_windows, shares=shares)
        layers = [sch.layer_plan(i) for i in range(len(sch.layer_methods))]
        n = sch.num_tokens
        dit = [sum(int(pl.rank_tokens[r]) for pl in layers) / caps.speed[r] / (len(layers) * n) for r in range(p)]
        step = sum(max(int(pl.rank_tokens[r]) / caps.speed[r] for r in range(p)) for pl in layers) / (len(layers) * n)
        out[split] = {
            "vae_mode": ests[0].vae_mode,
            "ranks": [{"tokens": max(int(pl.rank_tokens[r]) for pl in sch.plans.values()), "vae_rows": rows[r],
                       "memory_gib": round(ests[r].total / GiB, 2), "budget_gib": memory_gib[r],
                       "fits": ests[r].total <= memory[r], "dit_time": round(dit[r], 4),
                       "vae_time": round(rows[r] / caps.speed[r] / h, 4)} for r in range(p)],
            "dit_step": round(step, 4), "vae_step": round(max(rows[r] / caps.speed[r] / h for r in range(p)), 4),
        }
        out[split]["fits"] = all(x["fits"] for x in out[split]["ranks"])
    return out


def _cases() -> list[tuple[str, str, tuple, str, tuple | None]]:
    from ..models.gpus import gpu

    cases = []
    for res in RESOLUTIONS:
        for group, memory, cards in GROUPS:
            rates = [gpu(c).bf16_tflops for c in cards]
            table = tuple(round(r / max(rates), 2) for r in rates)
            names = " + ".join(gpu(c).label.split(" (")[0] for c in cards)
            cases.append((res, group, memory, "from memory (default)", None))
            cases.append((res, group, memory, f"GPU table: {names}", table))
    return cases


def modelled_tables(results: list[dict]) -> list[str]:
    out = ["| request | group | speeds | split | VAE mode | every rank fits | DiT step (modelled) | VAE step (modelled) | "
           "capacity / equal (DiT) |",
           "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for c in results:
        for split in ("equal", "capacity"):
            s = c["splits"][split]
            fits = "yes" if s["fits"] else "no (rank " + ", ".join(
                str(r) for r, x in enumerate(s["ranks"]) if not x["fits"]) + ")"
            ratio = f"{s['dit_step'] / c['splits']['equal']['dit_step']:.2f}" if split == "capacity" else ""
            out.append(f"| {c['request']} | {c['group']} | {c['speeds_label']} ({':'.join(f'{v:g}' for v in c['speed'])}) "
                       f"| {split} | {s['vae_mode']} | {fits} | {s['dit_step']:.4f} | {s['vae_step']:.4f} | {ratio} |")
    out += ["", "Per rank (tokens: DiT, the most over layouts; rows: the VAE's latent slab, all of them where the mode "
            "runs whole frames on every rank; memory: modelled peak of the window against the rank's memory):", "",
            "| request | group | speeds | split | rank | speed | tokens | VAE rows | memory GiB | fits | DiT time | VAE time |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for c in results:
        for split in ("equal", "capacity"):
            for r, x in enumerate(c["splits"][split]["ranks"]):
                out.append(f"| {c['request']} | {c['group']} | {c['speeds_label']} | {split} | {r} | {c['speed'][r]:g} | "
                           f"{x['tokens']:,} | {x['vae_rows']} | {x['memory_gib']:.2f} of {x['budget_gib']} | "
                           f"{'yes' if x['fits'] else 'NO'} | {x['dit_time']:.4f} | {x['vae_time']:.4f} |")
    return out


# -- the run -------------------------------------------------------------------------------------------------


def _machine() -> str:
    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPU cores ({len(os.sched_getaffinity(0))} usable), torch {torch.__version__}"


def _write(path: Path, text: str) -> None:
    """``text`` to ``path`` whole or not at all (a temporary file renamed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as an open() would have made it, not mkstemp's owner-only mode
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(args: argparse.Namespace, parser=None) -> int:
    parser = parser or argparse.ArgumentParser()
    try:
        grid = tuple(int(v) for v in args.grid.split(","))
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--grid {args.grid}: expected T,H,W, each >= 1")
    from ..models.seedvr2.nadit.config import PRESETS

    if args.model not in PRESETS:
        parser.error(f"--model {args.model}: choose one of {', '.join(PRESETS)}")
    results = []
    for res, group, memory, label, speed in _cases():
        from ..windows.capacity import speed_from_memory

        sp = speed or speed_from_memory(memory)
        results.append({"request": f"{res}, {FRAMES} frames", "group": group, "speeds_label": label,
                        "speed": list(sp), "splits": modelled(res, memory, sp)})
    lines = ["## Modelled: the released 3B (bf16) on GPUs of unequal memory and speed", "",
             f"{MODEL}, bf16, {FRAMES} frames in one window; the DiT and VAE steps in units of all the work on one "
             "speed-1 rank (the slowest rank's tokens or rows / its speed; the ranks meet at every layout change and "
             "slab exchange); memory is the restoration's estimate (job/budget.py), not a measurement", "",
             *modelled_tables(results)]
    measured = None
    if not args.no_measure:
        from ..distributed.launcher import LocalCluster

        load = os.getloadavg()[0]
        with LocalCluster(2, timeout_s=900, threads=1) as cluster:
            measured = cluster.run(rank_measure, args.model, grid, args.repeats)
        load = f"load average {load:.1f} before and {os.getloadavg()[0]:.1f} after the run on {os.cpu_count()} cores"
        how = ("each rank pinned to a core of its own, rank 1 sharing its core with a spinning process"
               if measured[0]["pinned"] else "NOT made unequal: fewer than two usable cores to pin to")
        lines = ["## Measured: two CPU ranks of unequal speed", "",
                 f"DiT `{args.model}` preset, seeded random weights, grid {'x'.join(map(str, grid))}, fp32, Plan A LPT, "
                 f"fast kernel calls, one thread per rank; {how}; median of {args.repeats} forwards per split, "
                 f"interleaved; speeds from a probe of matmuls on both ranks at once; {load} (a wall time far above "
                 "the CPU seconds is time the ranks spent waiting for a core other processes held)", "",
                 *measured_table(measured), "", *lines]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    head = ["# Ranks of unequal capacity: equal vs capacity-aware split (`ditsp bench capacities`)", "",
            f"Machine: {_machine()}. Date: {date}. What: `ditsp bench capacities "
            f"--repeats {args.repeats} --grid {args.grid} --model {args.model}"
            f"{' --no-measure' if args.no_measure else ''}`.", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "capacities.md", text)
    _write(out / "capacities.json", json.dumps({"args": vars(args) | {"func": None}, "modelled": results,
                                                "measured": measured}, indent=1, default=str) + "\n")
    return 0
