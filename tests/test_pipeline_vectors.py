"""The restoration pipeline's arithmetic against the reference vectors in tests/data/pipeline-tiny.

Tolerances are those stated in the vectors' README: sizes, padding, the DiT
input, the sampler, the decoder latent and uint8 exact; resize <= 1e-5,
transform <= 2e-5, colour fix <= 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditsp.models.seedvr2.pipeline import color_fix as cf
from ditsp.models.seedvr2.pipeline import condition as cond
from ditsp.models.seedvr2.pipeline.padding import padded_length, reference_pad, reference_padded_length
from ditsp.models.seedvr2.pipeline.sizing import frame_geometry
from ditsp.models.seedvr2.pipeline.transform import (
    area_resize,
    area_size,
    crop_box,
    to_uint8,
    to_uint8_values,
    transform_frames,
)

DATA = Path(__file__).parent / "data" / "pipeline-tiny"
CONFIG = json.loads((DATA / "config.json").read_text())
TF_CASES = CONFIG["transform"]["cases"]
COND_CASES = CONFIG["condition"]["cases"]


@pytest.fixture(scope="module")
def io():
    return load_file(str(DATA / "io.safetensors"))


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------- transform


@pytest.mark.parametrize("case", TF_CASES, ids=[c["name"] for c in TF_CASES])
def test_transform_case(io, case):
    n = case["name"]
    x = io[f"{n}.in_u8"]
    h, w = area_size(x.shape[2], x.shape[3], case["res_h"], case["res_w"])
    assert [h, w] == case["resized_hw"]
    assert list(crop_box(h, w)[:2]) == case["crop_top_left"]
    assert _maxabs(area_resize(x.float() / 255.0, case["res_h"], case["res_w"]), io[f"{n}.resized"]) <= 1e-5
    out = transform_frames(x, case["res_h"], case["res_w"])
    assert list(out.shape) == case["out_CTHW"] and out.dtype == torch.float32
    assert _maxabs(out, io[f"{n}.out"]) <= 2e-5


def test_transform_size_table():
    for row in CONFIG["transform_size_table"]:
        (H, W), rh, rw = row["input_hw"], row["res_h"], row["res_w"]
        resized = area_size(H, W, rh, rw)
        assert list(resized) == row["resized_hw"], row
        assert list(crop_box(*resized)[2:]) == row["out_hw"], row
        g = frame_geometry(W, H, area=(rw, rh))
        assert [g.out_height, g.out_width] == row["out_hw"]


def test_sizing_latent_grid():
    """Latent shapes come from the VAE's config: the released one reproduces the reference's log."""
    from ditsp.models.seedvr2.vae.config import PRESETS

    released, tiny2x = PRESETS["released"], PRESETS["tiny-2x"]
    # 720x1248 at the default area: 113 frames -> latent (29, 90, 158), as in the reference log.
    g = frame_geometry(1248, 720, area=(1280, 720))
    assert released.latent_shape(padded_length(113, released.temporal_factor), *g.out_hw) == (29, 90, 158)
    g = frame_geometry(64, 48, size=(128, 96))
    assert (g.out_width, g.out_height) == (128, 96) and released.latent_shape(1, *g.out_hw) == (1, 12, 16)
    # the small restorer's VAE: 2x space, no time compression, crops to multiples of 4 (its 2x times the patch)
    g = frame_geometry(60, 44, size=(126, 94), multiple=4)
    assert g.out_hw == (92, 124) and tiny2x.latent_shape(padded_length(7, tiny2x.temporal_factor), *g.out_hw) == (7, 46, 62)


def test_transform_exact_size_and_errors():
    x = torch.randint(0, 256, (2, 3, 20, 30), dtype=torch.uint8)
    out = transform_frames(x, size=(40, 60))
    assert out.shape == (3, 2, 32, 48)
    with pytest.raises(ValueError, match="smaller than 16"):
        transform_frames(torch.zeros(1, 3, 10, 40, dtype=torch.uint8))


# ---------------------------------------------------------------- padding


def test_padding_vectors(io):
    for sp in (1, 2, 4):
        assert torch.equal(reference_pad(io["pad.in"], sp), io[f"pad.out_sp{sp}"])
    for row in CONFIG["cut_videos_table"]:
        assert reference_padded_length(row["T"], row["sp_size"]) == row["padded_T"], row


def test_default_padding_ignores_sp():
    assert [padded_length(t) for t in (1, 2, 4, 5, 6, 10, 34)] == [1, 5, 5, 5, 9, 13, 37]
    for t in range(1, 40):
        assert reference_padded_length(t, 1) == padded_length(t)


# ---------------------------------------------------------------- condition and sampler


@pytest.mark.parametrize("case", COND_CASES, ids=[c["name"] for c in COND_CASES])
def test_condition_case(io, case):
    n = case["name"]
    latent, noise, v = io[f"{n}.latent"], io[f"{n}.noise"], io[f"{n}.v"]
    # The stored draws are torch's CPU generator seeded with the case seed, noise then aug_noise.
    got_noise, got_aug = cond.draw_noises(latent, case["seed"])
    assert torch.equal(got_noise, noise) and torch.equal(got_aug, io[f"{n}.aug_noise"])
    scale = 0.1 if "inference_seedvr_" in case["script"] else cond.SEEDVR2_COND_NOISE_SCALE
    c = cond.augment_condition(latent, io[f"{n}.aug_noise"], scale)
    if scale == 0.0:
        assert c is latent
    vid = cond.dit_input(noise, c)
    assert torch.equal(vid, io[f"{n}.dit_vid_in"])
    assert cond.dit_timestep().tolist() == case["dit_timestep"]
    x0 = cond.one_step_x0(noise, v)
    assert torch.equal(x0, io[f"{n}.x0"])
    assert torch.equal(cond.euler_sample(noise, lambda x, t: v, steps=1), io[f"{n}.x0"])
    dec = cond.decoder_latent(x0)
    assert list(dec.shape) == case["vae_decode_in_shape"] and dec.dtype == torch.bfloat16
    assert torch.equal(dec.float(), io[f"{n}.vae_decode_in"])


def test_aug_shift_log_line():
    # cond_aug: "Timestep shifting from 100.0 to tensor([93.5197])" with the (H', W', 16) shape.
    t = cond.timestep_transform(100.0, (4, 6, 16))
    assert abs(t.item() - 93.5197) < 1e-4


def test_timestep_transform_table():
    for row in CONFIG["timestep_transform_table"]:
        s = row["latent_THW"]
        for k in ("t0", "t100", "t250", "t500", "t1000"):
            assert cond.timestep_transform(float(k[1:]), s).item() == row[k], (s, k)
        assert cond.timestep_transform(100.0, (s[1], s[2], 16)).item() == row["t100_as_add_noise_passes_shape"]


def test_sampling_timesteps_and_euler4(io):
    for steps, ts in CONFIG["sampling_timesteps"].items():
        assert cond.sampling_timesteps(int(steps)).tolist() == ts
    seen, ts_seen = [], []

    def model(x, t):
        seen.append(x.clone())
        ts_seen.append(t.item())
        return io["euler4.v"][len(seen) - 1]

    x0 = cond.euler_sample(io["euler4.x_T"], model, steps=4)
    assert ts_seen == [c[0] for c in CONFIG["euler4"]["calls_t_i"]]
    assert torch.equal(torch.stack(seen), io["euler4.x_t_seen"])
    assert torch.equal(x0, io["euler4.x0"])


def test_decoder_latent_divides_after_the_cast(io):
    x0 = io["cond_v.x0"]
    ours = cond.decoder_latent(x0).float()
    other = (x0 / cond.SCALING_FACTOR).to(torch.bfloat16).permute(3, 0, 1, 2).unsqueeze(0).float()
    assert torch.equal(ours, io["cond_v.vae_decode_in"])
    assert (other != ours).sum().item() > 0  # the other order really differs


def test_noise_is_independent_of_device_dtype_path():
    a = cond.make_noise((2, 3, 4, 16), cond.window_seed(7, 3))
    b = cond.make_noise((2, 3, 4, 16), cond.window_seed(7, 3), dtype=torch.float32)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
    assert cond.window_seed(7, 0) == 7
    assert len({cond.window_seed(7, i) for i in range(100)}) == 100
    assert not torch.equal(a, cond.make_noise((2, 3, 4, 16), cond.window_seed(7, 4)))


# ---------------------------------------------------------------- colour fix and uint8


@pytest.mark.parametrize("n", ["cf0", "cf1"])
def test_color_fix_vectors(io, n):
    content, style = io[f"{n}.content"], io[f"{n}.style"]
    assert _maxabs(cf.wavelet_blur(content, 1), io[f"{n}.blur_r1"]) <= 1e-6
    assert _maxabs(cf.wavelet_blur(content, 16), io[f"{n}.blur_r16"]) <= 1e-6
    high, low = cf.wavelet_decomposition(content)
    assert _maxabs(high, io[f"{n}.content_high"]) <= 1e-6
    assert _maxabs(low, io[f"{n}.content_low"]) <= 1e-6
    assert _maxabs(cf.wavelet_decomposition(style)[1], io[f"{n}.style_low"]) <= 1e-6
    assert _maxabs(cf.apply_color_fix(content, style, "wavelet"), io[f"{n}.wavelet"]) <= 1e-6
    assert _maxabs(cf.apply_color_fix(content.bfloat16(), style, "wavelet"), io[f"{n}.wavelet_bf16content"]) <= 1e-6
    assert _maxabs(cf.apply_color_fix(content, style, "adain"), io[f"{n}.adain"]) <= 1e-6
    assert cf.apply_color_fix(content, style, "none") is content
    # chunking is exact
    assert torch.equal(cf.apply_color_fix(content, style, chunk=1), cf.apply_color_fix(content, style, chunk=None))


def test_color_fix_rejects_unknown():
    x = torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="unknown colour fix"):
        cf.apply_color_fix(x, x, "sepia")


def test_uint8_vectors(io):
    assert torch.equal(to_uint8_values(io["u8.in"]), io["u8.out"])


def test_post_processing_vectors(io):
    ori = CONFIG["post"]["ori_length"]
    decoded = io["post.decoded"][:ori]
    style = io["post.input_CTHW"].permute(1, 0, 2, 3)
    assert torch.equal(to_uint8(cf.apply_color_fix(decoded, style)), io["post.u8_fp32decoded"])
    assert torch.equal(to_uint8(cf.apply_color_fix(decoded.bfloat16(), style)), io["post.u8_bf16decoded"])


def test_wavelet_blur_equals_a_dilated_depthwise_conv():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 13, 21, generator=g) * 2 - 1
    k = (torch.tensor([[1.0, 2, 1], [2, 4, 2], [1, 2, 1]]) / 16).expand(3, 1, 3, 3)
    for r in (1, 2, 4, 8, 16):
        ref = torch.nn.functional.conv2d(
            torch.nn.functional.pad(x, (r, r, r, r), mode="replicate"), k, groups=3, dilation=r
        )
        assert _maxabs(cf.wavelet_blur(x, r), ref) <= 1e-6


def _blur_by_rounded_products(x: torch.Tensor, r: int) -> torch.Tensor:
    """The blur as written down: nine rounded products, each its own tensor, summed in order."""
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x.float(), (r, r, r, r), mode="replicate")
    terms = [padded[..., i * r : i * r + h, j * r : j * r + w] * (wi * wj / 16)
             for i, wi in enumerate((1.0, 2.0, 1.0)) for j, wj in enumerate((1.0, 2.0, 1.0))]
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out.to(x.dtype)


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wavelet_blur_in_place_sum_has_the_bits_of_the_rounded_products(dtype):
    # The in-place weighted adds rely on power-of-two weights (exact products): same bits, not just close.
    g = torch.Generator().manual_seed(1)
    x = ((torch.rand(3, 3, 37, 29, generator=g) * 2 - 1) * torch.logspace(-6, 0, 29)).to(dtype)
    for r in (1, 2, 4, 8, 16, 64):
        assert torch.equal(cf.wavelet_blur(x, r), _blur_by_rounded_products(x, r))
