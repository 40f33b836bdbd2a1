"""diffusers' LTXVideoTransformer3DModel under ditsp SP vs the unmodified model (tiny seeded config;
comparison and tolerance in diffusers_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import parallelize  # noqa: E402

from .diffusers_cases import build, compare, forward_backward, rank_run  # noqa: E402

CASES = [  # (ulysses, ring, heads, latent grid, per-token timesteps, advanced_uaa)
    (2, 1, 4, (2, 5, 7), False, False),  # Ulysses 2, 70 tokens
    (1, 3, 4, (2, 5, 7), True, False),   # Ring 3, uneven 24/23/23, per-token timesteps
    (3, 1, 4, (3, 4, 5), False, True),   # Ulysses 3 with 4 heads (uneven)
]


@pytest.mark.parametrize("u,r,heads,grid,per_token,uaa", CASES)
def test_ltx_matches_one_device(clusters, u, r, heads, grid, per_token, uaa):
    results = clusters(u * r).run(rank_run, "ltx", u, r, heads, grid, per_token, uaa)
    compare(results, "ltx", heads, grid, per_token)


def test_ltx_one_device_without_distributed():
    model = parallelize(build("ltx"), ParallelConfig())
    compare([forward_backward(model, "ltx", (2, 5, 7))], "ltx", 4, (2, 5, 7))
