"""`ditsp plan --gpu`: the GPU table, the memory against the estimator, and the time model's arithmetic."""

import json

import pytest
import torch

from ditsp.cli import main
from ditsp.models.gpus import NAMES, Gpu, gpu
from ditsp.models.seedvr2.job.budget import estimate
from ditsp.models.seedvr2.job.gpu_sizing import Efficiency, pixels_of_grid, size, size_degree, vae_rank_work
from ditsp.models.seedvr2.job.plan_report import memory_estimate, plan_request
from ditsp.models.seedvr2.job.weight_memory import dit_weights
from ditsp.models.seedvr2.presets import dit_config
from ditsp.models.seedvr2.vae.config import TINY, VaeConfig
from ditsp.models.seedvr2.vae.flops import decoder_work, encoder_work
from ditsp.models.seedvr2.vae.layers import CausalConv3d, Upsample
from ditsp.models.seedvr2.vae.model import VideoVAE

GiB = 2**30
# Round figures, so every modelled second below is arithmetic by hand.
CARD = Gpu("test", "test card", 10, 100, 1.0, "NVLink 4", 10, "test")
EFF = Efficiency(dit=0.5, vae=0.25, memory=0.5, link=0.5, nvlink_latency_s=1e-5, allocator=1.25, context_gib=0.5)


def test_table_rows_are_complete_and_named():
    assert {"h100", "h200", "a100", "l40s", "4090", "5090", "3090"} <= set(NAMES)
    for name in NAMES:
        g = gpu(name.upper())
        assert g.memory_gib > 0 and g.bf16_tflops > 0 and g.memory_tbs > 0 and g.link_gbs > 0 and g.source
        assert g.link.startswith(("NVLink", "PCIe"))
    with pytest.raises(ValueError, match="unknown GPU 'v100'; choose one of"):
        gpu("v100")


def test_vae_flops_by_hand():
    """One block of width 8, one resnet, no time or space change, on a 1x4x4 clip: every conv by hand."""
    cfg = VaeConfig(latent_channels=4, widths=(8,), groups=4, layers_per_block=1, temporal_down_blocks=(),
                    temporal_up_blocks=())
    n = 1 * 4 * 4
    conv_in, conv88 = 2 * 3 * 8 * 27 * n, 2 * 8 * 8 * 27 * n
    attention = 2 * 4 * 8 * 8 * n + 4 * n * n * 8  # q, k, v, out projections; scores and their product with V
    conv_out = 2 * 8 * 8 * 27 * n  # to 2 x 4 latent channels
    # encoder: conv_in, block resnet (2 convs), mid resnet, attention, mid resnet, conv_out
    assert encoder_work(cfg, (1, 4, 4)).flops == conv_in + 6 * conv88 + attention + conv_out
    # decoder: conv_in (4 -> 8), mid resnet, attention, mid resnet, block resnets (2), conv_out (8 -> 3)
    dec_in, dec_out = 2 * 4 * 8 * 27 * n, 2 * 8 * 3 * 27 * n
    assert decoder_work(cfg, (1, 4, 4)).flops == dec_in + 8 * conv88 + attention + dec_out
    # bytes: conv_in reads the 3-channel clip and writes 8 channels, bf16
    assert encoder_work(cfg, (1, 4, 4)).bytes > (3 + 8) * n * 2


def _conv_flops_of_a_forward(cfg, op, shape):
    """Every conv's FLOPs, counted from the shapes a real forward hands its conv modules (an upsampler's 1x1
    projection is a call, not a module's forward: counted from the upsampler's input)."""
    vae, total = VideoVAE(cfg).eval(), [0]

    def hook(mod, inp, out):
        cin, taps = mod.weight.shape[1], mod.weight.shape[2:].numel()
        total[0] += 2 * cin * taps * out.numel()

    def projection(mod, inp, out):
        total[0] += 2 * mod.upscale_conv.out_channels * inp[0].numel()

    for m in vae.modules():
        if isinstance(m, CausalConv3d):
            m.register_forward_hook(hook)
        elif isinstance(m, Upsample):
            m.register_forward_hook(projection)
    x = torch.randn(1, cfg.in_channels if op == "encode" else cfg.latent_channels, *shape)
    with torch.no_grad():
        vae.encode(x) if op == "encode" else vae.decode(x)
    return total[0]


@pytest.mark.parametrize("op,shape", [("encode", (9, 32, 48)), ("decode", (3, 4, 6))])
def test_vae_flops_match_the_networks_convs(op, shape):
    """The walk counts the convs the network runs (the test vectors' VAE: time and space down/up sampling)."""
    work = (encoder_work if op == "encode" else decoder_work)(TINY, shape)
    t, h, w = TINY.latent_shape(*shape) if op == "encode" else shape
    c = TINY.widths[-1]
    attention = t * (2 * 4 * c * c * h * w + 4 * (h * w) ** 2 * c)
    assert work.flops - attention == _conv_flops_of_a_forward(TINY, op, shape)


def test_memory_is_the_estimator_plus_the_plans_dit_peak():
    """1920x1080x81 at SP 4 on an H100: the tensors are budget.estimate's (its VAE mode), the DiT activations the
    larger of the estimator's and the planned forward's, times the allocator factor plus the context."""
    grid, h100 = (21, 67, 120), gpu("h100")
    row = size_degree("seedvr2-3b", grid, 4, "lpt", h100)
    frames, hw = pixels_of_grid(grid, "seedvr2-3b")
    assert (frames, hw) == (81, (1072, 1920))
    w = dit_weights("seedvr2-3b", "bf16", fmt="bf16")
    e = estimate("seedvr2-3b", "bf16", frames, hw, 4, row["vae_mode"], weights=w)
    cfg = dit_config("seedvr2-3b")
    plan = memory_estimate(plan_request(grid, cfg, 4), cfg, weights=w)
    dit = max(e.dit_activations, plan["input"] + plan["peak_added"])
    m = row["memory"]
    assert m["dit_weights"] == e.dit_weights and m["vae"] == e.vae and m["latents"] == e.latents
    assert m["dit_activations"] == dit and m["tensors"] == e.total - e.dit_activations + dit
    assert m["per_rank"] == int(m["tensors"] * 1.10 + GiB) and m["fits"] == (m["per_rank"] <= 80 * GiB)
    assert row["vae_exact"] and m["fits"]


def test_time_model_by_hand():
    """The tiny DiT on one token at SP 1: per layer one token's projections and MLP, and its attention to itself
    and the 11 text tokens; stage seconds are counted work over the card's rate at the stated efficiency."""
    row = size_degree("tiny", (1, 1, 1), 1, "lpt", CARD, eff=EFF)
    d, inner, hidden, layers, txt = 96, 3 * 32, 256, 4, 11
    per_token = 2 * (d * 3 * inner + inner * d + 3 * d * hidden)
    attention = 4 * 1 * (1 + txt) * inner
    assert row["flops"]["dit"] == pytest.approx(layers * (per_token + attention))
    assert row["seconds"]["dit"] == pytest.approx(layers * (per_token + attention) / (100e12 * 0.5))
    assert row["seconds"]["exchange"] == 0 and row["bytes"]["exchange"] == 0  # one rank sends nothing
    for op in ("encode", "decode"):
        f, b = row["flops"][f"vae_{op}"], row["bytes"][f"vae_{op}"]
        assert row["seconds"][f"vae_{op}"] == pytest.approx(max(f / (100e12 * 0.25), b / (1e12 * 0.5)))
    s = row["seconds"]
    assert s["total"] == pytest.approx(s["dit"] + s["vae_encode"] + s["vae_decode"] + s["exchange"])
    m = row["memory"]
    assert m["per_rank"] == int(m["tensors"] * 1.25 + 0.5 * GiB)


def test_exchange_is_the_plans_bytes_over_the_link():
    """At SP 2 the exchange moves the plan's bytes; its time is at least the busiest rank's share over the link
    at the stated efficiency, plus one latency per round."""
    row = size_degree("tiny", (3, 12, 16), 2, "lpt", CARD, eff=EFF)
    assert row["bytes"]["exchange"] > 0
    assert row["seconds"]["exchange"] >= row["bytes"]["exchange"] / 2 / (10e9 * 0.5)


def test_vae_work_splits_with_the_height_modes():
    one = vae_rank_work("seedvr2-3b", "decode", 81, (1072, 1920), 1, "chunked")
    four = vae_rank_work("seedvr2-3b", "decode", 81, (1072, 1920), 4, "height")
    assert 0.25 < four.flops / one.flops < 0.3  # a quarter of the rows plus the whole-frame mid attention


def test_needs_is_the_smallest_degree_that_fits():
    s = size("seedvr2-3b", (21, 67, 120), gpu("4090"), degrees=(1, 2, 4, 8))
    fits = [r["sp"] for r in s["degrees"] if r["memory"]["fits"] and r["vae_exact"]]
    assert s["needs"]["sp"] == min(fits) > 1 and s["needs"]["exact"]
    small = size("seedvr2-3b", (21, 67, 120), Gpu("x", "x", 4, 1, 1, "PCIe 4.0 x16", 1, "test"), degrees=(1, 2))
    assert small["needs"] is None


def test_cli_json_text_and_plot(capsys, tmp_path):
    args = ["plan", "--resolution", "1920x1080", "--frames", "81", "--sp", "4", "--gpu", "h100"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    g = out["gpu"]
    assert [r["sp"] for r in g["degrees"]] == list(range(1, 9)) and g["gpu"]["name"] == "h100"
    assert g["model"]["source"] == "model, not measured"
    row = g["degrees"][3]
    assert row == json.loads(json.dumps(size_degree("seedvr2-3b", (21, 67, 120), 4, "lpt", gpu("h100"))))
    assert set(row["seconds"]) == {"dit", "vae_encode", "vae_decode", "exchange", "total"}
    png = tmp_path / "plan.png"
    assert main([*args, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "GPU sizing on H100 SXM" in text and "model, not measured" in text and "needs: SP " in text
    assert (tmp_path / "plan-gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "--grid", "3,12,16", "--sp", "2", "--model", "tiny", "--json"]) == 0
    assert "gpu" not in json.loads(capsys.readouterr().out)  # without --gpu, the report as before


def test_cli_unknown_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--grid", "3,12,16", "--sp", "2", "--gpu", "v100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown GPU 'v100'" in err and "Traceback" not in err
