"""The 7B family: its size on the meta device, and one focused test per way it differs from the 3B.

Each difference test would fail if that part were built the 3B way."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ditsp.models.seedvr2.nadit import PRESETS, SEEDVR2_3B, TINY, NaDiT, get_config, load_checkpoint
from ditsp.models.seedvr2.nadit.blocks_7b import GeluTanhMLP
from ditsp.models.seedvr2.nadit.config import SEEDVR2_7B, TINY_7B
from ditsp.models.seedvr2.nadit.model import build_model, random_inputs, unpatchify
from ditsp.models.seedvr2.nadit.rope import MMRope3d
from ditsp.models.seedvr2.nadit.rope_pixel import PixelRope3d, pixel_freqs, window_positions
from ditsp.models.seedvr2.parallelize import single_runtime

DATA = Path(__file__).parent / "data" / "nadit-7b-tiny"


def test_presets():
    assert get_config("seedvr2-7b") is SEEDVR2_7B and get_config("tiny-7b") is TINY_7B
    assert {"seedvr2-3b", "tiny", "small", "seedvr2-7b", "tiny-7b"} <= set(PRESETS)
    assert (SEEDVR2_7B.vid_dim, SEEDVR2_7B.heads, SEEDVR2_7B.head_dim, SEEDVR2_7B.num_layers) == (3072, 24, 128, 36)
    assert SEEDVR2_7B.emb_dim == 18432 and SEEDVR2_7B.mlp_hidden == 12288 and SEEDVR2_7B.rope_channels == 60
    assert SEEDVR2_7B.with_layers(6).num_layers == 6 and SEEDVR2_7B.with_layers(6).separate_weights(5)


def test_full_7b_on_meta():
    with torch.device("meta"):
        model = NaDiT(SEEDVR2_7B)
    sd = model.state_dict()
    assert len(sd) == 1128
    n = sum(p.numel() for p in model.parameters())
    assert n == 8_239_607_872 == SEEDVR2_7B.param_count()
    assert not any(".all." in k for k in sd)
    assert sum(k.endswith(".rope.freqs") for k in sd) == 36 and sd["blocks.0.attn.rope.freqs"].shape == (10,)
    assert sd["blocks.35.mlp.txt.proj_in.bias"].shape == (12288,)  # the last block keeps its text MLP
    assert not any(k.startswith(("vid_out_norm", "vid_out_ada")) for k in sd)


def test_param_count_matches_the_3b_module():
    for cfg in (SEEDVR2_3B, TINY):
        with torch.device("meta"):
            model = NaDiT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.param_count()


def test_pixel_rope_frequencies_positions_and_channels():
    assert torch.allclose(pixel_freqs(64), math.pi * torch.linspace(1, 128, 10))
    assert pixel_freqs(64)[-1].item() == pytest.approx(402.12387, rel=1e-6)
    assert window_positions(1).tolist() == [-1.0]  # a length-1 axis sits at -1, not 0
    assert torch.allclose(window_positions(3), torch.tensor([-1.0, 0.0, 1.0]))
    rope = PixelRope3d(16)  # the tiny 7B: head_dim 32, 2 frequencies, 12 rotated channels
    f = rope.analytic_freqs()
    shape = (2, 3, 5)
    x = torch.randn(1, 30, 1, 32)
    y = rope.video(x, shape, 11)
    assert torch.equal(y[..., 12:], x[..., 12:])  # channels past 6n pass through
    assert torch.equal(rope.text(x), x)  # text is never rotated
    # token (i, j, k) of a (2, 3, 5) window: positions linspace(-1,1,extent), no text offset
    i, j, k = 1, 2, 3
    row = (i * 3 + j) * 5 + k
    pos = [window_positions(n)[p] for n, p in zip(shape, (i, j, k))]
    want = x[0, row, 0].clone()
    for axis, p in enumerate(pos):
        for q in range(2):  # interleaved pairs (b + 2q, b + 2q + 1)
            c = 4 * axis + 2 * q
            th = p * f[q]
            x0, x1 = x[0, row, 0, c], x[0, row, 0, c + 1]
            want[c], want[c + 1] = x0 * th.cos() - x1 * th.sin(), x1 * th.cos() + x0 * th.sin()
    assert torch.allclose(y[0, row, 0], want, atol=1e-6)
    # the same grid token in a smaller window gets other positions: they depend on the window's extent
    assert not torch.allclose(rope.video(x[:, :6], (2, 3, 1), 0)[0, 5], y[0, 5])


def test_rope_freqs_stay_fp32_and_analytic_in_a_bf16_model():
    model = build_model("tiny-7b", dtype=torch.bfloat16)
    freqs = model.blocks[0].attn.rope.freqs
    assert freqs.dtype == torch.float32 and torch.equal(freqs, pixel_freqs(16))
    assert model.blocks[0].attn.proj_qkv["vid"].weight.dtype == torch.bfloat16


def test_gelu_tanh_mlp_with_biases():
    mlp = GeluTanhMLP(8, 32)
    assert mlp.proj_in.bias is not None and mlp.proj_out.bias is not None
    x = torch.randn(5, 8) * 3
    h = mlp.proj_in(x)
    tanh = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    assert torch.allclose(mlp(x), mlp.proj_out(tanh), atol=1e-6)
    assert not torch.allclose(mlp(x), mlp.proj_out(F.gelu(h)), atol=1e-6)  # exact-erf GELU is wrong here


@pytest.fixture(scope="module")
def reference():
    model = NaDiT(TINY_7B).eval()
    load_checkpoint(model, DATA / "weights.safetensors")
    return model, load_file(DATA / "io.safetensors")


@torch.no_grad()
def test_no_output_norm_or_modulation(reference):
    """vid_out.proj acts on the last block's video state itself."""
    model, io = reference
    y = model.vid_out.proj(io["block3.vid"].reshape(-1, 96))
    out = unpatchify(y, (5, 20, 36), (1, 2, 2))
    assert ((out - io["vid_out"]).abs().max() / io["vid_out"].abs().max()).item() <= 1e-5
    assert not hasattr(model, "vid_out_norm") and not hasattr(model, "vid_out_ada")


@torch.no_grad()
def test_last_block_modulates_its_text(reference):
    """The 7B's last block modulates the text entering its attention (the 3B leaves it raw)."""
    model, io = reference
    one = single_runtime(model.cfg, model.grid_of(io["vid_in"].shape))
    base = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
    ada = model.blocks[3].ada["txt"]
    old = ada.attn_shift.clone()
    try:
        ada.attn_shift += 0.1
        moved = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
    finally:
        ada.attn_shift.copy_(old)
    assert (moved - base).abs().max() > 1e-3 * base.abs().max()


@torch.no_grad()
def test_text_stream_has_its_own_weights(reference):
    """Every block's text uses its own qkv (3B-style shared blocks would use the video's)."""
    model, io = reference
    sd = model.state_dict()
    for i in range(4):
        assert not torch.equal(sd[f"blocks.{i}.attn.proj_qkv.txt.weight"], sd[f"blocks.{i}.attn.proj_qkv.vid.weight"])
    one = single_runtime(model.cfg, model.grid_of(io["vid_in"].shape))
    base = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
    w = model.blocks[3].attn.proj_qkv["txt"].weight
    old = w.clone()
    try:
        w.mul_(1.1)
        moved = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
    finally:
        w.copy_(old)
    assert (moved - base).abs().max() > 1e-4 * base.abs().max()


def test_random_tiny_7b_runs_in_bf16():
    model = build_model("tiny-7b", dtype=torch.bfloat16)
    vid, txt = random_inputs(model.cfg, (2, 4, 6), txt_len=5)
    with torch.no_grad():
        out = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, (2, 4, 6)))
    assert out.shape == (2, 8, 12, 16) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_plan_reports_the_7b(capsys):
    import json

    from ditsp.cli import main
    assert main(["plan", "--model", "seedvr2-7b", "--grid", "21,45,80", "--sp", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "seedvr2-7b" and out["layers"] == 36 and not out["ulysses_heads_divisible"]
    assert main(["plan", "--model", "seedvr2-3b", "--grid", "21,45,80", "--sp", "5", "--json"]) == 0
    out3 = json.loads(capsys.readouterr().out)
    # dims feed through: 3072-wide, 36-layer traffic exceeds the 3B's 2560-wide, 32-layer traffic
    assert out["bytes_per_forward"]["ulysses"] > out3["bytes_per_forward"]["ulysses"]
    assert out["bytes_per_forward"]["window_sp"] > out3["bytes_per_forward"]["window_sp"]
