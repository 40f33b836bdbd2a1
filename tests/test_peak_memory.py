"""PeakMemory: a benchmark settles the heap before its region; a job's stages only reset the high-water mark."""

import mmap
import os

import pytest
import torch

from ditsp import memory
from ditsp.models.seedvr2.job.restore import _Stages


def test_benchmarks_settle_the_heap_and_job_stages_do_not(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_release_free_heap", lambda: calls.append("settled"))
    memory.PeakMemory(torch.device("cpu")).start()
    assert calls == ["settled"]
    stages = _Stages(torch.device("cpu"))
    assert stages.run("read", 0, lambda: 7) == 7
    assert stages.run("write", 0, lambda: None) is None
    assert calls == ["settled"]  # no collection between a job's stages (0.1 s each after torch's import)
    assert [name for name, *_ in stages.timeline] == ["read", "write"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the RSS high-water mark reset is Linux's")
@pytest.mark.parametrize("settle", [True, False])
def test_peak_added_counts_what_the_region_touched(settle):
    # A fresh anonymous mapping, every page written: new resident memory whatever the C allocator keeps.
    # (A 64 MiB tensor may instead reuse heap pages an earlier test freed but glibc kept resident, which
    # without settling adds nothing to the RSS: seen on CI's machine.)
    meter = memory.PeakMemory(torch.device("cpu"), settle=settle)
    meter.start()
    size = 64 << 20
    with mmap.mmap(-1, size) as block:
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        assert meter.peak_added() >= 60 << 20
