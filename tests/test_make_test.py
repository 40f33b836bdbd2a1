"""`make test` runs both of its phases, the whole suite and then the bitwise tests under another kernel set,
whatever the first gives, and fails if either failed (before, a failure in the suite stopped make, and the
bitwise phase never ran). Run with a stand-in for the venv's python that records its calls."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in
    *"-m bitwise"*) exit "$BITWISE_RC" ;;
    "-c "*) echo "NOT-AVX2" ;;
    *) exit "$SUITE_RC" ;;
esac
"""


def make_test(tmp_path: Path, suite_rc: int, bitwise_rc: int) -> tuple[int, list[str], str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (venv / ".ditsp-installed").touch()  # newer than pyproject.toml: make installs nothing
    log = tmp_path / "calls.log"
    env = dict(os.environ, FAKE_LOG=str(log), SUITE_RC=str(suite_rc), BITWISE_RC=str(bitwise_rc))
    out = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "test", f"VENV={venv}"], env=env,
                         capture_output=True, text=True, timeout=60)
    pytest_calls = [line for line in log.read_text().splitlines() if line.startswith("-m pytest")]
    return out.returncode, pytest_calls, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("suite_rc, bitwise_rc", [(1, 0), (0, 1), (1, 1), (0, 0)])
def test_both_phases_run_and_either_failure_fails_the_target(tmp_path, suite_rc, bitwise_rc):
    rc, calls, output = make_test(tmp_path, suite_rc, bitwise_rc)
    assert len(calls) == 2, output  # the suite, then the bitwise tests, in every case
    assert "-m bitwise" not in calls[0] and "-m bitwise" in calls[1]
    assert (rc != 0) == (suite_rc != 0 or bitwise_rc != 0), output
    if rc:
        assert f"make test: FAILED (the suite: exit {suite_rc}; the bitwise tests: exit {bitwise_rc})" in output
