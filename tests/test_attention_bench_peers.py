"""`ditsp bench attention` peer baselines: torch context parallel and yunchang, checked against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditsp.bench.attention import run_bench
from ditsp.bench.attention_baselines import BASELINES, TORCH_CP_NO_BACKWARD, baseline_fits, peer_missing
from ditsp.cli import build_parser
from ditsp.dtypes import DTYPES


def _cfg(strategies, dtype="fp32", backward=False, kv_heads=2):
    return {"sp": 2, "seq": 256, "heads": 4, "kv_heads": kv_heads, "head_dim": 16, "batch": 1, "text": 0,
            "dtype": dtype, "backward": backward, "warmup": 0, "iters": 1, "threads": 1, "strategies": strategies}


# torch-cp-ring's first call per (shape, dtype) costs seconds on CPU (DTensor derives the CPU flash op's
# sharding from its decomposition); both tests use one shape, fp32 only (bf16 takes the same path).
@pytest.mark.timeout(300)  # a stuck-rank backstop: the launcher tells slow from stuck; a loaded 2-core CI took >120 s
def test_torch_cp_ring_forward_matches_sdpa(clusters):
    assert peer_missing("torch-cp-ring") is None  # part of torch: always there
    cfg = _cfg([("torch-cp-ring", 1, 2), ("ulysses", 2, 1)])
    rows = {r["strategy"]: r for r in run_bench(cfg, cluster=clusters(2))}
    cp = rows["torch-cp-ring"]
    assert cp["err"] is not None and cp["err"] < 1e-5 and cp["grad_err"] is None
    assert rows["ulysses"]["err"] < 1e-5
    # On CPU: K and V all-gathered (DTensor's sharding of the CPU flash op), counted by the dispatch mode.
    kv_shard = 128 * 2 * 16 * DTYPES["fp32"].itemsize  # one rank's K (or V): 128 rows x 2 heads x 16
    assert cp["calls"] == 2 and cp["sent_mib"] * 2**20 == 2 * kv_shard == cp["recv_mib"] * 2**20
    assert cp["peak_mib"] >= 0 and cp["ms"] > 0


def _cp_backward(ctx):
    from ditsp.bench.attention_baselines import TorchCPRing

    q = torch.randn(1, 128, 4, 16, requires_grad=True)  # the shapes of the forward test (its cached sharding)
    k, v = (torch.randn(1, 128, 2, 16, requires_grad=True) for _ in range(2))
    out = TorchCPRing(ctx.group)(q, k, v)
    try:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_torch_cp_ring_backward_is_still_unsupported_on_cpu(clusters):
    """The bench skips torch-cp-ring with --backward; when torch learns it, this fails: drop the skip."""
    msgs = clusters(2).run(_cp_backward)
    assert all(m and "_scaled_dot_product_flash_attention_for_cpu_backward" in m for m in msgs), msgs
    assert baseline_fits("torch-cp-ring", {**_cfg([]), "backward": True}) == TORCH_CP_NO_BACKWARD
    assert baseline_fits("torch-cp-ring", _cfg([])) is None
    assert "divisible" in baseline_fits("torch-cp-ring", {**_cfg([]), "seq": 255})


@pytest.mark.timeout(300)  # a stuck-rank backstop: the launcher tells slow from stuck; a loaded 2-core CI took >120 s
def test_yunchang_ulysses_matches_sdpa(clusters):
    pytest.importorskip("yunchang")
    cfg = _cfg([("yunchang-ulysses", 2, 1), ("a2a-sdpa", 2, 1), ("sdpa-1dev", 1, 1)], backward=True)
    rows = {r["strategy"]: r for r in run_bench(cfg, cluster=clusters(2))}
    yc = rows["yunchang-ulysses"]
    assert yc["err"] < 1e-5 and yc["grad_err"] < 1e-4
    assert rows["sdpa-1dev"]["err"] < 1e-5 and rows["sdpa-1dev"]["grad_err"] < 1e-4
    # Its exchanges: Q, K, V, out forward; dOut, dQ, dK, dV backward; half of each tensor leaves the rank.
    q_shard, kv_shard = 128 * 4 * 16 * 4, 128 * 2 * 16 * 4
    assert yc["calls"] == 8 and yc["sent_mib"] * 2**20 == (4 * q_shard + 4 * kv_shard) / 2
    assert yc["calls"] == rows["a2a-sdpa"]["calls"] and yc["sent_mib"] == rows["a2a-sdpa"]["sent_mib"]


def test_peer_baselines_wired_and_skipped_when_missing(monkeypatch):
    args = build_parser().parse_args(["bench", "attention", "--sp", "2", "--seq", "64", "--heads", "4",
                                      "--baselines", "yunchang-ulysses,torch-cp-ring"])
    assert args.baselines == ["yunchang-ulysses", "torch-cp-ring"] and set(args.baselines) <= set(BASELINES)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "yunchang" else real(name, *a))
    assert "not installed" in baseline_fits("yunchang-ulysses", _cfg([]))
    assert "divisible" in baseline_fits("yunchang-ulysses", {**_cfg([]), "heads": 3, "kv_heads": 3})


def test_sdpa_bshd_is_sdpa():
    from ditsp.bench.attention_baselines import _sdpa_bshd

    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), enable_gqa=True)
    assert torch.equal(_sdpa_bshd(q, k, k, softmax_scale=None), ref.transpose(1, 2))
