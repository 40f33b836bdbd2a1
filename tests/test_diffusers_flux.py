"""diffusers' FluxTransformer2DModel (joint text: double- and single-stream blocks) under ditsp SP vs the
unmodified model (tiny seeded config; comparison and tolerance in diffusers_cases.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize  # noqa: E402

from .diffusers_cases import build, compare, forward_backward, inputs, rank_run  # noqa: E402

CASES = [  # (ulysses, ring, heads, (image tokens, text tokens), advanced_uaa)
    (2, 1, 4, (30, 5), False),   # Ulysses 2
    (1, 3, 4, (31, 5), False),   # Ring 3, uneven image tokens 11/10/10; text rows split over the ring
    (3, 1, 4, (29, 6), True),    # Ulysses 3 with 4 heads (uneven)
]


@pytest.mark.parametrize("u,r,heads,shape,uaa", CASES)
def test_flux_matches_one_device(clusters, u, r, heads, shape, uaa):
    results = clusters(u * r).run(rank_run, "flux", u, r, heads, shape, False, uaa)
    compare(results, "flux", heads, shape)


def test_flux_one_device_without_distributed():
    model = parallelize(build("flux"), ParallelConfig())
    compare([forward_backward(model, "flux", (30, 5))], "flux", 4, (30, 5))


def test_flux_refuses_controlnet_residuals():
    model = parallelize(build("flux"), ParallelConfig())
    args, kw, _ = inputs("flux", (30, 5))
    with pytest.raises(ParallelizeError, match="controlnet_block_samples"):
        model(*args, **kw, controlnet_block_samples=[torch.zeros(1, 30, 32)], return_dict=False)
