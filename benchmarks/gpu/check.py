"""``make gpu-check``: run every step of the GPU check in a watched child process; a cut-off run still reports.

    python -m benchmarks.gpu.check [--out benchmarks/results/gpu] [--profile auto|gpu|tiny] [--budget S]

The run directory is ``<out>/<date>-<device>`` (``results.json``, ``results.md``, ``log.txt``). This
parent imports no torch: it starts :mod:`.runner` with the steps left, reads the report while the
child runs, kills the child's process group when the running step passes its budget (plus a grace
of :data:`GRACE_S`) and records that step as timed out, records a step whose process died as
crashed, and starts a fresh child for the steps after it, until every step has an outcome or the
run's budget is spent (the steps left are then skipped, said so). Exit status: 0 when nothing
failed, 1 otherwise (the results are written either way).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import profiles
from .report import Report

GRACE_S = 10.0  # past a step's budget before its process is killed (a step checks its own clock first)
POLL_S = 0.2
LOG = "log.txt"


def device_name() -> str:
    """The first GPU's name from nvidia-smi (no CUDA context is made here), or ``cpu``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15)
        names = out.stdout.strip().splitlines() if out.returncode == 0 else []
        return names[0].strip() if names else "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def run_dir(out: Path, device: str, today: str | None = None) -> Path:
    """``<out>/<date>-<device slug>``, numbered when taken (``-2``, ``-3``, ...)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    base = out / f"{today or datetime.date.today().isoformat()}-{slug}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _tee(stream, sinks) -> threading.Thread:
    def pump():
        for line in iter(stream.readline, b""):
            for s in sinks:
                s.write(line)
                s.flush()
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _kill(proc: subprocess.Popen) -> None:
    """End the child and the processes it started (its own process group, made at its start)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def supervise(cmd: list[str], report: Report, deadline: float, log_path: Path, grace_s: float = GRACE_S) -> int:
    """Run ``cmd`` (a runner) to its end or cut it off; returns its exit code (None-safe: -9 when killed).

    The running step (read from the report) is cut off at its start + budget + ``grace_s``; the whole
    child at ``deadline`` + ``grace_s``. A step left ``running`` when the child ends is recorded:
    timed out when it was killed for time, crashed otherwise (with the log's last lines)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        pump = _tee(proc.stdout, [log, sys.stdout.buffer])
        killed = None
        while proc.poll() is None:
            time.sleep(POLL_S)
            try:
                current = Report(report.dir).running()
            except (OSError, ValueError):  # mid-replace on an odd filesystem: read it next time
                continue
            now = time.time()
            if current and now > current["started"] + current["budget_s"] + grace_s:
                killed = (current["name"], f"cut off at its budget of {current['budget_s']:.0f} s")
            elif now > deadline + grace_s:
                killed = (current["name"] if current else None, "cut off at the run's budget")
            if killed:
                _kill(proc)
                break
        proc.wait()
        pump.join(5.0)
    fresh = Report(report.dir)
    report.data = fresh.data
    left = fresh.running()
    if left is not None:
        if killed and killed[0] == left["name"]:
            report.end(left["name"], "timed out", killed[1])
        else:
            report.end(left["name"], "crashed", f"the process ended with code {proc.returncode}: {_tail(log_path)}")
    return proc.returncode


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(t.strip() for t in text[-lines:])[:400]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/gpu", help="where the run directory goes")
    p.add_argument("--profile", default="auto", help="gpu, tiny, or auto (gpu where torch sees CUDA)")
    p.add_argument("--budget", type=float, default=None, help="the whole run's seconds (default: the profile's)")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every budget (a slower device; the suite's dry run on a loaded CPU)")
    p.add_argument("--steps", default=",".join(profiles.STEPS))
    p.add_argument("--block-imports", default="", help="packages the child may not import (the image lacks them)")
    p.add_argument("--run-dir", default=None, help="exactly this run directory (default: <out>/<date>-<device>); "
                   "an earlier run's: run only its steps without an outcome")
    p.add_argument("--redo", action="store_true", help="with --run-dir: run the --steps again even if they have one")
    a = p.parse_args(argv)
    steps = [s for s in a.steps.split(",") if s]
    unknown = [s for s in steps if s not in profiles.STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(profiles.STEPS)}")
    device = device_name()
    profile = a.profile if a.profile != "auto" else ("gpu" if device != "cpu" else "tiny")
    budget = a.budget or profiles.get(profile).total_s * a.budget_scale
    path = Path(a.run_dir) if a.run_dir else run_dir(Path(a.out), device)
    report = Report(path)
    start = time.time()
    deadline = start + budget
    report.run(device=device, date=datetime.date.today().isoformat(), budget_s=budget,
               started=datetime.datetime.now().isoformat(timespec="seconds"))
    if a.redo:
        report.data["steps"] = [s for s in report.data["steps"] if s["name"] not in steps]
        report.write()
    print(f"gpu-check: {device}, profile {profile}, budget {budget:.0f} s -> {path}", flush=True)
    while True:
        left = [s for s in steps if not report.done(s)]
        if not left:
            break
        if deadline - time.time() < 3.0:
            for s in left:
                report.end(s, "skipped", "no time left in the run")
            break
        cmd = [sys.executable, "-m", f"{__package__}.runner", str(path), "--profile", profile,
               "--steps", ",".join(left), "--deadline", str(deadline), "--budget-scale", str(a.budget_scale)]
        if a.block_imports:
            cmd += ["--block-imports", a.block_imports]
        code = supervise(cmd, report, deadline, path / LOG)
        for stray in path.glob(".results.*.tmp"):  # a write the kill interrupted
            stray.unlink(missing_ok=True)
        if all(not report.done(s) for s in left):  # no step got an outcome (died at start-up): say so, stop
            for s in left:
                report.end(s, "crashed", f"the runner ended with code {code} before this step: {_tail(path / LOG)}")
    report.run(seconds=round(time.time() - start, 1))
    print((path / "results.md").read_text().split("\n## ")[0], flush=True)  # the summary; the rest is in the file
    bad = report.failures()
    print(f"gpu-check: {len(bad)} failure(s)" + "".join(f"\n  {b}" for b in bad), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
