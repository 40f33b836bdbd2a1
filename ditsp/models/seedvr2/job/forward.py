"""The `ditsp run` job: one NaDiT forward per rank, with its time, peak memory and collectives.

- :class:`Engine` holds one rank's model (built on first use and cached in the
  rank's process by :class:`ModelSpec`), its SP runtimes (one per request
  shape, path and planner) and runs forwards through them. A local cluster
  or a torchrun job that runs many requests builds the model once.
- :func:`rank_forward` / :func:`run` are the job: one forward per rank (run on
  the ranks by :func:`ditsp.distributed.dispatch.dispatch`), summarised, and
  optionally the parity against one device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ....config import ParallelConfig
from ....distributed.dispatch import dispatch
from ....distributed.launcher import LocalCluster, RankContext
from ....dtypes import DTYPES
from ....fixed_shape import DEFAULT_DETERMINISTIC, shapes_for
from ....memory import PeakMemory, exact_cpu_peaks
from ....weights.offload import offload_blocks
from ....windows.ownership import RowOwnership
from ... import resident
from ..compiled import compile_dit, describe, stance
from ..nadit.model import build_model, random_inputs
from ..parallelize import parallelize, single_runtime


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a model's weights on a rank (the engine's cache key)."""

    model: str
    layers: int | None = None
    checkpoint: str | None = None
    dtype: str = "fp32"
    seed: int = 0
    weights_dtype: str | None = None  # "fp8"/"fp8_e5m2": weights quantized at load (ditsp/weights)
    offload_blocks: int = 0  # the first N blocks kept in host memory, each brought in ahead of its turn


@dataclass(frozen=True)
class RunSpec:
    model: str
    grid: tuple[int, int, int]
    sp: int
    layers: int | None = None
    checkpoint: str | None = None
    dtype: str = "fp32"
    planner: str | None = None  # None: the path's own (auto chooses); a name implies Plan A with it
    path: str = "auto"
    seed: int = 0
    warmup: int = 0
    repeats: int = 1
    # "canonical": every rank holds the whole latent and the whole output (the model scatters and
    # all-gathers); "rows": each rank holds only its contiguous shard of latent pixel rows, in and out
    # (``NaDiT.forward(rows=...)``), and the output is gathered to rank 0 after the measured region.
    feed: str = "canonical"
    # CPU only: serve every allocation over 128 KiB by mmap (``memory.exact_cpu_peaks``), so the RSS
    # peak is the tensors' peak instead of glibc's heap retention.
    exact_memory: bool = False
    # Fixed-shape kernel calls (ditsp.fixed_shape): the output equals one device's bit for bit.
    deterministic: bool = DEFAULT_DETERMINISTIC
    weights_dtype: str | None = None
    offload_blocks: int = 0  # ditsp/weights/offload.py
    # torch.compile of the blocks (ditsp.models.seedvr2.compiled): one warm-up forward compiles before the
    # timed ones; the compiled blocks stay with the engine's cached model
    compile: bool = False

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.layers, self.checkpoint, self.dtype, self.seed, self.weights_dtype,
                         self.offload_blocks)


def _model_of(spec: ModelSpec, device: torch.device | str = "cpu"):
    """The model of ``spec``, identical on every rank (a checkpoint, or seeded weights)."""


    model = build_model(spec.model, spec.layers, spec.checkpoint, seed=spec.seed, dtype=DTYPES[spec.dtype],
                        device=device, weights_dtype=spec.weights_dtype)
    offload_blocks(model, spec.offload_blocks, device)
    return model


def build_for(spec: RunSpec, device: torch.device | str = "cpu"):
    """Model and seeded inputs of a run spec, identical on every rank."""

    model = Engine.get(spec.model_spec, device).model
    vid, txt = random_inputs(model.cfg, spec.grid, seed=spec.seed + 1)
    return model, vid.to(device), txt.to(device)


class Engine:
    """One rank's model and runtimes, reused by every request this process serves."""

    MAX_RUNTIMES = 16

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu"):
        self.spec, self.device = spec, torch.device(device)
        self.model = _model_of(spec, self.device)
        self._runtimes: dict = {}

    @classmethod
    def get(cls, spec: ModelSpec, device: torch.device | str = "cpu") -> "Engine":
        """This process's engine for ``spec`` (built on first use; held in the process's one model cache,
        :mod:`ditsp.models.resident`, which keeps one model per rank)."""
        return resident.get(("engine", spec, str(device)), lambda: cls(spec, device))

    def runtime(self, grid, sp: int, group, path: str = "auto", planner: str | None = None,
                deterministic: bool = DEFAULT_DETERMINISTIC):
        """The SP runtime of a request (cached by grid, path, planner, kernel-shape policy and group)."""

        key = (tuple(grid), sp, path, planner, deterministic, id(group))
        if key not in self._runtimes:
            if len(self._runtimes) >= self.MAX_RUNTIMES:
                self._runtimes.pop(next(iter(self._runtimes)))
            pc = ParallelConfig.window(sp, window_planner=planner, window_path=path, deterministic=deterministic)
            self._runtimes[key] = parallelize(self.model.cfg, pc, grid, group)
        return self._runtimes[key]


def input_rows(spec: RunSpec, patch) -> "RowOwnership":
    """The contiguous shards of latent pixel rows ``feed="rows"`` gives the ranks (as even as possible)."""

    fine = tuple(g * p for g, p in zip(spec.grid, patch))
    n = fine[0] * fine[1] * fine[2]
    return RowOwnership.contiguous(fine, [n // spec.sp + (r < n % spec.sp) for r in range(spec.sp)], "input-shards")


def rank_forward(ctx: RankContext, spec: RunSpec, return_output: bool = True) -> dict:
    """One rank's forward(s); rank 0 also returns the output when asked."""
    if spec.feed not in ("canonical", "rows"):
        raise ValueError(f"feed must be 'canonical' or 'rows', got {spec.feed!r}")
    if spec.exact_memory and ctx.device.type == "cpu":
        exact_cpu_peaks()
    engine = Engine.get(spec.model_spec, ctx.device)
    model, vid, txt = build_for(spec, ctx.device)
    group = ctx.group if ctx.world_size > 1 else None
    rt = engine.runtime(spec.grid, spec.sp, group, spec.path, spec.planner, spec.deterministic)
    rows = None
    if spec.feed == "rows":  # this rank's shard only; the whole latent is dropped before any forward
        rows = input_rows(spec, model.cfg.patch_size)
        ids = torch.from_numpy(rows.rank_ids(ctx.rank)).to(vid.device)
        latent_shape = vid.shape
        vid = vid.reshape(-1, vid.shape[-1]).index_select(0, ids)
    times, memory = [], PeakMemory(ctx.device)
    with stance(spec.compile):
        compile_s = _compile_warmup(model, vid, txt, rt, rows) if spec.compile else None
        out = _timed(spec, ctx, model, vid, txt, rt, rows, times, memory)
    peak = memory.peak_added()
    stats = rt.comm.stats
    collectives = stats.as_dict()
    summary = (stats.bytes_sent, stats.bytes_recv, stats.calls)
    if rows is not None and return_output:  # outside the measured region: the whole output for rank 0
        parts = rt.comm.all_gather_rows(out, [int(v) for v in rows.rank_rows], kind="result_gather")
        out = torch.cat(parts).view(*latent_shape[:3], -1)
    return {
        "rank": ctx.rank,
        "times_s": times,
        "peak_bytes": peak,
        "bytes_sent": summary[0],
        "bytes_recv": summary[1],
        "calls": summary[2],
        "collectives": collectives,
        "report": rt.report(heads=model.cfg.heads),
        "kernel_shapes": rt.kernel_shapes.describe(),
        "compile": describe(model) if spec.compile else "eager",
        "compile_warmup_s": compile_s,
        "output": out.float().cpu() if return_output and ctx.rank == 0 else None,
        "offload": model.block_offload.report() if getattr(model, "block_offload", None) else None,
    }


def _compile_warmup(model, vid, txt, rt, rows) -> float:
    """Compile the blocks (once per model) and run one untimed forward: the shape family's compile."""
    compile_dit(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(vid, txt, 1000.0, runtime=rt, rows=rows)
    return time.perf_counter() - t0


def _timed(spec: RunSpec, ctx, model, vid, txt, rt, rows, times: list, memory: PeakMemory) -> torch.Tensor:
    """The warm-up and timed forwards (their times appended to ``times``); returns the last output."""
    out = None
    for i in range(spec.warmup + spec.repeats):
        rt.comm.stats.reset()  # the report shows one forward's collectives (all are alike)
        if i == spec.warmup:
            memory.start()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(vid, txt, 1000.0, runtime=rt, rows=rows)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i >= spec.warmup:
            times.append(time.perf_counter() - t0)
    return out


def run(spec: RunSpec, check: bool = False, threads: int = 1, timeout_s: float = 3600.0,
        cluster: LocalCluster | None = None) -> dict:
    """Run ``spec`` on its ranks (see :func:`dispatch`) and summarise."""
    results = dispatch(rank_forward, spec, sp=spec.sp, threads=threads, timeout_s=timeout_s, cluster=cluster)
    return summarize(spec, results, check, threads)


def summarize(spec: RunSpec, results: list[dict], check: bool, threads: int) -> dict:
    out = results[0]["output"]
    summary = {
        "spec": asdict(spec),
        "world_size": spec.sp,
        "path": results[0]["report"],
        "kernel_shapes": results[0]["kernel_shapes"],
        "compile": results[0]["compile"],
        "compile_warmup_s": [r["compile_warmup_s"] for r in results] if spec.compile else None,
        "rank_time_s": [min(r["times_s"]) for r in results],
        "rank_median_s": [statistics.median(r["times_s"]) for r in results],
        "rank_peak_bytes": [r["peak_bytes"] for r in results],
        "bytes_moved": sum(r["bytes_sent"] for r in results),
        "rank_bytes_sent": [r["bytes_sent"] for r in results],
        "rank_calls": [r["calls"] for r in results],
        "collectives": results[0]["collectives"],
        "output_shape": list(out.shape) if out is not None else None,
    }
    if results[0].get("offload"):
        summary["offload"] = results[0]["offload"]
    if check and out is not None:
        torch.set_num_threads(threads)
        model, vid, txt = build_for(spec)
        one = single_runtime(model.cfg, model.grid_of(vid.shape))
        one.kernel_shapes = shapes_for(spec.deterministic)  # one device runs the same calls (or plain ones)
        with torch.no_grad(), stance(False):  # the eager reference, even where this process's model is compiled
            ref = model(vid, txt, 1000.0, runtime=one).float()
        summary["max_abs_err"] = float((out - ref).abs().max())
        summary["ref_max_abs"] = float(ref.abs().max())
        summary["rel_err"] = summary["max_abs_err"] / max(summary["ref_max_abs"], 1e-30)
    return summary
