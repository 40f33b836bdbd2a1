"""diffusers' WanTransformer3DModel under ditsp.integrations.diffusers.parallelize vs the unmodified model
(tiny seeded configs; the comparison and its measured tolerance are in diffusers_cases.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig, ParallelConfigError  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize  # noqa: E402

from .diffusers_cases import build, compare, forward_backward, rank_run  # noqa: E402

CASES = [  # (ulysses, ring, heads, grid, per_token, advanced_uaa)
    (2, 1, 4, (2, 10, 14), False, False),   # Ulysses 2, 70 tokens
    (1, 3, 4, (2, 10, 14), False, False),   # Ring 3, uneven tokens 24/23/23
    (3, 1, 4, (3, 6, 10), True, True),      # Ulysses 3: 4 heads (uneven), 45 tokens, Wan 2.2 per-token timesteps
    (1, 2, 4, (3, 6, 10), True, False),     # Ring 2, uneven 23/22, per-token timesteps
    (2, 2, 4, (2, 10, 14), False, False),   # USP 2x2 (the 4-rank pool the CFG test also uses)
]


@pytest.mark.parametrize("u,r,heads,grid,per_token,uaa", CASES)
def test_wan_matches_one_device(clusters, u, r, heads, grid, per_token, uaa):
    results = clusters(u * r).run(rank_run, "wan", u, r, heads, grid, per_token, uaa)
    compare(results, "wan", heads, grid, per_token)


def test_wan_reduce_gradients(clusters):
    """After reduce_gradients every rank holds the single-device gradient itself."""
    results = clusters(2).run(rank_run, "wan", 1, 2, 4, (2, 10, 14), False, False, True)
    for res in results:
        compare([res], "wan", 4, (2, 10, 14), summed=False)


def test_wan_one_device_without_distributed():
    model = parallelize(build("wan"), ParallelConfig())
    compare([forward_backward(model, "wan", (2, 10, 14))], "wan", 4, (2, 10, 14))


def _strict_heads(ctx):
    try:
        parallelize(build("wan", 4), ParallelConfig(ulysses_degree=3), ctx.group)
    except ParallelConfigError as e:
        return str(e)
    return None


def test_uneven_heads_refused_in_strict_mode(clusters):
    msgs = clusters(3).run(_strict_heads)
    assert all(m and "advanced_uaa" in m for m in msgs), msgs


def test_refusals_name_the_module():
    with pytest.raises(ParallelizeError, match="cannot parallelize Linear"):
        parallelize(torch.nn.Linear(2, 2), ParallelConfig())
    model = build("wan")

    class Custom:
        def __call__(self, *a, **k):
            raise AssertionError

    model.blocks[1].attn1.set_processor(Custom())
    with pytest.raises(ParallelizeError, match=r"blocks\.1\.attn1 .*Custom"):
        parallelize(model, ParallelConfig())
    model = parallelize(build("wan"), ParallelConfig())
    with pytest.raises(ParallelizeError, match="already parallelized"):
        parallelize(model, ParallelConfig())
