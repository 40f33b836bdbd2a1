"""The whole job: ``ditsp upscale`` end to end at each SP degree, stage by stage, side by side.

A held-out clip (``ditsp.train.heldout``: a panned crop of a photograph the small restorer never saw,
degraded by the training chain) is restored by the ``ditsp upscale`` command line itself, one fresh
process per run, as a user runs it: start-up, spawning the ranks, loading the weights and every
stage are in the wall time. Per run: wall seconds (measured here) and where they go (start-up,
weights, restoration, finish), CPU seconds of every process (this process's children, ranks
included), each stage's wall seconds (rank 0's report) and CPU seconds (the slowest rank's), and
each rank's whole-process CPU seconds. Runs of the SP degrees
alternate, ``--repeats`` rounds with the order rotated; the table shows each figure's minimum over
the rounds. Every degree must write the same frames under ``--deterministic`` (checked; the default
fast policy is compared by PSNR). Results: ``benchmarks/results/job.md`` and ``job.json``.

The machine's own ceiling, side by side: each round also runs N one-device jobs at once (N the largest
degree), each a separate process with no communication at all. Their wall, per job and over N, against
one job alone is the best an SP=N run can reach on this machine (cores that share caches, memory
bandwidth and a hypervisor slow each other down with no help from the code), so the table says how
much of the gap to 1/N is the machine's and how much the parallel path's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..argtypes import positive_int, positive_int_list
from ..models.seedvr2.presets import TRAINED
from . import declare

STAGES = ("read", "vae_encode", "dit", "vae_decode", "color_fix", "write")
# Where the wall time goes, in order: launch to the last rank running the job (interpreter, imports,
# spawning ranks, the group), the weights' load, the restoration (the stages and what lies between
# them), and the ranks' results back and the process's exit.
PHASES = ("start", "weights", "restore", "finish")
PHASE_LABELS = {"start": "start: launch to every rank running (imports, spawn, group)",
                "weights": "weights load", "restore": "restoration (stages and between)",
                "finish": "finish: results back, exit"}
_CLI = "from ditsp.cli import run; run()"  # as the `ditsp` program does


def _upscale(argv: list[str], timeout_s: float) -> tuple[dict, float, float]:
    """One ``ditsp upscale ... --json`` in a fresh process: (report, wall s, CPU s of it and its ranks)."""
    return _upscale_at_once([argv], timeout_s)[0]


def _upscale_at_once(argvs: list[list[str]], timeout_s: float) -> list[tuple[dict, float, float]]:
    """``ditsp upscale ... --json`` for each of ``argvs``, all started together, each in a fresh process:
    per process (report, wall s to its own exit, CPU s of it and its ranks). A process past ``timeout_s``
    is killed with the rest and raises; one that fails raises with its last line."""
    from ..cpu import malloc as cpu_malloc

    env = dict(os.environ, **cpu_malloc.rank_environment())  # each run starts under the allocator policy
    with tempfile.TemporaryDirectory(prefix="ditsp-bench-run-") as logs:
        procs, t0, launched = [], time.perf_counter(), time.time()
        try:
            for i, argv in enumerate(argvs):
                with open(os.path.join(logs, f"{i}.out"), "w") as out, open(os.path.join(logs, f"{i}.err"), "w") as err:
                    procs.append(subprocess.Popen([sys.executable, "-c", _CLI, "upscale", *argv, "--json"],
                                                  stdout=out, stderr=err, text=True, env=env))
            ended: dict[int, tuple[int, float, float]] = {}
            while len(ended) < len(procs):
                for i, proc in enumerate(procs):
                    if i in ended:
                        continue
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                    if pid:
                        proc.returncode = os.waitstatus_to_exitcode(status)
                        ended[i] = (proc.returncode, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime)
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"ditsp upscale ran past --timeout {timeout_s:g} s")
                time.sleep(0.01)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    proc.wait()
        results = []
        for i, argv in enumerate(argvs):
            code, wall, cpu = ended[i]
            stdout = Path(logs, f"{i}.out").read_text()
            if code != 0:
                tail = (Path(logs, f"{i}.err").read_text() or stdout).strip().splitlines()
                raise RuntimeError(f"ditsp upscale {' '.join(argv)} failed: {tail[-1] if tail else code}")
            report = json.loads(stdout[stdout.index("{"):])
            report["launched_at"] = launched
            results.append((report, wall, cpu))
        return results


def _figures(report: dict, wall: float, cpu: float) -> dict:
    times = report["rank_times"]
    entered = max(t["entered_at"] for t in times)  # the last rank in: the group's start
    ready = max(t["entered_at"] + t["load_s"] for t in times)
    done = max(t["done_at"] for t in times)
    return {
        "wall_s": wall, "cpu_all_s": cpu,
        "phases_s": {"start": entered - report["launched_at"], "weights": ready - entered,
                     "restore": done - ready, "finish": wall - (done - report["launched_at"])},
        "stage_s": report["stage_s"],
        "stage_cpu_max_rank_s": {k: max(r[k] for r in report["rank_stage_cpu_s"]) for k in STAGES},
        "rank_cpu_s": report["rank_cpu_s"],
        "sha256": report["sha256"],
    }


def _min_rounds(rounds: list[dict]) -> dict:
    """The wall and per-stage figures' minimum over the rounds (stages separately)."""
    return {"wall_s": min(r["wall_s"] for r in rounds),
            "stage_s": {k: min(r["stage_s"][k] for r in rounds) for k in STAGES},
            "stage_cpu_max_rank_s": {k: min(r["stage_cpu_max_rank_s"][k] for r in rounds) for k in STAGES}}


def _best(runs: list[dict]) -> dict:
    """Each figure's minimum over the rounds (stages separately)."""
    return {
        **_min_rounds(runs), "cpu_all_s": min(r["cpu_all_s"] for r in runs),
        "phases_s": {k: min(r["phases_s"][k] for r in runs) for k in PHASES},
        "rank_cpu_max_s": min(max(r["rank_cpu_s"]) for r in runs),
        "sha256": sorted({r["sha256"] for r in runs}),
    }


def format_table(sps: list[int], best: dict[int, dict]) -> list[str]:
    base = best[sps[0]]
    head = "| | " + " | ".join(f"SP={s}" for s in sps) + " | " + " | ".join(f"SP={s} / SP={sps[0]}" for s in sps[1:]) + " |"
    lines = [head, "| --- |" + " ---: |" * (2 * len(sps) - 1)]

    def row(label: str, get) -> None:
        vals = [get(best[s]) for s in sps]
        ratios = [f"{v / get(base):.2f}" if get(base) > 0 else "" for v in vals[1:]]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in vals) + " | " + " | ".join(ratios) + " |")

    for k in STAGES:
        where = "rank 0's writer thread, behind the next window" if k == "write" else "rank 0 wall"
        row(f"{k} s ({where})", lambda b, k=k: b["stage_s"][k])
    row("stages, sum s (the write overlaps them)", lambda b: sum(b["stage_s"].values()))
    row("stages, CPU s of the slowest rank", lambda b: sum(b["stage_cpu_max_rank_s"].values()))
    for k in PHASES:
        row(f"{PHASE_LABELS[k]} s", lambda b, k=k: b["phases_s"][k])
    row("wall s (start-up, ranks, weights included)", lambda b: b["wall_s"])
    row("CPU s per rank, whole process (max rank)", lambda b: b["rank_cpu_max_s"])
    row("CPU s, all processes", lambda b: b["cpu_all_s"])
    return lines


CEILING_ROWS = (("vae_encode s (rank 0 wall)", lambda b: b["stage_s"]["vae_encode"]),
                ("vae_decode s (rank 0 wall)", lambda b: b["stage_s"]["vae_decode"]),
                ("stages, sum s", lambda b: sum(b["stage_s"].values())),
                ("stages, CPU s of the slowest rank", lambda b: sum(b["stage_cpu_max_rank_s"].values())),
                ("wall s", lambda b: b["wall_s"]))


def format_ceiling(n: int, alone: dict, at_once: dict, measured: dict) -> list[str]:
    """The machine's ceiling for SP=``n`` beside what SP=``n`` reached: ``at_once`` is each figure of ``n``
    one-device jobs run together (the slowest job's), ``alone`` one such job by itself."""
    lines = [f"| | SP=1 alone | {n} x SP=1 at once (slowest) | ceiling: at once / {n} / alone | "
             f"SP={n} / SP=1 | ceiling / measured |", "| --- |" + " ---: |" * 5]
    for label, get in CEILING_ROWS:
        a, both, sp = get(alone), get(at_once), get(measured)
        if a <= 0:
            continue
        ceiling, ratio = both / n / a, sp / a
        lines.append(f"| {label} | {a:.2f} | {both:.2f} | {ceiling:.2f} | {ratio:.2f} | "
                     f"{ceiling / ratio if ratio > 0 else 0:.2f} |")
    return lines


def _slowest(jobs: list[dict]) -> dict:
    """One figure set from jobs run at once: each figure the slowest job's."""
    return {"wall_s": max(j["wall_s"] for j in jobs),
            "stage_s": {k: max(j["stage_s"][k] for j in jobs) for k in STAGES},
            "stage_cpu_max_rank_s": {k: max(j["stage_cpu_max_rank_s"][k] for j in jobs) for k in STAGES}}


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--sp", type=positive_int_list, default=[1, 2], help="SP degrees, side by side (first: baseline)")
    p.add_argument("--frames", type=positive_int, default=33)
    p.add_argument("--size", default="256x256", help="output WxH (the input is half of it, degraded)")
    p.add_argument("--window-frames", type=positive_int, default=17)
    p.add_argument("--overlap", type=int, default=4)
    p.add_argument("--weights", default=str(TRAINED / "tiny"),
                   help="folder with dit.safetensors and vae.safetensors (default: the small restorer's, shipped)")
    p.add_argument("--deterministic", action="store_true", help="fixed-shape kernel calls: every degree writes the same bytes")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=positive_int, default=1, help="threads per rank")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds over the SP degrees, order rotated")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip the N one-device jobs at once that measure the machine's ceiling for SP=N")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "job", "ditsp upscale end to end at each SP degree, stage by stage",
                   __doc__, _arguments, main)


def _allocator() -> str:
    """The CPU allocator policy the runs start under (each is started with its variables)."""
    from ..cpu import malloc as cpu_malloc

    name = cpu_malloc.policy()
    return name + ("" if name == "system" or cpu_malloc.tunables(name) else " (no effect here)")


def main(args=None, parser=None) -> int:
    from ..train import heldout

    if args is None:
        args = _arguments(argparse.ArgumentParser()).parse_args()
    weights = Path(args.weights)
    for name in ("dit.safetensors", "vae.safetensors"):
        if not (weights / name).is_file():
            (parser or argparse.ArgumentParser()).error(f"--weights {weights}: no {name} there")
    sps = list(dict.fromkeys(args.sp))
    runs: dict[int, list[dict]] = {s: [] for s in sps}
    n_ceiling = max(sps) if args.ceiling and sps[0] == 1 and max(sps) > 1 else 0
    at_once: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ditsp-bench-job-") as tmp:
        clip, clean = os.path.join(tmp, "input.mp4"), os.path.join(tmp, "clean")
        heldout.main([clip, clean, "--size", args.size, "--frames", str(args.frames), "--overwrite"])
        common = [clip, "--scale", "2", "--window-frames", str(args.window_frames), "--overlap", str(args.overlap),
                  "--dit", str(weights / "dit.safetensors"), "--vae", str(weights / "vae.safetensors"),
                  "--threads", str(args.threads), "--overwrite", "--no-progress"]
        common += ["--deterministic"] * args.deterministic + ["--compile"] * args.compile
        for r in range(args.repeats):
            for sp in sps[r % len(sps):] + sps[:r % len(sps)]:
                out = os.path.join(tmp, f"out-sp{sp}.mp4")
                report, wall, cpu = _upscale([*common, "-o", out, "--sp", str(sp)], args.timeout)
                runs[sp].append(_figures(report, wall, cpu))
                print(f"SP={sp} round {r + 1}: wall {wall:.1f} s, CPU {cpu:.1f} s (all processes), "
                      f"stages {sum(report['stage_s'].values()):.1f} s", flush=True)
            if n_ceiling:
                jobs = _upscale_at_once([[*common, "-o", os.path.join(tmp, f"out-alone{i}.mp4"), "--sp", "1"]
                                         for i in range(n_ceiling)], args.timeout)
                at_once.append(_slowest([_figures(*job) for job in jobs]))
                print(f"{n_ceiling} x SP=1 at once, round {r + 1}: wall {at_once[-1]['wall_s']:.1f} s (slowest)",
                      flush=True)
    best = {s: _best(runs[s]) for s in sps}
    digests = {d for b in best.values() for d in b["sha256"]}
    same = len(digests) == 1
    if args.deterministic and not same:
        print(f"error: --deterministic runs wrote different frames: {sorted(digests)}", file=sys.stderr)
        return 1
    from .speed import _cpu_capability

    policy = "deterministic (fixed-shape calls)" if args.deterministic else "fast (default)"
    w, h = (int(v) for v in args.size.lower().split("x"))
    head = [f"`ditsp upscale` of a {args.frames}-frame held-out clip, {w // 2}x{h // 2} -> {w}x{h}, small restorer "
            f"({args.weights}), {args.window_frames}-frame windows (overlap {args.overlap}), {args.threads} thread(s) "
            f"per rank, kernel policy {policy}{', --compile' if args.compile else ''}; CPU allocator "
            f"{_allocator()}; CPU capability usage: "
            f"{_cpu_capability()}; {os.cpu_count()} CPU cores; min over {args.repeats} round(s); "
            f"frames {'identical at every degree' if same else 'differ between degrees (fast policy)'} "
            f"(sha256 {', '.join(sorted(d[:16] for d in digests))})", ""]
    table = format_table(sps, best)
    if at_once:
        table += ["", f"The machine's ceiling for SP={n_ceiling}: {n_ceiling} one-device jobs of the same clip at once, "
                  "separate processes with no communication (min over the rounds of the slowest job). "
                  f"The ceiling is what a perfect SP={n_ceiling} would reach here; ceiling / measured is the "
                  "parallel path's efficiency against it (1.00: all of the gap to "
                  f"1/{n_ceiling} is the machine's). Start-up counts as divisible in the wall row, so that "
                  "ceiling is optimistic by it.", "",
                  *format_ceiling(n_ceiling, best[1], _min_rounds(at_once), best[n_ceiling])]
    print("\n".join(head + table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.md").write_text("\n".join(["# The whole job at each SP degree (`ditsp bench job`)", "", *head, *table]) + "\n")
    (out / "job.json").write_text(json.dumps({"args": vars(args) | {"func": None}, "runs": runs, "best": best,
                                              "at_once": at_once}, indent=1, default=str) + "\n")
    print(f"wrote {out / 'job.md'} and job.json")
    return 0
