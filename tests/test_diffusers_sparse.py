"""Adaptive sparse attention (head-migration balancing) selected through parallelize(sparse=...) on Wan:
dense when it keeps every block, and the same sparse result at every SP degree (within tolerance)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.attention.sparse import SparseConfig  # noqa: E402
from ditsp.config import ParallelConfig  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, parallelize  # noqa: E402

from .diffusers_cases import OUT_TOL, build, inputs, rel  # noqa: E402

GRID = (2, 10, 14)


def _sparse(ctx, u, top_p, heads=4, slack=True):
    group = ctx.group if ctx is not None else None
    model = parallelize(build("wan", heads), ParallelConfig(ulysses_degree=u, advanced_uaa=True), group,
                        sparse=SparseConfig(cube=(1, 2, 2), top_p=top_p, k_min=1, slack=slack))
    args, _, _ = inputs("wan", GRID)
    with torch.no_grad():
        out = model(*args, return_dict=False)[0]
    return out, model._ditsp_runtime.attention.reports[-1]["density"]


@pytest.mark.parametrize("u", [2, 3])
def test_sparse_keeping_every_block_is_dense(clusters, u):
    args, _, _ = inputs("wan", GRID)
    with torch.no_grad():
        ref = build("wan")(*args, return_dict=False)[0]
    for out, density in clusters(u).run(_sparse, u, 1.0):
        assert density == 1.0 and rel(out, ref) <= OUT_TOL


def test_sparse_is_the_same_at_every_degree(clusters):
    """Without slack filling (which adds blocks on ranks with spare time, by design degree-dependent) the
    masks are the same at every degree and head migration only moves work."""
    one, d1 = _sparse(None, 1, 0.5, slack=False)
    assert d1 < 0.6
    for out, density in clusters(2).run(_sparse, 2, 0.5, 4, False):
        assert density == d1 and rel(out, one) <= OUT_TOL


def test_sparse_refusals():
    with pytest.raises(ParallelizeError, match="Ulysses only"):
        parallelize(build("wan"), ParallelConfig(ring_degree=2), sparse=SparseConfig())
    with pytest.raises(ParallelizeError, match="does not know the token grid"):
        parallelize(build("flux"), ParallelConfig(), sparse=SparseConfig())
    model = parallelize(build("wan"), ParallelConfig(), sparse=SparseConfig())
    args, _, _ = inputs("wan", GRID)
    with pytest.raises(RuntimeError, match="forward-only"):
        model(*args, return_dict=False)
