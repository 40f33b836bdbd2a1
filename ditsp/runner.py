"""`ditsp run`: one NaDiT forward under SP on local ranks or in a torchrun job, with a report.

Every rank builds the same model (a checkpoint, or weights seeded identically)
and the same seeded inputs, runs one forward through the selected path, and
reports its time, its peak memory growth and its collectives. ``check`` also
runs the single-device forward and reports the parity error.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .config import ParallelConfig
from .dist.launcher import LocalCluster, RankContext, init_from_env

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RunSpec:
    model: str
    grid: tuple[int, int, int]
    sp: int
    layers: int | None = None
    checkpoint: str | None = None
    dtype: str = "fp32"
    planner: str = "lpt"
    path: str = "window"
    seed: int = 0
    warmup: int = 0
    repeats: int = 1


class PeakMemory:
    """Peak memory a region of code adds: the CUDA allocator's peak, else the RSS high-water mark.

    On Linux the RSS peak (VmHWM) is reset at the start, so each measured
    region is independent of what the process did before.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.base = _status_kib("VmRSS") * 1024

    def peak_added(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        hwm = _status_kib("VmHWM") * 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, hwm - self.base)


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def build_for(spec: RunSpec, device: torch.device | str = "cpu"):
    """Model and inputs of a spec, identical on every rank."""
    from .models.seedvr2.nadit.model import build_model, random_inputs

    model = build_model(spec.model, spec.layers, spec.checkpoint, seed=spec.seed, dtype=DTYPES[spec.dtype],
                        device=device)
    vid, txt = random_inputs(model.cfg, spec.grid, seed=spec.seed + 1)
    return model, vid.to(device), txt.to(device)


def make_runtime(model, spec: RunSpec, group):
    """The execution path's runtime for this SP group."""
    from .models.seedvr2.parallelize import parallelize

    pc = ParallelConfig(ulysses_degree=spec.sp, window_planner=spec.planner)
    return parallelize(model.cfg, pc, spec.grid, group, spec.planner, spec.path)


def rank_forward(ctx: RankContext, spec: RunSpec, return_output: bool = True) -> dict:
    """One rank's forward(s); rank 0 also returns the output when asked."""
    model, vid, txt = build_for(spec, ctx.device)
    group = ctx.group if ctx.world_size > 1 else None
    rt = make_runtime(model, spec, group)
    times, memory = [], PeakMemory(ctx.device)
    for i in range(spec.warmup + spec.repeats):
        rt.comm.stats.reset()  # the report shows one forward's collectives (all are alike)
        if i == spec.warmup:
            memory.start()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(vid, txt, 1000.0, runtime=rt)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i >= spec.warmup:
            times.append(time.perf_counter() - t0)
    stats = rt.comm.stats
    return {
        "rank": ctx.rank,
        "times_s": times,
        "peak_bytes": memory.peak_added(),
        "bytes_sent": stats.bytes_sent,
        "bytes_recv": stats.bytes_recv,
        "calls": stats.calls,
        "collectives": stats.as_dict(),
        "report": rt.report(heads=model.cfg.heads),
        "output": out.float().cpu() if return_output and ctx.rank == 0 else None,
    }


def run(spec: RunSpec, check: bool = False, threads: int = 1, timeout_s: float = 3600.0,
        cluster: LocalCluster | None = None) -> dict:
    """Run ``spec`` on local ranks (or in this process for SP=1) and summarise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ctx = init_from_env()
        if ctx.world_size != spec.sp:
            raise ValueError(f"--sp {spec.sp} but torchrun started {ctx.world_size} ranks")
        results = [rank_forward(ctx, spec)]
    elif spec.sp == 1:
        torch.set_num_threads(threads)
        results = [rank_forward(RankContext(0, 1, None, torch.device("cpu")), spec)]
    else:
        own = cluster is None
        cluster = cluster or LocalCluster(spec.sp, timeout_s=timeout_s, threads=threads)
        try:
            results = cluster.run(rank_forward, spec, timeout_s=timeout_s)
        finally:
            if own:
                cluster.close()
    return summarize(spec, results, check, threads)


def summarize(spec: RunSpec, results: list[dict], check: bool, threads: int) -> dict:
    out = results[0]["output"]
    summary = {
        "spec": asdict(spec),
        "world_size": spec.sp,
        "path": results[0]["report"],
        "rank_time_s": [min(r["times_s"]) for r in results],
        "rank_median_s": [statistics.median(r["times_s"]) for r in results],
        "rank_peak_bytes": [r["peak_bytes"] for r in results],
        "bytes_moved": sum(r["bytes_sent"] for r in results),
        "rank_bytes_sent": [r["bytes_sent"] for r in results],
        "rank_calls": [r["calls"] for r in results],
        "collectives": results[0]["collectives"],
        "output_shape": list(out.shape) if out is not None else None,
    }
    if check and out is not None:
        torch.set_num_threads(threads)
        model, vid, txt = build_for(spec)
        with torch.no_grad():
            ref = model(vid, txt, 1000.0).float()
        summary["max_abs_err"] = float((out - ref).abs().max())
        summary["ref_max_abs"] = float(ref.abs().max())
        summary["rel_err"] = summary["max_abs_err"] / max(summary["ref_max_abs"], 1e-30)
    return summary


def format_run(summary: dict) -> str:
    """The text report of `ditsp run`."""
    s = summary["spec"]
    lines = [
        f"{s['model']} ({s['layers'] or 'all'} layers), grid {tuple(s['grid'])}, {s['dtype']}: {summary['path']}",
        f"{'rank':>5} {'time s':>9} {'peak MiB':>9} {'sent MiB':>9} {'calls':>6}",
    ]
    for r, (t, p, b, c) in enumerate(zip(summary["rank_time_s"], summary["rank_peak_bytes"],
                                         summary["rank_bytes_sent"], summary["rank_calls"])):
        lines.append(f"{r:>5} {t:>9.3f} {p / 2**20:>9.1f} {b / 2**20:>9.2f} {c:>6}")
    kinds = ", ".join(f"{k} x{v['calls']}" for k, v in summary["collectives"].items())
    lines.append(f"bytes moved (all ranks): {summary['bytes_moved'] / 2**20:.2f} MiB; rank 0 collectives: {kinds or 'none'}")
    if "max_abs_err" in summary:
        lines.append(
            f"parity vs single device: max abs err {summary['max_abs_err']:.3e} "
            f"(output max {summary['ref_max_abs']:.3f}, relative {summary['rel_err']:.2e})"
        )
    return "\n".join(lines)
