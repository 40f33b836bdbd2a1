"""NaDiT execution paths beyond the default: the Ulysses baseline and window SP under the locality plan."""

import pytest
import torch

from ditsp.attention.common import even_splits
from ditsp.models.seedvr2.job.forward import RunSpec, build_for, rank_forward
from ditsp.models.seedvr2.parallelize import single_runtime

pytestmark = pytest.mark.timeout(180)


def test_even_splits_for_rows_and_heads():
    assert even_splits(20, 8) == [3, 3, 3, 3, 2, 2, 2, 2]
    assert even_splits(3, 4) == [1, 1, 1, 0]
    assert sum(even_splits(75600, 7)) == 75600


@pytest.fixture(scope="module")
def reference():
    spec = RunSpec(model="tiny", grid=(5, 20, 36), sp=1)
    model, vid, txt = build_for(spec)
    with torch.no_grad():
        return model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, spec.grid))


@pytest.mark.parametrize("world", [2, 3, 4])  # 3 heads: 4 ranks leave one rank without a head
def test_ulysses_path_matches_single_device(clusters, reference, world):
    spec = RunSpec(model="tiny", grid=(5, 20, 36), sp=world, path="ulysses")
    results = clusters(world).run(rank_forward, spec)
    out = results[0]["output"]
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
    tokens, dim, heads, layers = 5 * 20 * 36, 96, 3, 4
    for r in results:
        kinds = r["collectives"]
        assert kinds["ulysses_qkv"]["calls"] == layers and kinds["ulysses_out"]["calls"] == layers
        assert "window_exchange" not in kinds
    # Q, K, V and O: four activation-sized all-to-alls per layer, (P-1)/P of each leaves its rank
    total = sum(r["collectives"]["ulysses_qkv"]["bytes_sent"] + r["collectives"]["ulysses_out"]["bytes_sent"]
                for r in results)
    rows = [tokens // world + (p < tokens % world) for p in range(world)]
    shares = [heads // world + (p < heads % world) for p in range(world)]
    per_layer = sum(4 * rows[r] * shares[p] * (dim // heads) * 4 for r in range(world) for p in range(world) if p != r)
    assert total == layers * per_layer


@pytest.mark.parametrize("world", [2, 4])
def test_window_sp_under_the_locality_plan_matches_single_device(clusters, reference, world):
    spec = RunSpec(model="tiny", grid=(5, 20, 36), sp=world, planner="locality")
    results = clusters(world).run(rank_forward, spec)
    assert (results[0]["output"] - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert "planner locality" in results[0]["report"]
