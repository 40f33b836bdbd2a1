"""Acceptance: the port reproduces the SeedVR2 reference's own output (fp32), alone and under window SP."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditsp.config import ParallelConfig
from ditsp.models.seedvr2.nadit import NaDiT, TINY, load_checkpoint
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime

DATA = Path(__file__).parent / "data" / "nadit-3b-tiny"
REL_TOL = 1e-5


def reference_model() -> NaDiT:
    model = NaDiT(TINY).eval()
    load_checkpoint(model, DATA / "weights.safetensors")  # strict, reference key names
    return model


def io():
    return load_file(DATA / "io.safetensors")


@torch.no_grad()
def sp_forward(ctx):
    model, d = reference_model(), io()
    rt = parallelize(TINY, ParallelConfig.window(ctx.world_size, window_path="window"), model.grid_of(d["vid_in"].shape),
                     ctx.group)
    out = model(d["vid_in"], d["txt_in"], d["timestep"], runtime=rt)
    return out, rt.report(heads=TINY.heads), rt.comm.stats.as_dict()


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_time_embedding_matches_reference():
    model, d = reference_model(), io()
    emb = model.emb_in(d["timestep"], torch.float32)
    assert (emb - d["emb"]).abs().max().item() <= 1e-5 * d["emb"].abs().max().item()


@torch.no_grad()
def test_single_device_reproduces_reference():
    model, d = reference_model(), io()
    one = single_runtime(model.cfg, model.grid_of(d["vid_in"].shape))
    out = model(d["vid_in"], d["txt_in"], d["timestep"], runtime=one)
    assert out.shape == d["vid_out"].shape == (5, 40, 72, 16)
    assert rel_err(out, d["vid_out"]) <= REL_TOL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_window_sp_reproduces_reference(clusters, world):
    ref = io()["vid_out"]
    results = clusters(world).run(sp_forward)
    for rank, (out, report, stats) in enumerate(results):
        assert rel_err(out, ref) <= REL_TOL, f"rank {rank}"
        assert torch.equal(out, results[0][0]), "every rank returns the same output"
    assert results[0][1] == f"window-aligned Plan A, planner lpt, SP={world}, 3 heads on every rank"
    stats = results[0][2]
    assert stats["text_all_reduce"]["calls"] == TINY.num_layers - 1  # the last block's text is discarded
    assert stats["window_exchange"]["calls"] == TINY.num_layers - 1  # 3 layout changes
    assert stats["output_gather"]["calls"] == 1
