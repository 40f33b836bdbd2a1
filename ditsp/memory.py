"""Peak memory of a region of code, per rank: the CUDA allocator's peak, else the RSS high-water mark."""

from __future__ import annotations

import resource

import torch


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
