"""Strict VAE checkpoint loading: formats, dtypes, and a clear error for every kind of mismatch."""

import pytest
import torch
from safetensors.torch import save_file

from ditsp.models.seedvr2.vae import RELEASED, TINY, CheckpointError, VideoVAE, load_checkpoint
from ditsp.models.seedvr2.vae.fixtures import seeded_vae


@pytest.fixture(scope="module")
def sd():
    return {k: v.clone() for k, v in seeded_vae(TINY).state_dict().items()}


def test_released_structure_key_count_and_parameters():
    with torch.device("meta"):
        m = VideoVAE(RELEASED)
    sd = m.state_dict()
    assert len(sd) == 250
    assert sum(v.numel() for v in sd.values()) == 250_648_227
    assert sum(v.numel() for k, v in sd.items() if k.startswith("encoder.")) == 100_046_496
    assert sd["decoder.up_blocks.0.upsamplers.0.upscale_conv.weight"].shape == (4096, 512, 1, 1, 1)
    assert sd["encoder.down_blocks.0.downsamplers.0.conv.weight"].shape == (128, 128, 1, 3, 3)


@pytest.mark.parametrize("fmt,dtype", [("pth", torch.float32), ("safetensors", torch.float16),
                                       ("pth", torch.bfloat16)])
def test_round_trip_formats_and_dtypes(tmp_path, sd, fmt, dtype):
    path = tmp_path / f"ema_vae.{fmt}"
    data = {k: v.to(dtype) for k, v in sd.items()}
    save_file(data, path) if fmt == "safetensors" else torch.save(data, path)
    m = VideoVAE(TINY)
    assert load_checkpoint(m, path) == 250
    got = m.state_dict()
    assert all(torch.equal(got[k], data[k].float()) for k in sd)
    mb = VideoVAE(TINY)
    load_checkpoint(mb, path, dtype=torch.bfloat16)
    assert mb.encoder.conv_in.weight.dtype == torch.bfloat16


def test_legacy_attention_names_are_renamed(sd):
    legacy = {k.replace(".to_q.", ".query."): v for k, v in sd.items()}
    assert any(".query." in k for k in legacy)
    assert load_checkpoint(VideoVAE(TINY), legacy) == 250


def _broken(sd, kind):
    bad = dict(sd)
    if kind == "missing":
        del bad["decoder.conv_out.bias"]
    elif kind == "unexpected":
        bad["encoder.quant_conv.weight"] = torch.zeros(1)
    elif kind == "mis-shaped":
        bad["encoder.conv_in.weight"] = torch.zeros(16, 3, 1, 3, 3)
    elif kind == "non-finite":
        bad["encoder.mid_block.attentions.0.to_q.weight"] = sd["encoder.mid_block.attentions.0.to_q.weight"].clone()
        bad["encoder.mid_block.attentions.0.to_q.weight"][0, 0] = float("nan")
    elif kind == "not float":
        bad["decoder.conv_in.bias"] = sd["decoder.conv_in.bias"].to(torch.int32)
    return bad


@pytest.mark.parametrize("kind,key", [
    ("missing", "decoder.conv_out.bias"),
    ("unexpected", "encoder.quant_conv.weight"),
    ("mis-shaped", "encoder.conv_in.weight: checkpoint (16, 3, 1, 3, 3), model (16, 3, 3, 3, 3)"),
    ("non-finite", "encoder.mid_block.attentions.0.to_q.weight: 1 non-finite"),
    ("not float", "decoder.conv_in.bias: torch.int32"),
])
def test_mismatches_fail_with_the_key(sd, kind, key):
    m = VideoVAE(TINY)
    before = m.encoder.conv_in.weight.clone()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(m, _broken(sd, kind))
    assert f"{kind} (1)" in str(e.value) and key in str(e.value)
    assert torch.equal(m.encoder.conv_in.weight, before), "nothing is loaded on failure"


def test_pth_must_be_a_flat_state_dict(tmp_path):
    p = tmp_path / "x.pth"
    torch.save({"a": 1}, p)
    with pytest.raises(CheckpointError, match="flat state_dict"):
        load_checkpoint(VideoVAE(TINY), p)
