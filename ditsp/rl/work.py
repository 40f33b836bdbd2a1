"""What a spot worker computes for a run: one seed of one prompt, sampled and scored with a published version
of the weights, on the worker's current SP group.

:class:`SpotTask` is pickled to every spot worker (:mod:`.spot`). It builds the run's models once per process
and a :class:`~ditsp.rl.policy.Policy` on each group the worker joins (a copy of the pristine models, put
under SP on that group), and loads the weights version a request names from the trainer's published file
(:mod:`.published`) when it is not the one it holds. A unit is :func:`~ditsp.rl.policy.sample` with the
run's sampler and reward: the same computation as the trainer's own rollouts, so under ``deterministic`` the
rollout it returns (``keep``) is the trainer's bit for bit, whatever the group's size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .loop import RLConfig, build_models
from .policy import Policy, sample
from .published import read


@dataclass
class SpotTask:
    """The run's settings, the published weights' folder and the training prompts' embeddings."""

    cfg: RLConfig
    weights: str
    prompts: torch.Tensor  # [N, tokens, dim]

    def setup(self) -> None:
        torch.set_num_threads(1)
        self._models = build_models(self.cfg)
        self._policy: Policy | None = None
        self._version: int | None = None

    def on_group(self, ctx) -> None:
        group = ctx.group if ctx.world_size > 1 else None
        self._policy = Policy(copy.deepcopy(self._models), group, self.cfg.deterministic)
        self._version = None

    def run(self, ctx, request, seed: int) -> dict:
        if self._version != request.version:
            self._policy.load_weights(read(self.weights, request.version))
            self._version = request.version
        p = request.prompt
        out = sample(self._policy, self.prompts[p:p + 1], seed, self.cfg.sampler, prompt=p, reward=self.cfg.reward,
                     decode=False)
        out.frames = None  # the reward is kept; frames are not needed past it
        return {"reward": out.reward, "rollout": out if request.keep else None}
