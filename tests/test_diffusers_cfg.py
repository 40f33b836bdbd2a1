"""CFG parallel: conditional and unconditional passes on two halves of the ranks (SP inside each half),
both returned on every rank, against the two passes of the unmodified model on one device."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.config import ParallelConfig, ParallelConfigError  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError, cfg_forward, guided, parallelize  # noqa: E402

from .diffusers_cases import OUT_TOL, build, inputs, rel  # noqa: E402


def passes():
    (x, t, text), _, _ = inputs("wan", (2, 10, 14))
    neg = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(9))
    return {"hidden_states": x, "timestep": t, "encoder_hidden_states": text}, \
        {"hidden_states": x, "timestep": t, "encoder_hidden_states": neg}


def _rank(ctx, u):
    model = parallelize(build("wan"), ParallelConfig(ulysses_degree=u, cfg_degree=2, advanced_uaa=True), ctx.group)
    cond, uncond = passes()
    c, n = cfg_forward(model, cond, uncond)
    g = guided(model, cond, uncond, 5.0)
    return c, n, g, model._ditsp_runtime.cfg_half, model._ditsp_runtime.comm.world_size


@pytest.mark.parametrize("u", [1, 2])  # CFG 2 x SP 1 (2 ranks), CFG 2 x Ulysses 2 (4 ranks)
def test_cfg_parallel_matches_two_passes_on_one_device(clusters, u):
    res = clusters(2 * u).run(_rank, u)
    assert [r[3] for r in res] == [0] * u + [1] * u and {r[4] for r in res} == {u}
    ref = build("wan")
    cond, uncond = passes()
    with torch.no_grad():
        rc = ref(**cond, return_dict=False)[0]
        rn = ref(**uncond, return_dict=False)[0]
    for c, n, g, _, _ in res:
        assert rel(c, rc) <= OUT_TOL and rel(n, rn) <= OUT_TOL
        assert rel(g, rn + 5.0 * (rc - rn)) <= 10 * OUT_TOL  # guidance amplifies the difference 5x
    for r in res[1:]:  # the exchange only moves values: every rank holds the same bits
        assert all(torch.equal(a, b) for a, b in zip(r[:3], res[0][:3]))


def test_cfg_degree_is_one_or_two():
    with pytest.raises(ParallelConfigError, match="cfg_degree must be 1 or 2"):
        ParallelConfig(cfg_degree=3)


def test_cfg_one_runs_both_passes_in_turn():
    model = parallelize(build("wan"), ParallelConfig())
    cond, uncond = passes()
    c, n = cfg_forward(model, cond, uncond)
    assert not torch.equal(c, n)
    with pytest.raises(ParallelizeError, match="ranks"):
        parallelize(build("wan"), ParallelConfig(cfg_degree=2))
