"""Ranks of a group loading one checkpoint together (``ditsp/weights/shared.py``): one reader that
sends the others each tensor as stored, or every rank from its own memory map. Both give the same
bits (the kept tensors, the output of a forward under SP) for every format family -- bf16
safetensors, FP8, GGUF Q8_0 -- at SP 1, 2 and 3; the receivers never open the file; a bad file
raises the same error on every rank, and nobody hangs."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save_file

from ditsp.config import ParallelConfig
from ditsp.distributed.comm import Comm, CommStats
from ditsp.models.seedvr2.nadit import TINY, CheckpointError, NaDiT
from ditsp.models.seedvr2.nadit.model import build_model, init_random_, random_inputs
from ditsp.models.seedvr2.parallelize import parallelize
from ditsp.models.seedvr2.vae import TINY as VAE_TINY
from ditsp.models.seedvr2.vae import CheckpointError as VaeCheckpointError
from ditsp.models.seedvr2.vae import VideoVAE
from ditsp.models.seedvr2.vae import load_checkpoint as load_vae
from ditsp.models.seedvr2.vae.fixtures import seeded_vae
from ditsp.weights.convert import save_fp8, save_gguf
from ditsp.weights.gguf_write import q8_0
from ditsp.weights.shared import READS, check_read

pytestmark = pytest.mark.timeout(240)
GRID = (3, 8, 12)


def reference_names(model) -> dict:
    return {(k[: -len(".rope.freqs")] + ".rope.rope.freqs" if k.endswith(".rope.freqs") else k): v.detach().clone()
            for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    sd = reference_names(init_random_(NaDiT(TINY), seed=7))
    bf16 = {k: (v if ".rope." in k else v.to(torch.bfloat16)).contiguous() for k, v in sd.items()}
    save_file(bf16, d / "dit_bf16.safetensors")
    vae_sd = seeded_vae(VAE_TINY).state_dict()
    return {
        "bf16": str(d / "dit_bf16.safetensors"),
        "fp8": str(save_fp8(sd, d / "dit_fp8.safetensors", scaled=True, keep=lambda k: k.startswith("blocks.3."))),
        "Q8_0": str(save_gguf(sd, d / "dit-Q8_0.gguf", q8_0)),
        "vae_Q8_0": str(save_gguf(vae_sd, d / "vae-Q8_0.gguf", q8_0, prefix="")),
        "dir": str(d),
    }


def digest(module) -> str:
    """SHA-1 of every parameter and buffer of ``module`` as held (quantized ones as their stored bytes)."""
    h = hashlib.sha1()
    for k, t in sorted(list(module.named_parameters()) + list(module.named_buffers())):
        h.update(k.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def both_reads(ctx, path, vae_path):
    """Every-rank and one-reader loads of ``path`` on this group: their digests, the bytes each
    received as weights, and both models' outputs of one forward under SP (deterministic kernels)."""
    torch.set_num_threads(1)
    vid, txt = random_inputs(TINY, GRID, seed=1)
    rt = parallelize(TINY, ParallelConfig(ulysses_degree=ctx.world_size, deterministic=True), GRID, ctx.group)
    out = {}
    for read in READS:
        stats = CommStats()
        comm = Comm.of(ctx.group, stats)
        model = build_model(TINY, checkpoint=path, dtype=torch.bfloat16, read=read, comm=comm)
        with torch.device("meta"):
            vae = VideoVAE(VAE_TINY)
        load_vae(vae, vae_path, comm=comm, read=read)
        recv = stats.kinds["weights"].bytes_recv if "weights" in stats.kinds else 0
        out[read] = (digest(model), digest(vae), recv, model(vid, txt, 1000.0, runtime=rt))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "Q8_0"])
def test_one_reader_equals_every_rank_at_sp1(files, fmt, one_thread):
    out = both_reads(type("Ctx", (), {"world_size": 1, "group": None, "rank": 0})(), files[fmt], files["vae_Q8_0"])
    a, b = out["every-rank"], out["one-reader"]
    assert a[:2] == b[:2] and torch.equal(a[3], b[3])
    assert a[2] == b[2] == 0  # one rank: nothing on the wire


@pytest.mark.parametrize("fmt,ranks", [("bf16", 2), ("fp8", 2), ("Q8_0", 2), ("Q8_0", 3), ("fp8", 3)])
def test_one_reader_equals_every_rank_under_sp(clusters, files, fmt, ranks, one_thread):
    import os

    results = clusters(ranks).run(both_reads, files[fmt], files["vae_Q8_0"])
    ref = results[0]["every-rank"]
    for r, res in enumerate(results):
        for read in READS:
            d, v, _, y = res[read]
            assert (d, v) == ref[:2], f"rank {r} {read}: other tensors"
            assert torch.equal(y, ref[3]), f"rank {r} {read}: other output bits"
        assert res["every-rank"][2] == 0
        sent = res["one-reader"][2]
        # the receivers got the file's large tensors as stored: about the file's size (bf16 stays
        # bf16, FP8/GGUF stay quantized), never the kept fp32/bf16 size of a quantized weight
        if r == 0:
            assert sent == 0
        else:
            size = os.path.getsize(files[fmt]) + os.path.getsize(files["vae_Q8_0"])
            assert 0.5 * size < sent < size, (sent, size)


def test_read_names_are_checked():
    assert check_read(None) in READS
    with pytest.raises(ValueError, match="one-reader"):
        check_read("one")


# ------------------------------------------------------------------------------------- errors


def load_error(ctx, path, read, vae=False, fail_key=None):
    """Load ``path`` on this group; returns the error message this rank raised (None: loaded)."""
    torch.set_num_threads(1)
    comm = Comm.of(ctx.group)
    if fail_key is not None and ctx.rank == 0:  # the reader's read of one tensor fails mid-stream
        from ditsp.weights import formats

        orig = formats._read_safetensors

        def broken(p, key):
            if key == fail_key:
                raise OSError("Input/output error")
            return orig(p, key)

        formats._read_safetensors = broken
    try:
        if vae:
            with torch.device("meta"):
                load_vae(VideoVAE(VAE_TINY), path, comm=comm, read=read)
        else:
            build_model(TINY, checkpoint=path, comm=comm, read=read)
        return None
    except (CheckpointError, VaeCheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if fail_key is not None and ctx.rank == 0:
            formats._read_safetensors = orig


@pytest.fixture(scope="module")
def bad_files(files):
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(files["dir"])
    sd = load_file(files["bf16"])
    missing = dict(sd)
    del missing["vid_out.proj.bias"]
    save_file(missing, d / "missing.safetensors")
    shaped = dict(sd)
    shaped["txt_in.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    shaped["extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(shaped, d / "shaped.safetensors")
    nan = dict(sd)
    nan["txt_in.weight"] = nan["txt_in.weight"].clone()
    nan["txt_in.weight"][0, :2] = float("nan")
    save_file(nan, d / "nan.safetensors")
    (d / "garbage.safetensors").write_bytes(b"\x00" * 64)
    vae_sd = seeded_vae(VAE_TINY).state_dict()
    del vae_sd["decoder.conv_out.bias"]
    save_gguf(vae_sd, d / "vae-missing.gguf", q8_0, prefix="")
    return {"missing": (str(d / "missing.safetensors"), "missing (1):\n    vid_out.proj.bias"),
            "shaped": (str(d / "shaped.safetensors"), "txt_in.weight: checkpoint (3, 3)"),
            "nan": (str(d / "nan.safetensors"), "txt_in.weight: 2 NaN"),
            "garbage": (str(d / "garbage.safetensors"), "unreadable checkpoint"),
            "absent": (str(d / "absent.safetensors"), "no such checkpoint file"),
            "vae": (str(d / "vae-missing.gguf"), "decoder.conv_out.bias")}


@pytest.mark.parametrize("case", ["missing", "shaped", "nan", "garbage", "absent", "vae"])
@pytest.mark.parametrize("read", READS)
def test_a_bad_file_is_the_same_error_on_every_rank(clusters, bad_files, case, read):
    path, want = bad_files[case]
    msgs = clusters(3).run(load_error, path, read, case == "vae", timeout_s=120)
    assert msgs[0] is not None and want in msgs[0], msgs[0]
    assert len(set(msgs)) == 1, msgs


def test_a_read_failing_on_the_reader_fails_every_rank(clusters, files):
    msgs = clusters(2).run(load_error, files["bf16"], "one-reader", False, "blocks.1.attn.proj_qkv.vid.weight",
                           timeout_s=120)
    assert len(set(msgs)) == 1 and "blocks.1.attn.proj_qkv.vid.weight" in msgs[0] and "Input/output" in msgs[0]


def test_the_receivers_never_open_the_file(clusters, files):
    assert clusters(2).run(opens, files["Q8_0"]) == [1, 0]


def opens(ctx, path):
    """How many times this rank opened ``path`` while loading it one-reader."""
    from ditsp.weights import formats

    count = [0]
    orig = formats.open_checkpoint

    def counting(p):
        count[0] += 1
        return orig(p)

    formats.open_checkpoint = counting
    try:
        build_model(TINY, checkpoint=path, comm=Comm.of(ctx.group), read="one-reader")
    finally:
        formats.open_checkpoint = orig
    return count[0]
