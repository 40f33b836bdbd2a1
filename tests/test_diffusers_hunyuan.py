"""diffusers' HunyuanVideoTransformer3DModel (rear joint text with padding, double- and single-stream blocks,
token refiner) under ditsp SP vs the unmodified model (tiny seeded config; comparison and tolerance in
diffusers_cases.py). diffusers' own context parallelism has no plan for this model."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize  # noqa: E402

from .diffusers_cases import build, compare, forward_backward, rank_run  # noqa: E402

CASES = [  # (ulysses, ring, heads, latent grid, advanced_uaa)
    (2, 1, 4, (2, 6, 10), False),   # Ulysses 2, 30 video tokens, 4 of 6 text tokens valid
    (1, 3, 4, (2, 6, 14), False),   # Ring 3, 42 tokens
    (3, 1, 4, (3, 6, 10), True),    # Ulysses 3 with 4 heads (uneven), 45 tokens
]


@pytest.mark.parametrize("u,r,heads,grid,uaa", CASES)
def test_hunyuan_matches_one_device(clusters, u, r, heads, grid, uaa):
    results = clusters(u * r).run(rank_run, "hunyuan", u, r, heads, grid, False, uaa)
    compare(results, "hunyuan", heads, grid)


def test_hunyuan_one_device_without_distributed():
    model = parallelize(build("hunyuan"), ParallelConfig())
    compare([forward_backward(model, "hunyuan", (2, 6, 10))], "hunyuan", 4, (2, 6, 10))


def test_token_replace_is_refused():
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                                           text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
                                           image_condition_type="token_replace")
    with pytest.raises(ParallelizeError, match="token_replace"):
        parallelize(model, ParallelConfig())
