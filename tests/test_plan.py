"""The restoration plan (ditsp/models/seedvr2/job/plan.py): every derived value computed once, from the model's
own configs; the VAE's auto mode chosen against what the budget leaves; the ranks run the plan they were given."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ditsp.models.seedvr2.job import plan as restoration_plan
from ditsp.models.seedvr2.job.budget import GiB, estimate
from ditsp.models.seedvr2.presets import vae_config

BASE = dict(model="seedvr2-3b", dtype="bf16", in_width=584, in_height=392, frames=33, area=None, size=(1168, 784),
            window_frames=0, overlap=4, seed=666, sp=1, vae_mode="auto", vae_chunk=1, planner=None,
            deterministic=False, budget=24 * GiB)


def test_more_memory_never_turns_a_run_into_a_refusal():
    """The VAE's mode is chosen against the budget left after the DiT's weights, activations and latents: a 3B
    job at 1168x784 that fits some budget fits every larger one (against the whole budget, 22.8 GiB was refused
    where 18.7 GiB ran)."""
    budgets = [b * GiB / 4 for b in range(40, 161)]  # 10 .. 40 GiB in quarter steps
    fits = [estimate("seedvr2-3b", "bf16", 33, (784, 1168), 1, "auto", int(b)).total <= b for b in budgets]
    first = fits.index(True)
    assert all(fits[first:]), [budgets[i] / GiB for i, f in enumerate(fits) if i > first and not f]
    # and what it picks fits what is left: the whole estimate within the budget
    for b in (18.7, 22.8, 30.0):
        e = estimate("seedvr2-3b", "bf16", 33, (784, 1168), 1, "auto", int(b * GiB))
        assert e.total <= b * GiB, (b, e.describe())


def test_the_plan_derives_every_size_from_the_models_configs():
    p = restoration_plan.build(**BASE)
    vae = vae_config("seedvr2-3b")
    assert p.geometry.out_hw == (784, 1168) and p.frames == 33 and len(p.steps) == 1
    s = p.steps[0]
    assert s.padded == 33 and s.latent == vae.latent_shape(33, 784, 1168) == (9, 98, 146)
    assert s.grid == (9, 49, 73) and s.vae_mode != "auto" and s.vae_reason.startswith("auto:")
    assert p.memory.vae_mode == s.vae_mode and p.memory.total <= p.budget
    # the small restorer: 2x space, no time compression, so any frame count and multiples of 4
    t = restoration_plan.build(**{**BASE, "model": "tiny", "dtype": "fp32", "in_width": 62, "in_height": 46,
                                  "size": None, "area": (124, 92), "frames": 7, "window_frames": 4, "overlap": 1})
    assert t.geometry.multiple == 4 and t.geometry.out_hw[0] % 4 == 0 and t.geometry.out_hw[1] % 4 == 0
    assert all(s.padded == s.stop - s.start for s in t.steps) and len(t.steps) == 2
    assert t.steps[0].latent == (4, t.geometry.out_height // 2, t.geometry.out_width // 2)


def test_requested_vae_mode_is_kept_and_said():
    p = restoration_plan.build(**{**BASE, "vae_mode": "chunked"})
    assert all(s.vae_mode == "chunked" and s.vae_reason == "requested" for s in p.steps)


def test_the_fingerprint_covers_what_the_ranks_must_share():
    a = restoration_plan.build(**BASE)
    assert a.fingerprint() == restoration_plan.build(**BASE).fingerprint()
    assert a.fingerprint() != restoration_plan.build(**{**BASE, "seed": 1}).fingerprint()
    assert a.fingerprint() != replace(a, sp=2).fingerprint()


def test_a_rank_group_of_another_size_refuses_the_plan(tmp_path):
    """A plan made for SP=2 run on one rank: a clear error, before any weight is loaded."""
    from ditsp.distributed.launcher import RankContext
    from ditsp.io.testclip import make_test_clip
    from ditsp.models.seedvr2.job.request import Options, check
    from ditsp.models.seedvr2.job.restore import rank_upscale

    clip = str(make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=5, fps=12, audio=False))
    req = check(Options(input=clip, output=str(tmp_path / "o.mp4"), model="tiny-8x", random_weights=True, sp=2,
                        progress=False)).req
    with pytest.raises(ValueError, match="planned for SP=2 but runs on 1"):
        rank_upscale(RankContext(0, 1, None, torch.device("cpu")), req)
