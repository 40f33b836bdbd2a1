"""Acceptance for the 7B family and the verify library: the reference's own outputs, alone and under window SP."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditsp.models.seedvr2.nadit import NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.config import TINY_7B
from ditsp.models.seedvr2.parallelize import single_runtime
from ditsp.models.seedvr2.verify import (CHECKERS, VectorSetError, detect_kind, format_verify, nadit_config,
                                         read_config, verify_vectors)

DATA = Path(__file__).parent / "data"
SET_7B, SET_3B = DATA / "nadit-7b-tiny", DATA / "nadit-3b-tiny"

pytestmark = pytest.mark.timeout(240)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_configs_of_the_shipped_sets():
    cfg = nadit_config(read_config(SET_7B), "tiny-7b")
    assert cfg == TINY_7B
    cfg3 = nadit_config(read_config(SET_3B), "tiny")
    from ditsp.models.seedvr2.nadit import TINY
    assert cfg3 == TINY
    assert detect_kind(read_config(SET_7B)) == detect_kind(read_config(SET_3B)) == "nadit"
    assert set(CHECKERS) == {"nadit", "vae", "pipeline"}


@torch.no_grad()
def test_every_intermediate_matches_the_reference_on_one_device():
    """Including the last block's text output, which the 7B computes in full (modulated, MLP)."""
    io = load_file(SET_7B / "io.safetensors")
    model = NaDiT(TINY_7B).eval()
    load_checkpoint(model, SET_7B / "weights.safetensors")
    states = {}
    out = model(io["vid_in"], io["txt_in"], io["timestep"], states=states,
                runtime=single_runtime(model.cfg, model.grid_of(io["vid_in"].shape)))
    assert rel(out, io["vid_out"]) <= 1e-5
    for k in ["emb", "vid_patch_in", "txt_proj_in"] + [f"block{i}.{s}" for i in range(4) for s in ("vid", "txt")]:
        assert rel(states[k].reshape(io[k].shape), io[k]) <= 1e-5, k


def test_verify_7b_vectors_at_sp_1_to_4(clusters):
    result = verify_vectors(SET_7B, degrees=(1, 2, 3, 4), cluster_factory=clusters)
    assert result["pass"], format_verify(result)
    assert [r["degree"] for r in result["runs"]] == [1, 2, 3, 4]
    for r in result["runs"]:
        assert r["rel_err"] <= 1e-5 and r["ranks_agree"]
    assert result["runs"][3]["path"] == "window-aligned Plan A, planner lpt, SP=4, 3 heads on every rank"
    assert result["model"]["variant"] == "7b"
    text = format_verify(result)
    assert "7b family" in text and "SP=4" in text and text.endswith("PASS")


def test_verify_3b_vectors(clusters):
    result = verify_vectors(SET_3B, degrees=(1, 3), cluster_factory=clusters)
    assert result["pass"], format_verify(result)
    assert result["model"]["variant"] == "3b"


def test_verify_fails_on_a_perturbed_copy(clusters, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(SET_7B, broken)
    (broken / "weights.safetensors").chmod(0o644)
    w = load_file(broken / "weights.safetensors")
    w["blocks.2.mlp.txt.proj_in.bias"] = w["blocks.2.mlp.txt.proj_in.bias"] + 0.01
    save_file(w, broken / "weights.safetensors")
    result = verify_vectors(broken, degrees=(1, 2), cluster_factory=clusters)
    assert not result["pass"]
    assert all(not r["pass"] and r["rel_err"] > 1e-5 for r in result["runs"])
    assert result["runs"][0]["first_divergence"] == "block2.txt"
    text = format_verify(result)
    assert "FAIL" in text.splitlines()[2] and text.endswith("FAIL") and "first divergence at block2.txt" in text


def test_verify_rejects_what_it_cannot_check(tmp_path):
    with pytest.raises(VectorSetError, match="no config.json"):
        verify_vectors(tmp_path)
    (tmp_path / "config.json").write_text('{"model": "SeedVR2 causal video VAE", "latent_channels": 16}')
    with pytest.raises(VectorSetError, match="does not describe a VAE"):
        verify_vectors(tmp_path)


def test_verify_builds_a_non_alternating_schedule(tmp_path):
    """The layer schedule comes from config.json, not from layer parity."""
    import json
    cfg = read_config(SET_7B)
    cfg["window_method"] = ["720pswin_by_size_bysize", "720pswin_by_size_bysize",
                            "720pwin_by_size_bysize", "720pswin_by_size_bysize"]
    built = nadit_config(cfg)
    assert built.window_methods[0] == built.window_methods[1] != built.window_methods[2]
    for f in ("weights.safetensors", "io.safetensors"):
        (tmp_path / f).symlink_to(SET_7B / f)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = verify_vectors(tmp_path, degrees=(1,))  # the reference ran the alternating schedule
    assert not result["pass"] and result["runs"][0]["rel_err"] > 1e-3
