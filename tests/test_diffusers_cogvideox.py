"""diffusers' CogVideoXTransformer3DModel (joint text in every attention; sincos positions or RoPE) under
ditsp SP vs the unmodified model (tiny seeded configs; comparison and tolerance in diffusers_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import parallelize  # noqa: E402

from .diffusers_cases import build, compare, forward_backward, rank_run  # noqa: E402

CASES = [  # (family, ulysses, ring, heads, latent grid, advanced_uaa); the sincos grid must match the config's
    ("cogvideox", 2, 1, 4, (2, 6, 10), False),       # Ulysses 2, 30 video tokens + 6 text
    ("cogvideox-rope", 1, 3, 4, (2, 6, 14), False),  # Ring 3, 42 tokens; RoPE tables sharded with them
    ("cogvideox-rope", 3, 1, 4, (3, 6, 10), True),   # Ulysses 3 with 4 heads (uneven), 45 tokens 15/15/15
]


@pytest.mark.parametrize("family,u,r,heads,grid,uaa", CASES)
def test_cogvideox_matches_one_device(clusters, family, u, r, heads, grid, uaa):
    results = clusters(u * r).run(rank_run, family, u, r, heads, grid, False, uaa)
    compare(results, family, heads, grid)


def test_cogvideox_one_device_without_distributed():
    model = parallelize(build("cogvideox-rope"), ParallelConfig())
    compare([forward_backward(model, "cogvideox-rope", (2, 6, 10))], "cogvideox-rope", 4, (2, 6, 10))
