"""Strict checkpoint loader: both formats, the RoPE suffix, every failure mode, truncation, text embeddings."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ditsp.models.seedvr2.nadit import TINY, CheckpointError, NaDiT, load_checkpoint, load_text_embedding
from ditsp.models.seedvr2.nadit.checkpoint import normalize_keys
from ditsp.models.seedvr2.nadit.model import build_model, init_random_

DATA = Path(__file__).parent / "data" / "nadit-3b-tiny"


def reference_state_dict(model) -> dict:
    """The model's state_dict under the reference's names (``.rope.rope.freqs``)."""
    return {(k[: -len(".rope.freqs")] + ".rope.rope.freqs" if k.endswith(".rope.freqs") else k): v.clone()
            for k, v in model.state_dict().items()}


def save(sd, path: Path) -> Path:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    else:
        torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def source():
    return init_random_(NaDiT(TINY), seed=7)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_round_trip_with_the_reference_suffix(tmp_path, source, suffix):
    path = save(reference_state_dict(source), tmp_path / f"ckpt{suffix}")
    model = NaDiT(TINY)
    report = load_checkpoint(model, path)
    assert report.loaded == len(source.state_dict()) and report.renamed == TINY.num_layers
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_loads_the_reference_vectors_file_onto_meta():
    with torch.device("meta"):
        model = NaDiT(TINY)
    load_checkpoint(model, DATA / "weights.safetensors")
    assert not any(t.is_meta for t in model.state_dict().values())


def test_already_normalised_keys_are_left_alone(source):
    sd, renamed = normalize_keys(source.state_dict())
    assert renamed == 0 and list(sd) == list(source.state_dict())
    load_checkpoint(NaDiT(TINY), source.state_dict())
    # only the exact suffix is renamed
    sd, renamed = normalize_keys({"a.rope.rope.freqs_ema": torch.zeros(1), "b.rope.rope.freqs": torch.zeros(1)})
    assert renamed == 1 and set(sd) == {"a.rope.rope.freqs_ema", "b.rope.freqs"}


def test_collision_raises(source):
    sd = reference_state_dict(source)
    sd["blocks.0.attn.rope.freqs"] = sd["blocks.0.attn.rope.rope.freqs"].clone()
    with pytest.raises(CheckpointError, match="both map to 'blocks.0.attn.rope.freqs'"):
        load_checkpoint(NaDiT(TINY), sd)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_every_problem_is_listed(tmp_path, source, suffix):
    sd = reference_state_dict(source)
    del sd["blocks.1.mlp.vid.proj_in.weight"]
    sd["blocks.1.extra.weight"] = torch.zeros(3)
    sd["txt_in.weight"] = torch.zeros(TINY.vid_dim, 4096)
    model = NaDiT(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, save(sd, tmp_path / f"bad{suffix}"))
    msg = str(err.value)
    assert "missing (1):\n    blocks.1.mlp.vid.proj_in.weight" in msg
    assert "unexpected (1):\n    blocks.1.extra.weight" in msg
    assert "mis-shaped (1):\n    txt_in.weight: checkpoint (96, 4096), model (96, 5120)" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing loaded on failure"


@pytest.mark.parametrize("problem", ["missing", "unexpected", "mis-shaped"])
def test_each_failure_mode_alone(source, problem):
    sd = reference_state_dict(source)
    if problem == "missing":
        del sd["vid_out_ada.out_scale"]
    elif problem == "unexpected":
        sd["vid_out_ada.out_gate"] = torch.zeros(TINY.vid_dim)
    else:
        sd["blocks.2.attn.norm_q.all.weight"] = torch.zeros(16)
    with pytest.raises(CheckpointError, match=f"{problem} \\(1\\)"):
        load_checkpoint(NaDiT(TINY), sd)


def test_wrong_rope_frequencies_raise(source):
    sd = reference_state_dict(source)
    sd["blocks.3.attn.rope.rope.freqs"] = sd["blocks.3.attn.rope.rope.freqs"] * 1.01
    with pytest.raises(CheckpointError, match="blocks.3.attn.rope.freqs"):
        load_checkpoint(NaDiT(TINY), sd)


def test_half_precision_checkpoint_keeps_analytic_rope(source):
    sd = {k: v.half() for k, v in reference_state_dict(source).items()}
    model = NaDiT(TINY)
    load_checkpoint(model, sd)
    assert model.blocks[0].attn.rope.freqs.dtype == torch.float32
    assert torch.equal(model.blocks[0].attn.rope.freqs, NaDiT(TINY).blocks[0].attn.rope.freqs)


def test_truncation_needs_the_flag():
    with pytest.raises(CheckpointError, match="allow_truncated=True"):
        load_checkpoint(NaDiT(TINY.with_layers(3)), DATA / "weights.safetensors")
    full = build_model(TINY, checkpoint=DATA / "weights.safetensors")
    for layers in (3, 2):
        model = NaDiT(TINY.with_layers(layers))
        report = load_checkpoint(model, DATA / "weights.safetensors", allow_truncated=True)
        assert all(k.startswith(tuple(f"blocks.{i}." for i in range(layers - 1, 4))) for k in report.dropped)
        for k, v in model.state_dict().items():
            assert torch.equal(v, full.state_dict()[k]), k
    # the flag does not excuse anything else
    sd = reference_state_dict(full)
    del sd["blocks.0.attn.proj_out.vid.bias"]
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(NaDiT(TINY.with_layers(2)), sd, allow_truncated=True)


def test_fewer_blocks_in_the_checkpoint_than_the_model_fail(source):
    sd = {k: v for k, v in reference_state_dict(source).items() if not k.startswith("blocks.3.")}
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(NaDiT(TINY), sd, allow_truncated=True)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_text_embedding(tmp_path, suffix):
    emb = torch.randn(58, 5120).to(torch.bfloat16)
    path = tmp_path / f"pos_emb{suffix}"
    save_file({"emb": emb}, path) if suffix == ".safetensors" else torch.save(emb, path)
    got = load_text_embedding(path, txt_in_dim=5120)
    assert got.dtype == torch.bfloat16 and torch.equal(got, emb)
    with pytest.raises(CheckpointError, match="text embedding"):
        load_text_embedding(path, txt_in_dim=4096)
