"""Out-of-memory recovery of a restoration: the leaner plan a failed window runs again under, and the
allocation failures tests inject.

A window's compute (VAE encode, DiT, VAE decode) is one attempt on the job's recoverable group
(:class:`ditsp.distributed.recoverable.RecoverableGroup`): an allocation failure on any rank is known to
every rank at once, memory is released, and :meth:`Recovery.next_plan` gives the plan to retry under,
for the stage that failed:

- a VAE stage: the first exact VAE mode of the table's ``auto`` order (:mod:`..vae.modes`) that the memory
  model says needs less per rank than the mode that failed, for this window and every later one it
  helps; every exact mode gives one device's frames (bitwise under the deterministic kernel policy), so
  the output is that of a run without the failure.
  Then ``tiled``: approximate, flagged in the report. Not under the latent stitch, which continues one
  causal decode from window to window in the mode it began with;
- the DiT (its memory does not depend on the VAE's mode), or a VAE stage with no leaner mode left:
  windows of fewer frames (about half, still kn + 1), the clip restarted from its first frame under that
  plan: the output is that of a run asked for ``--window-frames`` of the new size.

After :data:`MAX_STEPS` failures in one job, or when no leaner plan is left, every rank raises the same
one-line MemoryError naming what would fit (:func:`.budget.suggestions`, held to what the memory model
gave the plan that ran out). Each step goes into the report's ``recovery``: what changed, the rank,
window, stage and error that caused it, and what the output is then.

Tests inject failures with ``DITSP_INJECT_OOM`` (:data:`FAULT_ENV`): ``RANK:WINDOW:STAGE[:TIMES]``,
several separated by commas (window from 1, as reported; stage one of :data:`FAULT_STAGES`; times:
how many of that stage's runs fail, default 1). The failure is raised inside the stage, by the module
at its middle (the DiT's middle block, the VAE encoder's or decoder's middle block), so the rank's
peers are inside the stage's collectives when it happens.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from ....distributed.launcher import error_line
from ....dtypes import DTYPES
from ..presets import vae_config
from ..vae.memory import backend_of, counts_winograd
from ..vae.memory import estimate as vae_estimate
from ..vae.modes import AUTO_ORDER, BY_NAME, FALLBACK
from . import plan as restoration_plan
from .budget import GiB, estimate, suggestions
from .weight_memory import dit_weights

FAULT_ENV = "DITSP_INJECT_OOM"
FAULT_STAGES = ("vae_encode", "dit", "vae_decode")  # the stages of report.STAGES a window's attempt runs
MAX_STEPS = 5  # recovery steps one job may take; the next failure ends it


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: CUDA's (or any device's) out of memory, Python's, or the CPU
    allocator's refusal."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


# -- injected failures (tests) -------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    rank: int
    window: int  # from 1
    stage: str
    times: int = 1


def faults_from_env(environ=None) -> tuple[Fault, ...]:
    """The failures :data:`FAULT_ENV` asks for; ValueError (one line) for a malformed value."""
    raw = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
    out = []
    for item in filter(None, (p.strip() for p in raw.split(","))):
        parts = item.split(":")
        try:
            if len(parts) not in (3, 4) or parts[2] not in FAULT_STAGES:
                raise ValueError
            f = Fault(int(parts[0]), int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else 1)
            if f.rank < 0 or f.window < 1 or f.times < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={raw!r}: each entry is RANK:WINDOW:STAGE[:TIMES] (window from 1, stage "
                             f"one of {', '.join(FAULT_STAGES)}, times >= 1), got {item!r}") from None
        out.append(f)
    return tuple(out)


class Injector:
    """One rank's injected failures for a job: an out-of-memory error raised by the stage's middle module."""

    def __init__(self, faults: tuple[Fault, ...], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.fired: Counter = Counter()  # per fault, the runs it failed so far in this job

    @contextmanager
    def stage(self, stage: str, window: int, models):
        """Around a run of ``stage`` of window ``window`` (from 0) with ``models``: armed when a fault names
        them."""
        f = next((f for f in self.faults if f.stage == stage and f.window == window + 1
                  and self.fired[f] < f.times), None)
        if f is None:
            yield
            return
        self.fired[f] += 1
        n = self.fired[f]

        def fail(module, args):
            raise torch.OutOfMemoryError(f"out of memory injected by {FAULT_ENV} (rank {f.rank}, window {f.window}, "
                                         f"{f.stage}, failure {n} of {f.times})")

        handle = _middle(models, stage).register_forward_pre_hook(fail)
        try:
            yield
        finally:
            handle.remove()


def _middle(models, stage: str) -> torch.nn.Module:
    """The module in the middle of ``stage``: the DiT's middle block, the VAE encoder's or decoder's middle block."""
    if stage == "dit":
        blocks = models.dit.blocks
        return blocks[len(blocks) // 2]
    return (models.vae.encoder if stage == "vae_encode" else models.vae.decoder).mid_block


# -- the ladder -------------------------------------------------------------------------------------


class Restart(Exception):
    """Every rank starts the clip again under ``plan`` (windows of fewer frames)."""

    def __init__(self, plan):
        super().__init__(f"restart with windows of {plan.window_frames} frames")
        self.plan = plan


def fewer_frames(frames: int, k: int) -> int:
    """The next shorter window after ``frames``: about half, still kn + 1 (``frames`` when none is shorter)."""
    return min(frames, max(k + 1, ((frames // 2 - 1) // k) * k + 1))


class Recovery:
    """One rank's recovery state for a job: the failures, the steps taken, and what every rank decides next
    (a pure function of the plan and the agreed failures, so every rank decides alike)."""

    def __init__(self, req, device: torch.device, injector: Injector):
        self.req = req
        self.device = device
        self.injector = injector
        self.steps: list[dict] = []
        self.mode: str | None = None  # the VAE mode a step chose: windows planned later keep it

    def record(self, e: Exception, rank: int, stage: str) -> dict | None:
        """This rank's record of ``e``, raised in ``stage``, when it is an allocation failure (else None: not
        recoverable)."""
        if not out_of_memory(e):
            return None
        return {"rank": rank, "stage": stage, "error": error_line(e, 300)}

    def next_plan(self, plan, index: int, failures: tuple[dict, ...], lost_s: float):
        """The plan to run window ``index`` again under after ``failures`` (every rank's records), or
        :class:`Restart` with windows of fewer frames, or MemoryError (one line, the same on every rank) when no
        step is left. ``lost_s``: the failed attempt's time, for the report."""
        first = failures[0]
        if len(self.steps) >= MAX_STEPS:
            raise self._exhausted(plan, index, first, f"{MAX_STEPS} recovery steps were taken already, the most "
                                                    f"one job takes")
        step = None if first["stage"] == "dit" else self._leaner_mode(plan, index)
        if step is None:
            step = self._fewer_frames(plan)
        if step is None:
            raise self._exhausted(plan, index, first, "no leaner plan is left"
                                  + (f" after {len(self.steps)} recovery step(s)" if self.steps else ""))
        new_plan, entry = step
        entry.update(window=index + 1, windows=len(plan.steps), ranks=sorted(f["rank"] for f in failures),
                     rank=first["rank"], stage=first["stage"], error=first["error"], lost_s=round(lost_s, 3))
        self.steps.append(entry)
        if entry["kind"] == "window_frames":
            raise Restart(new_plan)
        return new_plan

    def _peak(self, plan, padded: int, mode: str) -> int:
        """The memory model's per-rank peak of VAE ``mode`` (encode or decode) for a window of ``padded`` frames."""
        dtype = DTYPES[self.req.weights.dtype]
        backend = backend_of(self.device, plan.deterministic)
        wino = counts_winograd(self.device, plan.deterministic)
        shape = (padded, *plan.geometry.out_hw)
        return max(vae_estimate(vae_config(plan.model), op, shape, plan.sp, mode, dtype, plan.vae_chunk,
                                backend=backend, winograd_filters=wino).total for op in ("encode", "decode"))

    def _fits(self, plan, mode: str, step) -> bool:
        """Whether ``mode`` can run window ``step`` (its latent frames, the degree)."""
        m = BY_NAME[mode]
        return step.latent[0] >= m.min_latent_frames and (plan.sp > 1 or not m.splits)

    def _leaner_mode(self, plan, index: int):
        if plan.windows.stitch == "latent":
            return None
        win = plan.steps[index]
        now = self._peak(plan, win.padded, win.vae_mode)
        for mode in AUTO_ORDER + FALLBACK:
            if mode == win.vae_mode or not self._fits(plan, mode, win) or self._peak(plan, win.padded, mode) >= now:
                continue
            why = f"recovery: {win.vae_mode} ran out of memory in window {index + 1}"
            steps = tuple(replace(s, vae_mode=mode, vae_reason=why)
                          if s.index >= index and s.vae_mode != mode and self._fits(plan, mode, s)
                          and self._peak(plan, s.padded, mode) < self._peak(plan, s.padded, s.vae_mode) else s
                          for s in plan.steps)
            self.mode = mode
            exact = BY_NAME[mode].exact
            return replace(plan, steps=steps), {
                "kind": "vae_mode", "from": win.vae_mode, "to": mode, "exact": exact,
                "output": (f"APPROXIMATE: the {mode} VAE's seams, not the frames of an exact mode" if not exact else
                           "the same bytes as without the failure" if plan.deterministic else
                           "the frames of a run without the failure, within float tolerance")}
        return None

    def _fewer_frames(self, plan):
        k = vae_config(plan.model).temporal_factor
        f = plan.window_frames
        shorter = fewer_frames(f, k)
        if shorter >= f:
            return None
        try:
            new = restoration_plan.rebuild(plan, window_frames=shorter,
                                           **({"vae_mode": self.mode} if self.mode else {}))
        except ValueError:  # e.g. the latent stitch's overlap does not fit the shorter windows
            return None
        return new, {"kind": "window_frames", "from": f, "to": shorter, "exact": True,
                     "output": f"the bytes of a run with --window-frames {shorter} (the clip restarted)"}

    def _exhausted(self, plan, index: int, first: dict, why: str) -> MemoryError:
        """The one line every rank raises when no step is left: what failed, and what would fit."""
        w, p, win = self.req.weights, plan, plan.steps[index]
        kept = dit_weights(w.model, w.dtype, checkpoint=w.dit, weights_dtype=w.weights_dtype)
        wino, backend = counts_winograd(self.device, p.deterministic), backend_of(self.device, p.deterministic)
        ran_out = estimate(p.model, w.dtype, p.window_frames, p.geometry.out_hw, p.sp, win.vae_mode, None,
                           p.vae_chunk, weights=kept, winograd_filters=wino, vae_backend=backend).total
        budget = min(p.budget, ran_out) - 1  # what would fit: modelled below what ran out
        fits = suggestions(p.model, w.dtype, p.window_frames, p.geometry.out_hw, p.sp, win.vae_mode, budget,
                           p.window_frames, weights=kept, winograd_filters=wino, vae_backend=backend)
        hint = (f"would fit (modelled under the {ran_out / GiB:.2f} GiB per rank that ran out): {', '.join(fits)}"
                if fits else "nothing the memory model finds smaller would fit: try a smaller --resolution")
        return MemoryError(f"out of memory on rank {first['rank']} in window {index + 1}/{len(p.steps)} "
                           f"({first['stage']}), and {why}; {hint}; the failure: {first['error']}")

