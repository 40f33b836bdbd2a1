"""The GPU check's child process: runs the steps it is given, in order, into the run's report.

Started by :mod:`.check`, which kills it when a step overruns its budget and starts a fresh one for
the steps left. A step that raises is recorded as failed with its one-line error; on a GPU the child
then exits (code 3), so the next step starts in a fresh process rather than on a CUDA context the
failure may have broken.

``--block-imports av,gguf,...`` makes those packages unimportable here, as they are on the GPU
image (the suite's dry run proves the steps need none of them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import sys
import time
import traceback

from . import profiles
from .report import Report

CUDA_FAILED = 3  # exit code: a step failed on a GPU; the parent goes on in a fresh process


class _Blocked(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return None


class Ctx:
    """What a step gets: its device, profile and clock, and its rows in the report."""

    def __init__(self, report: Report, profile: profiles.Profile, device, step: str, deadline: float):
        self.report, self.profile, self.device, self.step, self.deadline = report, profile, device, step, deadline

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.time()

    def row(self, item: str, result: str = "ok", why: str | None = None, **fields) -> dict:
        return self.report.row(self.step, result, why, item=item, **fields)

    def fail(self, item: str, why: str, **fields) -> dict:
        return self.row(item, "FAIL", why, **fields)

    def skip(self, item: str, why: str, **fields) -> dict:
        return self.row(item, "skip", why, **fields)

    def note(self, text: str) -> None:
        self.report.note(self.step, text)

    def ceiling(self, name: str) -> float | None:
        """A ceiling the env step measured (``bf16_matmul_tflops``, ``copy_gbps``), or None."""
        return self.report.data["run"].get("ceilings", {}).get(name)

    def fits(self, item: str, predicted_s: float) -> bool:
        """Whether ``item`` (predicted to take ``predicted_s``) fits the step's time left; says so when not."""
        left = self.remaining()
        if predicted_s > left:
            self.skip(item, f"predicted {predicted_s:.0f} s, {left:.0f} s left of the step's budget")
            return False
        return True


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (a step's ranks)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _step_module(name: str):
    return importlib.import_module(f"{__package__}.step_{name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.runner")
    p.add_argument("run_dir")
    p.add_argument("--profile", default="auto")
    p.add_argument("--steps", default=",".join(profiles.STEPS))
    p.add_argument("--deadline", type=float, default=None, help="epoch seconds by which every step must end")
    p.add_argument("--block-imports", default="", help="comma-separated packages to make unimportable")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every step's budget")
    a = p.parse_args(argv)
    if a.block_imports:
        sys.meta_path.insert(0, _Blocked(a.block_imports.split(",")))
    import torch  # after the blocker: torch's own optional imports see the image's packages too

    report = Report(a.run_dir)
    cuda = torch.cuda.is_available()
    name = a.profile if a.profile != "auto" else ("gpu" if cuda else "tiny")
    profile = profiles.get(name)
    device = torch.device("cuda", 0) if cuda and name == "gpu" else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device if device.type == "cuda" else 0)
    report.run(profile=name, compute_device=str(device))
    deadline = a.deadline or time.time() + profile.total_s
    if name == "gpu" and not cuda:  # the gpu sizes on a CPU would run for hours: refuse, said on every step
        for step in [s for s in a.steps.split(",") if s and not report.done(s)]:
            report.begin(step, step, 0.0)
            report.end(step, "failed", f"the gpu profile needs a CUDA device; torch {torch.__version__} sees none")
        return 0
    for step in [s for s in a.steps.split(",") if s]:
        if report.done(step):
            continue
        budget = min(profile.budgets[step] * a.budget_scale, deadline - time.time() - 2.0)
        if budget < 3.0:
            report.begin(step, step, 0.0)
            report.end(step, "skipped", "no time left in the run")
            continue
        module = _step_module(step)
        report.begin(step, module.TITLE, budget)
        ctx = Ctx(report, profile, device, step, time.time() + budget)
        print(f"gpu-check: {step} ({module.TITLE}), budget {budget:.0f} s", flush=True)
        cpu0 = _cpu_s()
        try:
            module.run(ctx)
        except BaseException as e:  # noqa: BLE001 - any failure is the step's result
            traceback.print_exc()
            report.end(step, "failed", one_line(e))
            if device.type == "cuda" or isinstance(e, KeyboardInterrupt):
                return CUDA_FAILED
            continue
        report.step(step)["cpu_s"] = round(_cpu_s() - cpu0, 1)  # host time: this process and its ranks
        report.end(step)
        s = report.step(step)
        print(f"gpu-check: {step}: {s['status']} in {s['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
