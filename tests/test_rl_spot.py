"""Seed exploration end to end (ditsp.rl.spot_run), at tiny sizes under --deterministic.

Issue 48's check: a run whose spot workers are preempted mid-request (a trace) finishes every request
exactly once and makes the same training updates, bit for bit, as a run without preemptions, and both as
the trainer sampling the same chosen seeds itself. Also: fresh exploration keeps the highest-contrast
candidates by their rewards under the step's own weights, and the command runs it."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from ditsp.cli import main
from ditsp.rl.explore import candidate_seeds, contrast_choice
from ditsp.rl.loop import RLConfig, Run
from ditsp.rl.policy import sample
from ditsp.rl.published import digest
from ditsp.rl.spot_config import SpotConfig
from ditsp.rl.spot_run import SpotRun
from ditsp.rl.work import SpotTask

pytestmark = [pytest.mark.timeout(900), pytest.mark.ranks]  # spot workers are processes


def _cfg(out, **kw) -> RLConfig:
    base = dict(out=str(out), steps=3, random_weights=True, random_prompts=5, holdout=1, reward="brightness",
                prompts_per_step=2, group_size=2, sample_steps=3, window=(0, 2), frames=5, size=(16, 32), lr=1e-2,
                eval_every=1, checkpoint_every=1, progress=False, deterministic=True)
    return RLConfig(**{**base, **kw})


class HeldOnSpot0(SpotTask):
    """The run's task, except that on worker spot0 a unit never ends by itself: only its preemption ends it,
    so the trace's leave finds it mid-request whatever the machine's speed."""

    def run(self, ctx, request, seed):
        if os.environ["DITSP_RL_WORKER"] == "spot0":
            time.sleep(600)
        return super().run(ctx, request, seed)


def _training(report) -> list:
    """What the updates did, step by step, without the timings."""
    return [{k: v for k, v in h.items() if not k.endswith("_s")} for h in report["history"]]


def test_a_preempted_run_finishes_every_request_once_and_trains_as_a_steady_one(tmp_path):
    spot = SpotConfig(explore="stale", candidates=3, workers=2)
    steady = SpotRun(_cfg(tmp_path / "steady"), spot)
    a = steady.execute()
    a["history"] = steady.run.history

    trace = tmp_path / "trace.txt"  # spot0 holds its first unit until preempted
    trace.write_text("0 join spot0\n0 join spot1\n3 leave spot0 0.5\n")
    held = SpotRun(_cfg(tmp_path / "preempted"), replace(spot, trace=str(trace)), task_type=HeldOnSpot0)
    b = held.execute()
    b["history"] = held.run.history

    req = b["spot"]["requests"]
    assert req["finished"] == req["requests"] and req["units_kept"] == req["units"], req
    assert req["returned"] >= 1 and req["returned_units"] >= 1, req  # the preemption returned work ...
    leave = next(e for e in b["spot"]["events"] if e["event"] == "leave")
    assert leave["busy"], b["spot"]["events"]  # ... taken from spot0 mid-request
    assert a["spot"]["requests"]["returned"] == 0
    assert b["chosen"] == a["chosen"]
    assert b["digests"] == a["digests"]  # every step's weights, bit for bit
    assert _training(b) == _training(a)
    assert a["checkpoint_consistent"] and b["checkpoint_consistent"]

    # the trainer sampling the same chosen seeds itself makes the same updates: spot rollouts are its own
    digests = {}
    own = Run(_cfg(tmp_path / "own"), choose_seeds=lambda r: a["chosen"][f"{r.step}/{r.prompt}"],
              after_step=lambda step, policy, stats: digests.update({step + 1: digest(policy.weights())}))
    own.run()
    assert digests == {k: v for k, v in a["digests"].items() if k > 0}
    assert _training({"history": own.history}) == _training(a)


def test_fresh_exploration_keeps_the_highest_contrast_seeds_under_the_current_weights(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    run = SpotRun(cfg, SpotConfig(explore="fresh", candidates=4, planner="uniform"))
    probe = Run(cfg)  # the same initial weights: score the candidates independently
    report = run.execute()
    for key, seeds in report["chosen"].items():
        step, p = map(int, key.split("/"))
        order = candidate_seeds(cfg.seed, step, p, 4)
        rewards = {s: sample(probe.policy, probe.train_prompts[p:p + 1], s, probe.sampler, prompt=p,
                             reward=cfg.reward, decode=False).reward for s in order}
        assert seeds == contrast_choice(rewards, order, 2)
    assert report["budgets"] == {0: 8} and report["splits"] == {0: [4, 4]}
    assert report["cost"]["spot_s"] == 0 and report["checkpoint_consistent"]


def test_the_command_runs_stale_exploration_and_reports_it(tmp_path, capsys):
    rc = main(["rl", "--random-weights", "--random-prompts", "5", "--holdout", "1", "--steps", "2",
               "--group-size", "2", "--sample-steps", "3", "--sde-window", "0:2", "--size", "32x16",
               "--reward", "brightness", "--explore", "stale", "--candidates", "3", "--spot-workers", "1",
               "--audit-premise", "--deterministic", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    line = out.strip().splitlines()[-1]
    assert line.startswith("explore stale (bandit); spot: ")
    assert "units kept once" in line and "Spearman" in line and "checkpoint consistent" in line
    assert (tmp_path / "explore.json").exists() and (tmp_path / "reward.png").exists()
