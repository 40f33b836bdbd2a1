"""What the resource checks plan against: the machine's available memory at that instant, or the figure
``DITSP_AVAILABLE_GIB`` declares (the test suite declares one in conftest.py, so no test's fate depends on
what other processes hold while it runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ditsp.memory import AVAILABLE_ENV, RANK_BASE_BYTES, available_bytes, check_local_ranks, local_rank_limit

GiB = 2**30


def test_the_suite_plans_against_its_declared_figure():
    assert available_bytes(1) == 16 * GiB and available_bytes(4) == 4 * GiB
    assert local_rank_limit() == 16 * GiB // RANK_BASE_BYTES


def test_a_declared_figure_is_what_the_rank_check_sees(monkeypatch):
    monkeypatch.setenv(AVAILABLE_ENV, "0.5")  # room for one rank's process (300 MiB), not two
    assert available_bytes(2) == GiB // 4
    check_local_ranks(1)
    with pytest.raises(ValueError, match=r"^--sp 2: 2 local ranks need about 0.6 GiB .* 0.5 GiB available, room "
                                         r"for at most 1 ranks \(--force does not override this\)$"):
        check_local_ranks(2)


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads /proc/meminfo")
def test_unset_it_is_the_machines_available_memory(monkeypatch):
    monkeypatch.delenv(AVAILABLE_ENV)
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert 0 < available_bytes(2) <= available_bytes(1) <= total


@pytest.mark.parametrize("raw", ["lots", "0", "-2", "nan", "inf"])
def test_a_bad_figure_is_one_line_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(AVAILABLE_ENV, raw)
    with pytest.raises(ValueError) as e:
        available_bytes(1)
    assert str(e.value) == f"DITSP_AVAILABLE_GIB={raw!r}: expected a number of GiB > 0"
