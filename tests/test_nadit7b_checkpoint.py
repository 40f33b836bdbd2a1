"""The strict loader on the 7B's keys, and its hardening for both families: dtypes, NaN/Inf, unreadable files."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditsp.models.seedvr2.nadit import TINY, CheckpointError, NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.config import TINY_7B
from ditsp.models.seedvr2.nadit.rope_pixel import pixel_freqs

DATA = Path(__file__).parent / "data"
SETS = {"7b": (TINY_7B, DATA / "nadit-7b-tiny" / "weights.safetensors"),
        "3b": (TINY, DATA / "nadit-3b-tiny" / "weights.safetensors")}


@pytest.fixture(params=sorted(SETS))
def family(request):
    cfg, path = SETS[request.param]
    return cfg, load_file(path)


def test_7b_file_loads_onto_meta_with_the_rope_suffix_rule():
    cfg, path = SETS["7b"]
    sd = load_file(path)
    assert sum(k.endswith(".rope.rope.freqs") for k in sd) == 4 and len(sd) == 136
    with torch.device("meta"):
        model = NaDiT(cfg)
    report = load_checkpoint(model, path)
    assert report.loaded == 136 and report.renamed == 4
    assert model.blocks[2].attn.rope.freqs.dtype == torch.float32
    assert not any(t.is_meta for t in model.state_dict().values())


def test_bf16_rope_buffer_is_checked_then_replaced_by_fp32_values():
    cfg, path = SETS["7b"]
    sd = load_file(path)
    sd = {k: v.to(torch.bfloat16) if k.endswith(".freqs") else v for k, v in sd.items()}
    model = NaDiT(cfg)
    load_checkpoint(model, sd)
    assert torch.equal(model.blocks[0].attn.rope.freqs, pixel_freqs(16))  # not the bf16-rounded 402.0
    sd["blocks.1.attn.rope.rope.freqs"] = torch.tensor([3.1415927, 400.0])
    with pytest.raises(CheckpointError, match="blocks.1.attn.rope.freqs"):
        load_checkpoint(NaDiT(cfg), sd)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_precisions_are_cast(family, dtype):
    cfg, sd = family
    model = NaDiT(cfg)
    load_checkpoint(model, {k: v.to(dtype) for k, v in sd.items()})
    w = "txt_in.weight"
    assert model.state_dict()[w].dtype == torch.float32
    assert torch.equal(model.state_dict()[w], sd[w].to(dtype).float())


def test_non_finite_values_are_listed(family):
    cfg, sd = family
    sd = dict(sd)
    sd["txt_in.weight"] = sd["txt_in.weight"].clone()
    sd["txt_in.weight"][0, 0] = float("nan")
    sd["vid_out.proj.bias"] = sd["vid_out.proj.bias"].clone()
    sd["vid_out.proj.bias"][:2] = float("inf")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(cfg), sd)
    msg = str(err.value)
    assert "non-finite (2)" in msg
    assert "txt_in.weight: 1 NaN, 0 Inf" in msg and "vid_out.proj.bias: 0 NaN, 2 Inf" in msg


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_non_float_tensors_are_rejected(family, dtype):
    cfg, sd = family
    sd = dict(sd)
    sd["emb_in.proj_in.bias"] = sd["emb_in.proj_in.bias"].to(dtype)
    sd["txt_in.bias"] = sd["txt_in.bias"].to(dtype)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(cfg), sd)
    lines = str(err.value).splitlines()
    assert "  wrong dtype (2):" in lines
    name = str(dtype).removeprefix("torch.")
    assert f"    txt_in.bias: checkpoint {name}, model float32 (a float tensor is required)" in lines


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY_7B), tmp_path / "nope.safetensors")
    assert str(err.value) == f"{tmp_path / 'nope.safetensors'}: no such checkpoint file"


@pytest.mark.parametrize("name", ["junk.pth", "junk.safetensors"])
def test_unreadable_file_is_one_line(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY_7B), path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: unreadable checkpoint") and "\n" not in msg and "weights_only" not in msg


def test_pickled_object_is_not_a_state_dict(tmp_path):
    path = tmp_path / "obj.pth"
    torch.save({"model": torch.nn.Linear(2, 2)}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY_7B), path)
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value)


def test_3b_file_does_not_load_into_the_7b():
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY_7B), SETS["3b"][1])
    msg = str(err.value)
    assert "  missing (68):" in msg and "  unexpected (" in msg  # MLP biases / text copies vs proj_in_gate, .all.
    assert "blocks.3.attn.rope.freqs: checkpoint (5,), model (2,)" in msg
