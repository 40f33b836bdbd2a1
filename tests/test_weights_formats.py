"""The distributed weight formats: FP8 safetensors (plain, mixed, scaled, e5m2) and GGUF (Q8_0, a
Q4_K_M mix) for the DiT and the VAE, built from the tiny seeded weights with the real files'
naming rules; kept quantized on the rank, dequantized per layer; strict names; SP 1 and 2.

Two comparisons per format: against the same model with the *dequantized* weights in float (the
per-layer mechanism itself: fp32 rounding only, 1e-5) and against the float source (the
quantization's error, bounded at about twice what it measures here; docs/performance.md).
"""

from __future__ import annotations

import pytest
import torch

from ditsp.config import ParallelConfig
from ditsp.distributed.comm import Comm
from ditsp.models.seedvr2.nadit import TINY, CheckpointError, NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.model import build_model, init_random_, random_inputs
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime
from ditsp.models.seedvr2.vae import TINY as VAE_TINY
from ditsp.models.seedvr2.vae import CheckpointError as VaeCheckpointError
from ditsp.models.seedvr2.vae import VideoVAE
from ditsp.models.seedvr2.vae import load_checkpoint as load_vae
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.models.seedvr2.vae.sharded import ParallelVAE
from ditsp.weights import formats_held, held_bytes, is_quantized, max_buffer_bytes, quantized_weights
from ditsp.weights.convert import save_fp8, save_gguf
from ditsp.weights.gguf_write import q4_k_m, q8_0, write_gguf

pytestmark = pytest.mark.timeout(240)
GRID = (3, 8, 12)

# format -> (writer, bound on max|out - float| / max|float| of the DiT output, of the VAE decode)
DIT_FORMATS = {
    "fp8_e4m3fn": (lambda sd, p: save_fp8(sd, p / "dit_fp8_e4m3fn.safetensors"), 0.10),
    "fp8_e4m3fn_mixed_last_block_fp16": (
        lambda sd, p: save_fp8(sd, p / "dit_mixed.safetensors", keep=lambda k: k.startswith("blocks.3.")), 0.10),
    "fp8_e4m3fn_scaled": (lambda sd, p: save_fp8(sd, p / "dit_scaled.safetensors", scaled=True), 0.10),
    "fp8_e5m2_scaled": (lambda sd, p: save_fp8(sd, p / "dit_e5m2.safetensors", "fp8_e5m2", scaled=True), 0.20),
    "Q8_0": (lambda sd, p: save_gguf(sd, p / "dit-Q8_0.gguf", q8_0), 0.02),
    "Q4_K_M": (lambda sd, p: save_gguf(sd, p / "dit-Q4_K_M.gguf", q4_k_m), 0.12),
}


def rel(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def reference_names(model) -> dict:
    """The DiT's tensors under the distributed files' names (the reference's, ``.rope.rope.freqs``)."""
    return {(k[: -len(".rope.freqs")] + ".rope.rope.freqs" if k.endswith(".rope.freqs") else k): v.detach().clone()
            for k, v in model.state_dict().items()}


def dequantized_copy(model, cls, cfg):
    """A float model holding exactly the weights ``model`` computes with (its dequantized weights)."""
    out = cls(cfg)
    sd = {}
    for k in out.state_dict():
        mod_name, _, leaf = k.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        sd[k] = getattr(mod, leaf).detach().float()
    out.load_state_dict(sd)
    return out.eval()


@pytest.fixture(scope="module")
def dit_source():
    return init_random_(NaDiT(TINY), seed=7).eval()


@pytest.fixture(scope="module")
def inputs():
    return random_inputs(TINY, GRID, seed=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory, dit_source):
    d = tmp_path_factory.mktemp("formats")
    sd = reference_names(dit_source)
    return {name: str(w(sd, d)) for name, (w, _) in DIT_FORMATS.items()}


# ------------------------------------------------------------------------------------- DiT


@pytest.mark.parametrize("fmt", list(DIT_FORMATS))
def test_dit_formats_stay_quantized_and_match_float(files, dit_source, inputs, fmt, one_thread):
    model = build_model(TINY, checkpoint=files[fmt])
    held = formats_held(model)
    assert held and is_quantized(model)
    if fmt.startswith("fp8"):
        assert set(held) == {fmt.split("_scaled")[0].split("_mixed")[0]}
    else:
        assert set(held) <= {"Q8_0", "Q4_K", "Q6_K"} and (fmt != "Q4_K_M" or "Q4_K" in held)
    if "mixed" in fmt:  # the last block stays in float, as the *_mixed_block35_fp16 file's
        assert not any(n.startswith("blocks.3.") for n, *_ in quantized_weights(model))
        assert any(n.startswith("blocks.2.") for n, *_ in quantized_weights(model))
    assert held_bytes(model) < 0.45 * held_bytes(dit_source)
    vid, txt = inputs
    one = single_runtime(TINY, model.grid_of(vid.shape))
    with torch.no_grad():
        out = model(vid, txt, 1000.0, runtime=one)
        exact = dequantized_copy(model, NaDiT, TINY)(vid, txt, 1000.0, runtime=one)
        ref = dit_source(vid, txt, 1000.0, runtime=one)
    assert rel(out, exact) <= 1e-5  # per-layer dequantization is the dequantized model
    assert 0 < rel(out, ref) <= DIT_FORMATS[fmt][1]
    assert held_bytes(model) == sum(t.numel() * t.element_size() for t in model.state_dict().values()), \
        "no dequantized copy outlives a forward"


def test_weights_dtype_fp8_quantizes_a_float_checkpoint_at_load(tmp_path, dit_source, inputs, one_thread):
    from safetensors.torch import save_file

    path = tmp_path / "dit_fp16.safetensors"
    save_file({k: v.half().contiguous() for k, v in reference_names(dit_source).items()}, path)
    model = build_model(TINY, checkpoint=str(path), dtype=torch.bfloat16, weights_dtype="fp8")
    assert formats_held(model) == {"fp8_e4m3fn": 36}
    assert all(p.probe.dtype == torch.bfloat16 for _, _, p, _ in quantized_weights(model))
    vid, txt = inputs
    one = single_runtime(TINY, model.grid_of(vid.shape))
    with torch.no_grad():
        out = model(vid, txt, 1000.0, runtime=one).float()
        ref = dit_source(vid, txt, 1000.0, runtime=one)
    assert rel(out, ref) <= 0.10
    # the same switch on seeded weights (no file)
    assert formats_held(build_model(TINY, weights_dtype="fp8_e5m2")) == {"fp8_e5m2": 36}
    assert max_buffer_bytes(model) == max(p.spec.numel for _, _, p, _ in quantized_weights(model)) * 2


def test_gguf_layout_as_distributed(files):
    """Names carry ``model.diffusion_model.``; shapes are GGUF's reversed dims."""
    import gguf

    r = gguf.GGUFReader(files["Q8_0"])
    names = [t.name for t in r.tensors]
    assert all(n.startswith("model.diffusion_model.") for n in names)
    t = next(t for t in r.tensors if t.name == "model.diffusion_model.txt_in.weight")
    assert t.tensor_type.name == "Q8_0" and tuple(reversed(t.shape.tolist())) == (TINY.vid_dim, TINY.txt_in_dim)


def test_gguf_strictness(tmp_path, dit_source):
    sd = reference_names(dit_source)
    bad = dict(sd)
    del bad["blocks.1.mlp.vid.proj_in.weight"]
    bad["blocks.1.extra.weight"] = torch.zeros(32, 32)
    bad["txt_in.weight"] = torch.zeros(TINY.vid_dim, 4096)
    path = save_gguf(bad, tmp_path / "bad.gguf", q8_0)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY), path)
    msg = str(err.value)
    assert "missing (1):\n    blocks.1.mlp.vid.proj_in.weight" in msg
    assert "unexpected (1):\n    blocks.1.extra.weight" in msg
    assert "mis-shaped (1):\n    txt_in.weight: checkpoint (96, 4096), model (96, 5120)" in msg
    # a prefix on some tensors only is one line
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "seedvr2")
    w.add_tensor("model.diffusion_model.a", torch.zeros(4).numpy())
    w.add_tensor("b", torch.zeros(4).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(NaDiT(TINY), tmp_path / "mixed.gguf")
    assert "named model.diffusion_model.* but 1 are not (b)" in str(err.value) and "\n" not in str(err.value)
    # the prefix is optional (a file without it loads the same)
    bare = write_gguf(tmp_path / "bare.gguf", [(k, v, q8_0(k, v.shape)) for k, v in sd.items()], prefix="")
    assert formats_held(build_model(TINY, checkpoint=bare)) == {"Q8_0": 36}


def test_fp8_scales_and_values_are_checked(tmp_path, dit_source):
    from safetensors.torch import load_file, save_file

    path = save_fp8(reference_names(dit_source), tmp_path / "s.safetensors", scaled=True)
    sd = load_file(path)
    sd["vid_out_ada.out_scale.scale_weight"] = torch.tensor(2.0)  # a scale with no FP8 weight
    raw = sd["txt_in.weight"].view(torch.uint8).clone()
    raw[0, :3] = 0x7F  # e4m3fn NaN
    sd["txt_in.weight"] = raw.view(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected \(1\):\n    vid_out_ada.out_scale.scale_weight"):
        load_checkpoint(NaDiT(TINY), tmp_path / "bad.safetensors")
    del sd["vid_out_ada.out_scale.scale_weight"]
    save_file(sd, tmp_path / "nan.safetensors")
    model = NaDiT(TINY)
    with pytest.raises(CheckpointError, match=r"non-finite \(1\):\n    txt_in.weight: 3 NaN, 0 Inf"):
        load_checkpoint(model, tmp_path / "nan.safetensors")
    assert not is_quantized(model), "nothing is loaded on failure"


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_e5m2"])
def test_scaled_fp8_without_its_scales_is_refused(tmp_path, dit_source, fmt):
    """#44 item 2: a file marked scaled_fp8 with scale keys missing loaded them at scale 1 (12 dB off)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(save_fp8(reference_names(dit_source), tmp_path / "s.safetensors", fmt, scaled=True))
    del sd["txt_in.scale_weight"], sd["blocks.0.attn.proj_out.vid.scale_weight"]
    save_file(sd, tmp_path / "unscaled.safetensors")
    model = NaDiT(TINY)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(model, tmp_path / "unscaled.safetensors")
    msg = str(e.value)
    assert "\n" not in msg and "marked scaled_fp8 but 2 FP8 tensor(s) have no scale" in msg
    assert "blocks.0.attn.proj_out.vid.weight, txt_in.weight" in msg
    assert not is_quantized(model)
    del sd["scaled_fp8"]  # no marker: a plain FP8 file, scale 1 by definition
    save_file(sd, tmp_path / "plain.safetensors")
    load_checkpoint(NaDiT(TINY), tmp_path / "plain.safetensors")


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf"), float("nan")])
@pytest.mark.parametrize("vae", [False, True])
def test_fp8_scales_that_are_not_finite_positive_are_refused(tmp_path, dit_source, bad, vae):
    """#44 item 2: a scale of 0 silently zeroed the weight (a negative one flips it): refused by name."""
    from safetensors.torch import load_file, save_file

    src = seeded_vae(VAE_TINY).state_dict() if vae else reference_names(dit_source)
    sd = load_file(save_fp8(src, tmp_path / "s.safetensors", scaled=True))
    key = "decoder.conv_out.scale_weight" if vae else "txt_in.scale_weight"
    sd[key] = torch.tensor(bad)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(VaeCheckpointError if vae else CheckpointError) as e:
        if vae:
            load_vae(VideoVAE(VAE_TINY), tmp_path / "bad.safetensors")
        else:
            load_checkpoint(NaDiT(TINY), tmp_path / "bad.safetensors")
    assert str(e.value) == f"FP8 scales must be finite numbers > 0; 1 are not: {key} = {bad!r}"


def test_quantized_model_casts_and_moves_as_a_whole(files, inputs):
    model = build_model(TINY, checkpoint=files["fp8_e4m3fn"])
    raw = {n: o.clone() for n, _, _, o in quantized_weights(model)}
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.txt_in.weight.dtype == torch.bfloat16
    assert all(torch.equal(o, raw[n]) for n, _, _, o in quantized_weights(model)), "stored bytes untouched"
    vid, txt = inputs
    with torch.no_grad():
        assert model(vid, txt, 1000.0, runtime=single_runtime(TINY, model.grid_of(vid.shape))).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------- VAE

# The seeded tiny VAE amplifies weight error (measured decode error: scaled e4m3 0.11, Q8_0 0.038,
# Q4_K_M 0.18; unscaled e4m3 0.36, its small kernels fall in FP8's subnormal range); bounds ~2x.

VAE_FORMATS = {
    "fp8_e4m3fn": (lambda sd, p: save_fp8(sd, p / "vae_fp8.safetensors", scaled=True), 0.22),
    "Q8_0": (lambda sd, p: save_gguf(sd, p / "vae-Q8_0.gguf", q8_0, prefix=""), 0.08),
    "Q4_K_M": (lambda sd, p: save_gguf(sd, p / "vae-Q4_K_M.gguf", q4_k_m, prefix=""), 0.35),
}


@pytest.fixture(scope="module")
def vae_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vae")
    sd = seeded_vae(VAE_TINY).state_dict()
    return {k: str(w(sd, d)) for k, (w, _) in VAE_FORMATS.items()}


def latent(seed=2):
    return torch.randn(1, 16, 2, 4, 5, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", list(VAE_FORMATS))
def test_vae_formats_quantize_convolutions_and_match_float(vae_files, fmt, one_thread):
    with torch.device("meta"):
        vae = VideoVAE(VAE_TINY)
    load_vae(vae, vae_files[fmt])
    names = [n for n, *_ in quantized_weights(vae)]
    assert any(n.endswith("conv1.weight") for n in names) and any(".upscale_conv." in n for n in names)
    assert any(".to_q." in n for n in names)
    src = seeded_vae(VAE_TINY)
    z = latent()
    with torch.no_grad():
        out = vae.decode(z)
        exact = dequantized_copy(vae, VideoVAE, VAE_TINY).decode(z)
        ref = src.decode(z)
    assert rel(out, exact) <= 1e-5
    assert 0 < rel(out, ref) <= VAE_FORMATS[fmt][1]


def test_vae_strictness_lists_keys_for_gguf(tmp_path):
    sd = seeded_vae(VAE_TINY).state_dict()
    del sd["decoder.conv_out.bias"]
    sd["encoder.conv_in.weight"] = torch.zeros(16, 3, 1, 3, 3)
    path = save_gguf(sd, tmp_path / "bad.gguf", q8_0, prefix="")
    with pytest.raises(VaeCheckpointError) as e:
        load_vae(VideoVAE(VAE_TINY), path)
    assert "missing (1)" in str(e.value) and "decoder.conv_out.bias" in str(e.value)
    assert "encoder.conv_in.weight: checkpoint (16, 3, 1, 3, 3), model (16, 3, 3, 3, 3)" in str(e.value)


# ------------------------------------------------------------------------------------- SP


@torch.no_grad()
def quantized_sp_forward(ctx, dit_path, vae_path):
    torch.set_num_threads(1)
    model = build_model(TINY, checkpoint=dit_path)
    vid, txt = random_inputs(TINY, GRID, seed=1)
    rt = parallelize(TINY, ParallelConfig(ulysses_degree=ctx.world_size), GRID, ctx.group)
    out = model(vid, txt, 1000.0, runtime=rt)
    with torch.device("meta"):
        vae = VideoVAE(VAE_TINY)
    load_vae(vae, vae_path)
    dec = ParallelVAE(vae, Comm(ctx.group)).decode(latent(), mode="height")
    one = ParallelVAE(vae).decode(latent(), mode="replicated")
    return out, rel(dec, one)


@pytest.mark.parametrize("dit_fmt,vae_fmt", [("Q4_K_M", "Q8_0"), ("fp8_e4m3fn_scaled", "fp8_e4m3fn")])
def test_quantized_weights_under_sp2_match_one_device(clusters, files, vae_files, inputs, dit_fmt, vae_fmt,
                                                       one_thread):
    single = build_model(TINY, checkpoint=files[dit_fmt])
    vid, txt = inputs
    with torch.no_grad():
        ref = single(vid, txt, 1000.0, runtime=single_runtime(TINY, single.grid_of(vid.shape)))
    results = clusters(2).run(quantized_sp_forward, files[dit_fmt], vae_files[vae_fmt])
    for out, vae_err in results:
        assert rel(out, ref) <= 1e-5
        assert vae_err <= 1e-5


# ------------------------------------------------------------------------------------- front doors


def test_upscale_with_gguf_dit_and_fp8_vae(tmp_path, files, vae_files, capsys):
    import json

    from ditsp.cli import main
    from ditsp.io.testclip import make_test_clip

    clip = make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=5, fps=12, audio=False)
    out = tmp_path / "out.mp4"
    rc = main(["upscale", "--model", "tiny-8x", str(clip), "-o", str(out), "--dit", files["Q4_K_M"], "--vae", vae_files["fp8_e4m3fn"],
               "--resolution", "32x32", "--json", "--no-progress"])
    assert rc == 0 and out.exists()
    report = json.loads(capsys.readouterr().out)
    assert "DiT weights Q4_K+Q6_K+Q8_0" in report["memory_estimate"] and "dequant buffer" in report["memory_estimate"]


def test_run_and_plan_take_the_weights_dtype(capsys):
    import json

    from ditsp.cli import main

    assert main(["run", "--model", "tiny", "--grid", "3,8,12", "--sp", "1", "--weights-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["weights_dtype"] == "fp8"
    assert main(["plan", "--resolution", "1280x720", "--frames", "81", "--sp", "4", "--weights-dtype", "Q4_K_M",
                 "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory_per_rank"]
    assert m["weights_format"] == "Q4_K_M" and 1.9 * 2**30 < m["weights"] < 2.2 * 2**30 and m["dequant_buffer"] > 0


def test_weights_package_is_model_agnostic():
    from pathlib import Path

    import ditsp.weights as w

    for f in Path(w.__file__).parent.glob("*.py"):
        assert "models" not in "".join(ln for ln in f.read_text().splitlines(True) if ln.lstrip().startswith(
            ("import", "from"))), f


def test_chunked_dequantization_is_the_packages(monkeypatch):
    """GGUF: row chunks into one output equal ``gguf.quants.dequantize`` of the whole tensor; FP8:
    NaN/Inf counted from bit patterns equal the converted values' counts."""
    import gguf
    import numpy as np

    from ditsp.weights import fp8, ggml
    from ditsp.weights.gguf_write import encode

    monkeypatch.setattr(ggml, "CHUNK_VALUES", 700)  # several rows per chunk, a partial last chunk
    a = np.random.default_rng(0).standard_normal((13, 512)).astype(np.float32)
    for fmt in ("Q8_0", "Q4_K", "Q6_K", "Q5_0"):
        raw = encode(a, fmt)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
        got = ggml.dequantize(torch.from_numpy(raw), fmt, (13, 512), torch.float32)
        assert torch.equal(got, torch.from_numpy(want)), fmt
    v = torch.tensor([0.0, 1.0, float("nan"), float("inf"), -float("inf"), 3.0, -0.0])
    for fmt, dt in fp8.FORMATS.items():
        q = v.to(dt)
        f = q.float()
        assert fp8.nonfinite(q.view(torch.uint8), fmt, 1.0, chunk=3) == (int(f.isnan().sum()), int(f.isinf().sum()))
    assert fp8.nonfinite(torch.zeros(4, dtype=torch.uint8), "fp8_e4m3fn", float("inf")) == (4, 0)
