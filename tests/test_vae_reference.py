"""The VAE port reproduces the SeedVR2 reference's own outputs (fp32), in one pass and in causal chunks."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditsp.models.seedvr2.vae import TINY, VaeConfig, VideoVAE
from ditsp.models.seedvr2.vae.execution import Exec
from ditsp.models.seedvr2.vae.fixtures import seeded_vae

DATA = Path(__file__).parent / "data" / "vae-tiny"
REL = 1e-5


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def vae():
    return seeded_vae(TINY)


@pytest.fixture(scope="module")
def io():
    return load_file(DATA / "io.safetensors")


def test_config_and_weights_match_vectors(vae):
    assert VaeConfig.from_json(DATA / "config.json") == TINY
    sd = vae.state_dict()
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].contiguous().numpy().tobytes())
    assert h.hexdigest() == "ddd2a90ce5b8f952b39a7047349e1c876550e4937d873022d7d411011813ee71"
    cfg = json.loads((DATA / "config.json").read_text())
    assert len(sd) == cfg["num_tensors"] and sum(v.numel() for v in sd.values()) == cfg["num_params"]


@pytest.mark.parametrize("chunk", [None, 1])
def test_encode_decode_reproduce_reference(vae, io, chunk):
    post = vae.encode(io["video"], chunk=chunk)
    assert rel_err(post.mean, io["posterior_mean"]) <= REL
    assert rel_err(post.logvar, io["posterior_logvar"]) <= REL
    latent = vae.channels_last(vae.to_latent(post.sample(io["sample_noise"])))[0]
    assert latent.shape == (3, 6, 10, 16)
    assert rel_err(latent, io["latent_pipeline"]) <= REL
    z = vae.from_latent(vae.channels_first(io["latent_pipeline"][None]))
    assert rel_err(vae.decode(z, chunk=chunk), io["decoded"]) <= REL
    assert rel_err(vae.decode(io["posterior_mean"], chunk=chunk), io["decoded_from_mean"]) <= REL


def test_chunks_really_carry_state(vae, io):
    """Without the carried tails (each chunk restarted as a clip) the output is wrong."""
    x = io["video"]
    pieces = [(0, 5), (5, 9)]
    restarted = torch.cat([vae.encoder(x[:, :, a:b], Exec().begin(0)) for a, b in pieces], 2)
    carried = vae.run_encoder(x, Exec(carry={}), pieces)
    assert rel_err(carried[:, :16], io["posterior_mean"]) <= REL
    assert rel_err(restarted[:, :16], io["posterior_mean"]) > 0.01


@pytest.fixture(scope="module")
def small_clip():
    g = torch.Generator().manual_seed(5)
    return (torch.rand(1, 3, 17, 24, 40, generator=g) * 2 - 1)


@pytest.mark.parametrize("T", [1, 5, 9, 17])
def test_chunked_equals_plain_for_clip_lengths(vae, small_clip, T):
    x = small_clip[:, :, :T]
    plain = vae.encode(x).mean
    assert plain.shape[2] == (T - 1) // 4 + 1
    for chunk in (1, 2):
        assert rel_err(vae.encode(x, chunk=chunk).mean, plain) <= REL
    z = plain
    dec = vae.decode(z)
    assert dec.shape[2] == T
    assert rel_err(vae.decode(z, chunk=1), dec) <= REL


def test_image_fast_path_is_exact_and_used(vae, small_clip):
    """An image (4-D) is frame 0 of a clip: latent frame 0 only sees frame 0, decoded frame 0 only latent 0."""
    clip = small_clip[:, :, :5]
    video_latent0 = vae.encode(clip).mean[:, :, 0]
    ex = Exec()
    img_moments = vae.encoder(clip[:, :, :1], ex.begin(0))
    assert ex.counts["conv_2d_fast"] == sum(1 for m in vae.encoder.modules()
                                            if hasattr(m, "kernel") and m.kernel[0] == 3)
    assert rel_err(img_moments[:, :16, 0], video_latent0) <= REL
    assert vae.encode(clip[:, :, 0]).mean.shape == (1, 16, 1, 3, 5)
    z = vae.encode(clip).mean
    assert rel_err(vae.decode(z[:, :, 0]), vae.decode(z)[:, :, 0]) <= REL
    assert vae.decode(z[:, :, 0]).shape == (1, 3, 24, 40)


def test_bf16_runs_close_to_fp32(vae, io):
    vb = seeded_vae(TINY).to(torch.bfloat16)
    post = vb.encode(io["video"])
    assert post.mean.dtype == torch.bfloat16
    assert rel_err(post.mean.float(), io["posterior_mean"]) < 0.1
    assert rel_err(vb.decode(io["posterior_mean"]).float(), io["decoded_from_mean"]) < 0.1


def test_rejects_bad_clip_lengths(vae):
    with pytest.raises(ValueError, match="4n \\+ 1"):
        vae.encode(torch.zeros(1, 3, 6, 16, 16))
