"""A run with seed exploration: the core loop (:class:`~ditsp.rl.loop.Run`) with its seed chooser, its
after-step hook and, with spot workers, its rollouts wired to the planner, the queue and the spot pool.

With ``--explore stale`` a step ``k`` goes:

1. the trainer waits for step ``k``'s exploration (submitted while step ``k - 1`` trained, scored with the
   weights step ``k - 1`` sampled with) and keeps each prompt's highest-contrast seeds
   (:func:`~ditsp.rl.explore.contrast_choice`); the planner learns the prompts' seed spread from the scores;
2. the rollouts of the chosen seeds go to the queue as rollout requests (version ``k``: this step's weights)
   and the spot groups sample them; the trainer only waits;
3. the trainer updates. Meanwhile the spot groups score the candidates of step ``k + 1`` (submitted after
   step ``k - 1``'s update, with its weights: one update stale), the planner having split the budget that
   fits in an update's time (the time model: spot groups x the last update's seconds / a unit's seconds);
4. after the update the trainer publishes version ``k + 1`` (:mod:`.published`) and submits step ``k + 2``'s
   exploration.

The very first step's candidates are scored with the initial weights before it starts (nothing older
exists). ``--explore fresh`` scores each step's candidates on the trainer, with the step's own weights,
before its rollouts: the same choice, on the critical path. Every request is accounted for at the end (the
queue's audit), the cost of the run is its ledger's (:mod:`.cost`), its modelled time the timeline's
(:mod:`.timeline`), and with ``audit`` each step's candidates are also scored with the fresh weights, so the
premise (stale scores rank seeds as fresh ones do) is measured: Spearman's correlation per prompt and step.

Spot workers are children of the trainer's process, so a run with them trains at SP 1 (their own groups
take ``spot_sp``). The planner starts afresh on ``--resume``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..train import checkpoint as ckpt
from .bandit import SeedPlanner
from .cost import CostLedger, Prices
from .explore import candidate_seeds, contrast_choice, spearman
from .leases import Request, RequestQueue
from .loop import RLConfig, Run, SeedRequest, step_prompts
from .policy import sample
from .published import Published, digest
from .scheduler import SpotPool
from .spot_config import SpotConfig
from .timeline import modelled_steps, request_id
from .trace import load as load_trace
from .trace import steady
from .work import SpotTask

MAX_PER_PROMPT = 4  # the time model's budget: at most this many times the group per prompt


class SpotRun:
    """One run (see the module doc). ``task_type(cfg, weights_folder, prompts)`` is what spot workers run."""

    def __init__(self, cfg: RLConfig, spot: SpotConfig, group=None, task_type=SpotTask):
        spot.check(cfg.group_size, cfg.sp)
        self.cfg, self.spot = cfg, spot
        self.stale = spot.explore == "stale"
        self.trace = (load_trace(spot.trace) if spot.trace else steady(spot.workers)) if self.stale else None
        self.run = Run(cfg, group, choose_seeds=self._choose, after_step=self._after_step,
                       sample_rollouts=self._spot_rollouts if self.stale else None)
        self.planner = SeedPlanner(cfg.group_size, spot.planner)
        self.ledger = CostLedger(Prices(spot.spot_fraction))
        self.queue = self.pool = self.published = None
        self.chosen: dict[tuple[int, int], list[int]] = {}
        self.scores: dict[tuple[int, int], dict[int, float]] = {}  # exploration's rewards per (step, prompt)
        self.explored: dict[int, dict] = {}  # step -> its exploration: prompts, split, version
        self.steps: dict[int, dict] = {}  # step -> timings (trainer CPU, wall, waits)
        self.digests: dict[int, str] = {}  # version -> digest of the weights steps of that version sample with
        self._audits: list[tuple[int, int, str]] = []
        if self.stale:
            self.queue = RequestQueue()
            self.published = Published(keep_all=spot.audit)
            task = task_type(cfg, self.published.folder, self.run.train_prompts)
            self.pool = SpotPool(task, self.trace, self.queue, spot.spot_sp, self.ledger, timeout_s=spot.timeout_s)

    # -- the run --------------------------------------------------------------------

    def execute(self) -> dict:
        run, cfg = self.run, self.cfg
        if cfg.resume:
            run.restore()  # the step to start from, before the first exploration (run() restores it again)
        start = run.step
        self.digests[start] = digest(run.policy.weights())
        try:
            if self.stale:
                self.published.publish(start, run.policy.weights())
                self.pool.start()
                self._explore(start, start)  # nothing older exists: the initial weights, waited on
                if start + 1 < cfg.steps:
                    self._explore(start + 1, start)
            t0 = time.monotonic()
            self.ledger.join("trainer", "reserved", t0)
            report = run.run()
            if self.stale and self._audits:
                self.queue.wait([rid for _, _, rid in self._audits], self.spot.timeout_s, self.pool.check)
            end = time.monotonic()
            self.ledger.leave("trainer", end)
        finally:
            if self.pool is not None:
                self.pool.close()
            if self.published is not None:
                self.published.close()
        return self._report(report, start, end - t0, end)

    # -- hooks of the core loop -----------------------------------------------------

    def _choose(self, req: SeedRequest) -> list[int]:
        if req.step not in self.steps:
            self._begin(req.step)
        return self.chosen[(req.step, req.prompt)]

    def _begin(self, step: int) -> None:
        """The step's seeds, for every prompt at once: waited for (stale), explored now (fresh) or the default."""
        info = self.steps[step] = {"cpu0": time.process_time(), "wall0": time.monotonic()}
        prompts = self._prompts(step)
        n = self.cfg.group_size
        if self.spot.explore == "none":
            for p in prompts:
                self.chosen[(step, p)] = list(candidate_seeds(self.cfg.seed, step, p, n))
            return
        if self.spot.explore == "fresh":
            self._explore_here(step)
        else:
            ids = [request_id(step, "explore", p) for p in prompts]
            self.queue.wait(ids, self.spot.timeout_s, self.pool.check)
            for p, rid in zip(prompts, ids):
                self.scores[(step, p)] = {s: r["reward"] for s, r in self.queue.results(rid).items()}
        info["explore_wait_s"] = time.monotonic() - info["wall0"]
        for p, m in zip(prompts, self.explored[step]["split"]):
            order = candidate_seeds(self.cfg.seed, step, p, m)
            scores = self.scores[(step, p)]
            self.planner.observe(p, [scores[s] for s in order])
            self.chosen[(step, p)] = contrast_choice(scores, order, n)

    def _spot_rollouts(self, step: int, chosen: list) -> list:
        t0 = time.monotonic()
        ids = []
        for p, seeds in chosen:
            ids.append(request_id(step, "rollout", p))
            self.queue.submit(Request(ids[-1], "rollout", step, p, tuple(seeds), keep=True))
        self.queue.wait(ids, self.spot.timeout_s, self.pool.check)
        self.steps[step]["rollout_wait_s"] = time.monotonic() - t0
        return [self.queue.results(rid)[s]["rollout"] for (p, seeds), rid in zip(chosen, ids) for s in seeds]

    def _after_step(self, step: int, policy, stats) -> None:
        info = self.steps[step]
        info["cpu_s"] = time.process_time() - info.pop("cpu0")
        info["wall_s"] = time.monotonic() - info.pop("wall0")
        weights = policy.weights()
        if not self.stale:
            self.digests[step + 1] = digest(weights)
            return
        self.digests[step + 1] = self.published.publish(step + 1, weights)
        if step + 2 < self.cfg.steps:
            self._explore(step + 2, step + 1)
        if self.spot.audit and step + 1 < self.cfg.steps:
            self._audit(step + 1, step + 1)

    # -- exploration ----------------------------------------------------------------

    def _prompts(self, step: int) -> list[int]:
        return step_prompts(self.cfg.seed, step, self.cfg.prompts_per_step, self.run.train_prompts.shape[0])

    def _plan(self, step: int, version: int) -> list[tuple[int, tuple[int, ...]]]:
        prompts = self._prompts(step)
        budget = self._budget(len(prompts))
        split = self.planner.plan(prompts, budget)
        self.explored[step] = {"prompts": prompts, "split": split, "budget": budget, "version": version}
        return [(p, candidate_seeds(self.cfg.seed, step, p, m)) for p, m in zip(prompts, split)]

    def _explore(self, step: int, version: int) -> None:
        """Submit step ``step``'s candidates, scored with weights ``version``, to the spot workers."""
        for p, seeds in self._plan(step, version):
            self.queue.submit(Request(request_id(step, "explore", p), "explore", version, p, seeds))

    def _explore_here(self, step: int) -> None:
        """Score step ``step``'s candidates on the trainer, with its current weights (every rank alike)."""
        run = self.run
        for p, seeds in self._plan(step, step):
            self.scores[(step, p)] = {
                s: sample(run.policy, run.train_prompts[p:p + 1], s, run.sampler, prompt=p, reward=self.cfg.reward,
                          decode=False).reward for s in seeds}

    def _audit(self, step: int, version: int) -> None:
        """Score step ``step``'s candidates again with weights ``version`` (fresh): the premise's measurement."""
        info = self.explored[step]
        for p, m in zip(info["prompts"], info["split"]):
            rid = request_id(step, "audit", p)
            self.queue.submit(Request(rid, "audit", version, p, candidate_seeds(self.cfg.seed, step, p, m)))
            self._audits.append((step, p, rid))

    def _budget(self, prompts: int) -> int:
        """Candidates for a step of ``prompts`` prompts: the configured average, else (stale) what the spot
        groups score in one update's time, between the rollouts alone and :data:`MAX_PER_PROMPT` x them. Times
        are CPU seconds (the trainer's last step, a unit's median), so the budget fits on devices of their
        own, as the run's timeline models them, however busy the machine."""
        n = self.cfg.group_size
        if self.spot.candidates:
            return self.spot.candidates * prompts
        if not self.stale:
            return 2 * n * prompts
        units = [u.cpu_s for u in list(self.pool.units)[-16:] if u.seed is not None]
        done = [k for k, v in self.steps.items() if "cpu_s" in v]
        if not units or not done:
            return 2 * n * prompts
        update_s = self.steps[max(done)]["cpu_s"]  # the trainer's CPU seconds of a step: its update
        groups = max(1, self.pool.live() // self.spot.spot_sp)
        fit = int(groups * update_s / statistics.median(units))
        return max(n * prompts, min(fit, MAX_PER_PROMPT * n * prompts))

    # -- the report -----------------------------------------------------------------

    def premise(self) -> dict:
        """Spearman's rank correlation of the candidates' rewards under stale and fresh weights, per prompt and
        step (only with ``audit``)."""
        rows = []
        for step, p, rid in self._audits:
            stale = self.scores.get((step, p))
            if stale is None:
                continue
            fresh = {s: r["reward"] for s, r in self.queue.results(rid).items()}
            order = sorted(stale)
            rho = spearman([stale[s] for s in order], [fresh[s] for s in order])
            rows.append({"step": step, "prompt": p, "candidates": len(order), "spearman": rho})
        valid = [r["spearman"] for r in rows if r["spearman"] is not None]
        return {"pairs": rows, "measured": len(valid), "mean": statistics.fmean(valid) if valid else None,
                "median": statistics.median(valid) if valid else None}

    def _checkpoint_digest(self) -> str | None:
        path = Path(self.cfg.out) / "checkpoint.pt"
        if not path.exists():
            return None
        state = torch.load(path, map_location="cpu", weights_only=False)["modules"]["transformer"]
        params = dict(self.run.policy.transformer.named_parameters())
        return digest({k: v for k, v in state.items() if k in params})

    def _report(self, report: dict, start: int, wall_s: float, end: float) -> dict:
        cfg, spot = self.cfg, self.spot
        cpu = {k: self.steps[k]["cpu_s"] for k in range(start, cfg.steps)}
        units = list(self.pool.units) if self.pool else []
        modelled = modelled_steps(spot.explore, cpu, units, start, cfg.steps)
        out = {
            **report, "explore": spot.explore, "planner": spot.planner, "candidates": spot.candidates,
            "budgets": {k: v["budget"] for k, v in self.explored.items()},
            "splits": {k: v["split"] for k, v in self.explored.items()},
            "chosen": {f"{s}/{p}": seeds for (s, p), seeds in self.chosen.items()},
            "steps_timing": {k: {x: round(v, 4) for x, v in self.steps[k].items()} for k in sorted(self.steps)},
            "modelled_s": {k: round(v, 4) for k, v in modelled.items()},
            "wall_s": round(wall_s, 3), "cost": self.ledger.report(end),
            "cost_in_run": self.ledger.report(end, since=end - wall_s),  # spot start-up before the run left out
            "digests": self.digests, "checkpoint_digest": self._checkpoint_digest(),
        }
        out["checkpoint_consistent"] = out["checkpoint_digest"] == self.digests.get(cfg.steps)
        if self.stale:
            out["spot"] = {"trace": self.trace.source, "spot_sp": spot.spot_sp, "requests": self.queue.audit(),
                           "events": self.pool.events, "units": len([u for u in units if u.seed is not None]),
                           "wasted_cpu_s": round(sum(u.cpu_s for u in units if u.seed is None), 4)}
            out["premise"] = self.premise() if spot.audit else None
        if self.run.rank0:
            path = Path(cfg.out) / "explore.json"
            ckpt.atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=1, default=str)))
        return out


def rank_spot_run(ctx, cfg: RLConfig, spot: SpotConfig) -> dict:
    """Rank function (LocalCluster or torchrun) of a run without spot workers (``none``, ``fresh``)."""
    torch.set_num_threads(1)
    return SpotRun(cfg, spot, ctx.group if ctx.world_size > 1 else None).execute()


def explore_line(report: dict) -> str:
    """One line for the command: exploration, spot requests, wasted work, the premise and the cost."""
    parts = [f"explore {report['explore']} ({report['planner']})"]
    spot = report.get("spot")
    if spot:
        r = spot["requests"]
        parts.append(f"spot: {r['finished']}/{r['requests']} requests finished, {r['units_kept']}/{r['units']} "
                     f"units kept once, {r['returned_units']} returned by preemptions, "
                     f"{spot['wasted_cpu_s']:.2f} CPU s wasted")
    premise = report.get("premise")
    if premise and premise["mean"] is not None:
        parts.append(f"stale-vs-fresh seed ranking: Spearman {premise['mean']:.3f} mean over {premise['measured']}")
    c = report["cost"]
    parts.append(f"cost {c['cost_device_hours']:.4g} on-demand device-hours ({c['reserved_s']:.0f} s reserved, "
                 f"{c['spot_s']:.0f} s spot at {c['spot_fraction']:g}x, assumed)")
    parts.append(f"checkpoint {'consistent' if report['checkpoint_consistent'] else 'INCONSISTENT'}")
    return "; ".join(parts)
