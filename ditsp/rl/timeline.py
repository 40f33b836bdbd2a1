"""A run's modelled time: its critical path step by step, each part as long as the CPU time it measured, as
if the trainer and every spot group had a device of its own.

On a shared machine the wall clock mostly measures contention: spot workers and the trainer take turns on
the same cores, so overlap cannot show. The model keeps what the run measured (the trainer's CPU seconds per
step, each spot unit's CPU seconds, which group ran it, the units a preemption abandoned) and lays it out on
dedicated devices:

- without spot workers (``none``, ``fresh``): a step lasts its trainer CPU time (exploration included in
  ``fresh``);
- with them (``stale``): step ``k`` is the rollouts' span ``R_k`` (the busiest group's CPU seconds on step
  ``k``'s rollout units, abandoned ones included), then the update ``U_k`` overlapped with the exploration of
  step ``k + 1`` (its span ``E_{k+1}``, likewise): ``R_k + max(U_k, E_{k+1})``; the first step also waits for
  its own exploration, ``E_start``.

Audit units (the premise's measurement) are left out: they are not part of the method.
"""

from __future__ import annotations

import re
from collections import defaultdict

_ID = re.compile(r"s(\d+)-(rollout|explore|audit)-p(\d+)")


def request_id(step: int, kind: str, prompt: int) -> str:
    """The id of one prompt's request of a kind at a step (the model reads step and kind back from it)."""
    return f"s{step}-{kind}-p{prompt}"


def spans(units) -> dict[tuple[int, str], float]:
    """(step, kind) -> the busiest worker's CPU seconds on that step's units of that kind."""
    per = defaultdict(lambda: defaultdict(float))
    for u in units:
        m = _ID.fullmatch(u.request)
        if m:
            per[(int(m.group(1)), m.group(2))][u.worker] += u.cpu_s
    return {key: max(by_worker.values()) for key, by_worker in per.items()}


def modelled_steps(mode: str, trainer_cpu: dict[int, float], units, start: int, steps: int) -> dict[int, float]:
    """Step -> its modelled seconds (module doc); ``trainer_cpu`` the trainer's CPU seconds per step."""
    if mode != "stale":
        return {k: trainer_cpu[k] for k in range(start, steps)}
    sp = spans(units)
    out = {}
    for k in range(start, steps):
        rollouts = sp.get((k, "rollout"), 0.0)
        explore_next = sp.get((k + 1, "explore"), 0.0) if k + 1 < steps else 0.0
        out[k] = rollouts + max(trainer_cpu[k], explore_next) + (sp.get((k, "explore"), 0.0) if k == start else 0.0)
    return out
