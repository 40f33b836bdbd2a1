"""Timing, memory and error helpers of the GPU check: device events on CUDA, the wall clock elsewhere."""

from __future__ import annotations

import statistics
import time
import warnings
from contextlib import contextmanager

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """(median seconds, every rep's seconds) of ``fn()`` after ``warmup`` calls; CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


class Peak:
    """Peak bytes allocated in a region on CUDA (absolute, and above what was live at its start), plus the
    allocator's reserved peak (its overhead over the tensors); None elsewhere (the CPU dry run)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = self.peak = self.reserved = None

    def __enter__(self) -> "Peak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)

    @property
    def added(self) -> int | None:
        return None if self.peak is None else self.peak - self.base


def gib(n) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (NaN anywhere gives NaN: never a pass)."""
    g, w = got.detach().double(), want.detach().double()
    return float(torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w).clamp_min(1e-300))


def free_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def host_syncs(device: torch.device, into: list):
    """Record, as (file:line, message) in ``into``, each operation that makes the host wait for the device
    (``torch.cuda.set_sync_debug_mode``); nothing is recorded off CUDA."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            into.append((f"{w.filename}:{w.lineno}", str(w.message).splitlines()[0][:120]))
