"""`ditsp bench rl-spot`: time and modelled cost to a target reward, with and without seed exploration.

Four runs of ``ditsp rl`` on the seeded tiny Wan, the same settings and seeds (smoothness reward, held-out
prompts evaluated after every step with the deterministic sampler, ``--deterministic``):

- **none**: the default seeds; the trainer samples its rollouts;
- **fresh**: the trainer scores ``--candidates`` seeds per prompt with the step's weights before its
  rollouts and keeps the highest-contrast ones (exploration on the critical path);
- **stale**: two spot workers score the next step's candidates with the previous weights while the trainer
  updates (as many as fit in an update's time: the time model), and sample the rollouts (the premise
  audited: every step's candidates scored again with the fresh weights);
- **preempted**: the same under a preemption trace (SIGTERM with a grace period, then SIGKILL; workers
  leave and join mid-run).

The target is the held-out reward the run without exploration ends at. Time is the run's modelled time
(:mod:`ditsp.rl.timeline`: every part as long as the CPU seconds it measured, as if the trainer and each spot
worker had a device of its own; the shared cores of this machine make the wall clock a measure of
contention, so it is reported beside it); cost is that time at the on-demand price for the trainer and
the spot fraction for the spot workers it held on average (:mod:`ditsp.rl.cost`). Every request of the spot
runs is checked finished exactly once and every final checkpoint against the run's last weights.

Results go to ``benchmarks/results/rl-spot.md`` and ``rl-spot.png``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from dataclasses import replace

RESULTS = os.path.join("benchmarks", "results", "rl-spot.md")
SETTINGS = ("none", "fresh", "stale", "preempted")
# Spot workers of the fourth run: two at the start; one preempted, a third joining, the other preempted, the
# first back. Times in seconds of the run (the workers' start-up, tens of seconds on a busy machine, counts).
TRACE = """# the preempted setting of ditsp bench rl-spot
0   join  spot0
0   join  spot1
12  leave spot0  1.0
20  join  spot2
35  leave spot1  1.0
40  join  spot0
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("rl-spot", help="time and modelled cost to a target reward: no exploration, exploration "
                                       "on the critical path, on spot workers, under preemptions",
                       description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16, help="GRPO steps of each run")
    p.add_argument("--candidates", type=int, default=8, help="the fresh run's candidate seeds per prompt on average (the spot runs take what fits in an update)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--trace", help="the preempted run's trace file (default: the built-in one, in the results)")
    p.add_argument("--out", default=RESULTS, help="markdown file to write ('' for none); the plot goes beside it")
    p.set_defaults(func=main)
    return p


def _config(out: str, steps: int):
    from ..rl.loop import RLConfig

    return RLConfig(out=out, steps=steps, random_weights=True, random_prompts=8, holdout=2, reward="smoothness",
                    prompts_per_step=2, group_size=4, sample_steps=4, window=(0, 3), frames=5, size=(16, 32),
                    lr=3e-2, eval_every=1, eval_seeds=2, checkpoint_every=4, progress=False, deterministic=True)


def run(settings, steps: int, candidates: int, trace: str | None) -> dict:
    import torch

    from ..rl.spot_config import SpotConfig
    from ..rl.spot_run import SpotRun

    torch.set_num_threads(1)
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}")
    reports = {}
    with tempfile.TemporaryDirectory(prefix="ditsp-bench-rl-spot-") as tmp:
        trace_path = trace or os.path.join(tmp, "trace.txt")
        if not trace:
            with open(trace_path, "w") as f:
                f.write(TRACE)
        base = SpotConfig(workers=2)  # the spot runs' budgets: what fits in an update (the time model)
        spots = {"none": replace(base, explore="none"),
                 "fresh": replace(base, explore="fresh", candidates=candidates),
                 "stale": replace(base, explore="stale", audit=True),
                 "preempted": replace(base, explore="stale", trace=trace_path)}
        for name in settings:
            t0 = time.monotonic()
            run = SpotRun(_config(os.path.join(tmp, name), steps), spots[name])
            rep = run.execute()
            rep["history"] = run.run.history
            rep["bench_s"] = time.monotonic() - t0
            reports[name] = rep
            print(f"{name}: {rep['bench_s']:.0f} s, held-out {rep['eval_before']:.4f} -> {rep['eval_after']:.4f}",
                  flush=True)
        trace_text = open(trace_path).read()
    return {"steps": steps, "candidates": candidates, "reports": reports, "trace": trace_text,
            "load": os.getloadavg()[0], "date": datetime.date.today().isoformat()}


def summarize(r: dict) -> list[dict]:
    """Per setting: steps, modelled time and cost to the target, and the run's checks."""
    reports = r["reports"]
    first = reports.get("none") or next(iter(reports.values()))
    target = first["eval"][-1]["reward"]
    rows = []
    for name, rep in reports.items():
        modelled = [rep["modelled_s"][k] for k in sorted(rep["modelled_s"], key=int)]
        hit = next((e["step"] for e in rep["eval"] if e["reward"] >= target), None)
        cost = rep["cost"]
        spot_held = rep["cost_in_run"]["spot_s"] / rep["wall_s"] if rep["wall_s"] else 0.0
        per_s = 1.0 + cost["spot_fraction"] * spot_held  # on-demand device-seconds per modelled second
        to_target = sum(modelled[:hit]) if hit is not None else None
        spot = rep.get("spot") or {}
        req = spot.get("requests")
        rows.append({
            "setting": name, "target": target, "steps_to_target": hit,
            "time_to_target_s": to_target, "cost_to_target": to_target * per_s if to_target is not None else None,
            "modelled_s": sum(modelled), "wall_s": rep["wall_s"], "spot_held": spot_held,
            "candidates": (sum(sum(v) for v in rep["splits"].values()) / sum(len(v) for v in rep["splits"].values())
                           if rep["splits"] else None),
            "eval_before": rep["eval_before"], "eval_after": rep["eval_after"],
            "exactly_once": (req["finished"] == req["requests"] and req["units_kept"] == req["units"]) if req else None,
            "requests": req, "wasted_cpu_s": spot.get("wasted_cpu_s"), "checkpoint": rep["checkpoint_consistent"],
            "premise": rep.get("premise"), "events": spot.get("events", []),
            "curve": [(e["step"], e["reward"]) for e in rep["eval"]],
            "time_axis": [0.0] + [sum(modelled[:k + 1]) for k in range(len(modelled))],
        })
    return rows


def _num(v, fmt: str) -> str:
    return "not reached" if v is None else format(v, fmt)


def format_md(r: dict, rows: list[dict], plot_name: str | None) -> str:
    none = next((x for x in rows if x["setting"] == "none"), rows[0])
    lines = [
        "# Seed exploration on spot workers: time and cost to a target reward",
        "",
        f"`ditsp bench rl-spot --steps {r['steps']} --candidates {r['candidates']}` on {platform.machine()}, "
        f"{os.cpu_count()} CPU(s), {r['date']}; load average at the end {r['load']:.1f} (other jobs shared the "
        "cores). The seeded tiny Wan (2 layers, 4 heads x 16) and VAE, smoothness reward, 2 prompts x 4 "
        "rollouts per step, 4 sampler steps (SDE 0:3), 5 frames of 32x16, AdamW lr 3e-2, PPO clip 1e-4, "
        "`--deterministic`; 2 held-out prompts x 2 seeds with the deterministic sampler after every step.",
        "",
        f"Target: the held-out reward the run without exploration ends at, {none['target']:.5f} (from "
        f"{none['eval_before']:.5f}). Time is modelled: each part as long as the CPU seconds it measured, as if "
        "the trainer and each spot worker had a device of its own (`ditsp/rl/timeline.py`); cost is that time "
        "at the on-demand price for the trainer plus 0.3x for each spot worker held on average (spot price "
        "assumed, `ditsp/rl/cost.py`), in on-demand device-seconds. Wall is the measured run on this shared "
        "machine (contention, and the spot workers' start-up, not overlap).",
        "",
        "| setting | candidates / prompt | steps to target | modelled time to target (s) | cost to target "
        "(device-s) | final held-out | modelled run (s) | wall run (s) | spot workers held | requests finished "
        "once | units returned | CPU s wasted | checkpoint |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for x in rows:
        req = x["requests"]
        once = (f"yes ({req['finished']}/{req['requests']}, {req['units_kept']}/{req['units']} units)"
                if x["exactly_once"] else ("NO" if req else "-"))
        lines.append(
            f"| {x['setting']} | {format(x['candidates'], '.1f') if x['candidates'] else '-'} | "
            f"{_num(x['steps_to_target'], 'd')} | {_num(x['time_to_target_s'], '.2f')} | "
            f"{_num(x['cost_to_target'], '.2f')} | {x['eval_after']:.5f} | {x['modelled_s']:.2f} | {x['wall_s']:.0f} | "
            f"{x['spot_held']:.2f} | {once} | {req['returned_units'] if req else '-'} | "
            f"{_num(x['wasted_cpu_s'], '.2f') if req else '-'} | {'consistent' if x['checkpoint'] else 'INCONSISTENT'} |")
    audited = next((x for x in rows if x.get("premise")), None)
    premise = audited["premise"] if audited else None
    if premise and premise["mean"] is not None:
        lines += ["", f"**The premise, measured** (stale run): Spearman's rank correlation between the candidates' "
                      f"rewards under the previous step's weights (what chose the seeds) and under the step's own "
                      f"weights, per prompt and step: mean {premise['mean']:.3f}, median {premise['median']:.3f} "
                      f"over {premise['measured']} (prompt, step) pairs of {audited['candidates']:.1f} candidates "
                      f"on average."]
    pre = next((x for x in rows if x["setting"] == "preempted"), None)
    if pre is not None:
        kinds = {}
        for e in pre["events"]:
            kinds[e["event"]] = kinds.get(e["event"], 0) + 1
        lines += ["", "The preempted run's trace, and what happened (" + ", ".join(f"{v} {k}" for k, v in
                                                                              sorted(kinds.items())) + "):", "",
                  "```", r["trace"].strip(), "```"]
    if plot_name:
        lines += ["", f"![held-out reward against step and modelled time]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for x in rows:
        steps = [s for s, _ in x["curve"]]
        rewards = [v for _, v in x["curve"]]
        a.plot(steps, rewards, "o-", ms=3, lw=1.2, label=x["setting"])
        b.plot([x["time_axis"][s - steps[0]] for s in steps], rewards, "o-", ms=3, lw=1.2, label=x["setting"])
    for ax in (a, b):
        ax.axhline(rows[0]["target"], color="grey", lw=0.8, ls="--")
        ax.set_ylabel("held-out reward (smoothness)")
    a.set_xlabel("step"), b.set_xlabel("modelled time (s)")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    r = run(settings, args.steps, args.candidates, args.trace)
    rows = summarize(r)
    plot_name = None
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        png = os.path.splitext(args.out)[0] + ".png"
        plot(rows, png)
        plot_name = os.path.basename(png)
    text = format_md(r, rows, plot_name)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 0
