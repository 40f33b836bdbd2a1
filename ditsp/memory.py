"""Memory per rank: the peak of a region of code (CUDA peak or RSS high-water mark), and what
one rank can use before work starts (:func:`available_bytes`)."""

from __future__ import annotations

import gc
import math
import os
import resource

import torch

from .cpu.malloc import libc, release_free_heap


class PeakMemory:
    """Peak memory a region of code adds: the CUDA allocator's peak, else the RSS high-water mark.

    On Linux the RSS peak (VmHWM) is reset at the start, so each measured
    region is independent of what the process did before. With ``settle``
    (benchmarks) garbage is collected and free heap memory handed back first,
    so the starting RSS is what is live, not what earlier work happened to
    leave cached (which moved the figure by a megabyte from run to run).
    Without it (the stages of a job) the reset alone: a full collection walks
    every object torch's import made (~165k; 0.1 s on this project's 2-core VM),
    which was 2 s of an 18 s ``ditsp upscale`` that measured its 19 stages, and
    memory handed back is faulted in again by the next stage.
    """

    def __init__(self, device: torch.device, settle: bool = True):
        self.device = device
        self.settle = settle

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        if self.settle:
            _release_free_heap()
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


def _release_free_heap() -> None:
    """Collect garbage and return glibc's free heap pages to the system (no-op off glibc)."""
    gc.collect()
    release_free_heap()


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


AVAILABLE_ENV = "DITSP_AVAILABLE_GIB"


def declared_available_bytes() -> int | None:
    """The host memory ``DITSP_AVAILABLE_GIB`` tells ditsp to plan against (GiB), or None where it is unset.

    A figure that does not move with what other processes hold at that instant: the test suite sets one, so
    whether a test runs never depends on the machine's load; a container whose ``/proc/meminfo`` shows the
    host's memory sets its own limit. ValueError (one line) for anything but a finite number > 0.
    """
    raw = os.environ.get(AVAILABLE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{AVAILABLE_ENV}={raw!r}: expected a number of GiB > 0")
    return int(gib * 2**30)


def available_bytes(ranks_here: int, device: torch.device | None = None) -> int:
    """Memory one rank can use: the device's free memory, else this machine's available RAM (or
    ``DITSP_AVAILABLE_GIB``, :func:`declared_available_bytes`) / local ranks."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    declared = declared_available_bytes()
    if declared is not None:
        return declared // max(1, ranks_here)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // max(1, ranks_here)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) // max(1, ranks_here)


RANK_BASE_BYTES = 300 * 2**20  # a spawned rank: Python, torch and ditsp imported (measured ~280 MiB on CPU)
RANKS_PER_CORE_LIMIT = 8  # past this many local ranks per core, commands refuse unless --force


def local_rank_limit() -> int:
    """The most local ranks this machine can hold: each spawned rank's own process in the available RAM."""
    return max(1, available_bytes(1) // RANK_BASE_BYTES)


def check_local_ranks(n: int, what: str = "--sp") -> None:
    """ValueError (one line naming the rank count) when ``n`` local ranks cannot fit, before any is started.

    A hard bound: ``--force`` overrides estimates, not this (the ranks' processes alone would not fit).
    """
    limit = local_rank_limit()
    if n > 1 and n > limit:
        raise ValueError(f"{what} {n}: {n} local ranks need about {n * RANK_BASE_BYTES / 2**30:.1f} GiB for their "
                         f"processes alone ({RANK_BASE_BYTES // 2**20} MiB each); this machine has "
                         f"{available_bytes(1) / 2**30:.1f} GiB available, room for at most {limit} ranks "
                         f"(--force does not override this)")


def check_local_cores(n: int, threads: int = 1, what: str = "--sp",
                      remedy: str = "use fewer ranks, or torchrun across machines") -> str | None:
    """For ``n`` local ranks of ``threads`` compute threads: ValueError (one line, ending in ``remedy``) past
    :data:`RANKS_PER_CORE_LIMIT` ranks per CPU core; else the warning to print when they oversubscribe the
    cores (None when they fit). The one home of this check for every command that starts local ranks."""
    cores = os.cpu_count() or 1
    plural = "s" if cores > 1 else ""
    if n > RANKS_PER_CORE_LIMIT * cores:
        raise ValueError(f"{what} {n}: {n} local ranks on {cores} CPU core{plural} (more than {RANKS_PER_CORE_LIMIT} "
                         f"per core); {remedy}")
    if n > 1 and n * threads > cores:
        return (f"{n} ranks x {threads} thread{'s' if threads > 1 else ''} on {cores} CPU core{plural}: "
                f"oversubscribed, it will be slow")
    return None


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def exact_cpu_peaks(threshold: int = 16 * 1024) -> bool:
    """Serve every CPU allocation over ``threshold`` bytes by mmap in this process (glibc only).

    glibc raises its mmap threshold after the first large free (up to 32 MiB),
    after which freed tensors stay in the heap: the RSS peak then measures the
    allocator's retention, and two runs of the same forward can differ by a
    third. With a fixed threshold each tensor is mapped and unmapped on its own,
    so :class:`PeakMemory` on CPU reads the tensors' peak (what a device
    allocator's peak reports). The default is low (16 KiB, not glibc's 128 KiB):
    the small tensors of a rank's collectives (text rows, counts, chunk tails)
    otherwise landed in heap holes or grew the heap depending on what earlier
    work left, moving a small forward's peak by ~3 MB of ~23 from run to run.
    Returns whether the setting took effect.
    """
    try:
        return bool(libc().mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
