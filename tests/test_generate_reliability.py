"""`ditsp generate` held to the bad-input standard (#44 items 7, 8, 10, 12): nothing non-finite becomes a
black video with exit 0, the output and the pipeline folder are checked before any work, every malformed
file is one line, and loading the pipeline beats the rank's heartbeat (the stuck-rank check of --timeout)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("diffusers")

from safetensors.torch import load_file, save_file  # noqa: E402

from ditsp.cli import main  # noqa: E402
from .cli_errors import fails  # noqa: E402
from ditsp.integrations.diffusers import ParallelizeError  # noqa: E402
from ditsp.integrations.diffusers import generate as gen  # noqa: E402

from .diffusers_cases import save_tiny_wan_pipeline  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_wan_pipeline(tmp_path_factory.mktemp("tinywan"))


@pytest.fixture
def copy(folder, tmp_path):
    """A copy of the pipeline folder to break."""
    return shutil.copytree(folder, tmp_path / "pipe")


@pytest.fixture
def no_work(monkeypatch):
    """Any attempt to start ranks fails the test."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr("ditsp.distributed.dispatch.dispatch", boom)


def argv(folder, out, *extra, embeds=None):
    return ["generate", str(folder), "--embeds", str(embeds or folder / "embeds.safetensors"), "-o", str(out),
            "--size", "48x32", "--frames", "9", "--steps", "2", "--no-progress", *extra]




class One:
    rank, world_size, group = 0, 1, None


# -- item 7: non-finite guidance, embeddings, weights, latents ----------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_non_finite_guidance_is_refused(folder, tmp_path, capsys, no_work, value):
    err = fails(capsys, argv(folder, tmp_path / "x.mp4", f"--guidance={value}"), 2)
    assert f"argument --guidance: must be a finite number, got '{value}'" in err


@pytest.mark.parametrize("name", ["prompt_embeds", "negative_prompt_embeds"])
def test_non_finite_prompt_embeddings_are_refused_up_front(folder, tmp_path, capsys, no_work, name):
    d = load_file(str(folder / "embeds.safetensors"))
    d[name][0, 3, 5] = float("nan")
    save_file(d, str(tmp_path / "nan.safetensors"))
    err = fails(capsys, argv(folder, tmp_path / "x.mp4", embeds=tmp_path / "nan.safetensors"), 2)
    assert f"{name} holds 1 NaN/Inf value(s) of 112" in err


@pytest.mark.parametrize("part,key", [("transformer", "blocks.1.ffn.net.2.weight"), ("vae", "decoder.conv_out.bias")])
def test_non_finite_weights_stop_before_any_step(copy, tmp_path, capsys, part, key):
    [file] = (copy / part).glob("*.safetensors")
    d = load_file(str(file))
    d[key].view(-1)[0] = float("inf")
    save_file(d, str(file))
    out = tmp_path / "x.mp4"
    err = fails(capsys, argv(copy, out), 1)
    assert f"{part}: 1 weight tensor(s) hold NaN or Inf ({key})" in err
    assert not out.exists()


def test_latents_that_overflow_stop_the_run_naming_the_step(folder, tmp_path, capsys):
    """A finite guidance so large the first step overflows: stopped, no black video written."""
    out = tmp_path / "x.mp4"
    err = fails(capsys, argv(folder, out, "--guidance", "1e38"), 1)
    assert re.search(r"step [12] of 2: the latents turned NaN or Inf \(guidance 1e\+38\); stopped before", err)
    assert not out.exists()


# -- item 12: the output checked before any work ---------------------------------------------------------


@pytest.mark.parametrize("name,frames", [("out.txt", "9"), ("out", "9"), ("out.png", "9")])
def test_an_output_no_writer_takes_is_refused_first(folder, tmp_path, capsys, monkeypatch, no_work, name, frames):
    monkeypatch.setattr(gen, "pipeline_index", lambda *a: pytest.fail("read the pipeline before the output"))
    err = fails(capsys, [*argv(folder, tmp_path / name), "--frames", frames], 2)
    assert f"--output {tmp_path / name}: write a video (.mp4/.m4v/.mov/.mkv), or for --frames 1 an image" in err


def test_one_frame_may_be_an_image(folder, tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main([*argv(folder, out), "--frames", "1", "--json"]) == 0 and out.is_file()


# -- item 10: malformed files, one line each -----------------------------------------------------------------


@pytest.mark.parametrize("text,msg", [
    ("{not json", "model_index.json: not a readable JSON file (Expecting property name"),
    ("[1, 2]", "model_index.json: expected a JSON object, got a list"),
    ('{"_class_name": "WanPipeline", "transformer": "x", "vae": ["diffusers", "AutoencoderKLWan"]}',
     "'transformer' must be [library, class], got \"x\""),
    ('{"_class_name": "WanPipeline", "transformer": ["diffusers"]}', "'transformer' must be [library, class]"),
    ('{"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"], '
     '"vae": ["diffusers", 3], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}',
     "'vae' must be [library, class], got [\"diffusers\", 3]"),
])
def test_a_malformed_model_index_is_one_line(copy, tmp_path, capsys, no_work, text, msg):
    (copy / "model_index.json").write_text(text)
    assert msg in fails(capsys, argv(copy, tmp_path / "x.mp4"), 2)


@pytest.mark.parametrize("part,key,value,msg", [
    ("vae", "scale_factor_spatial", 0, "scale_factor_spatial must be an integer >= 1, got 0"),
    ("vae", "scale_factor_temporal", "4", "scale_factor_temporal must be an integer >= 1, got \"4\""),
    ("transformer", "patch_size", [1, 0, 2], "patch_size must be 3 integers >= 1, got [1, 0, 2]"),
    ("transformer", "in_channels", -4, "in_channels must be an integer >= 1, got -4"),
])
def test_a_config_value_that_cannot_size_the_latent_is_one_line(copy, tmp_path, capsys, no_work, part, key, value,
                                                                 msg):
    cfg = json.loads((copy / part / "config.json").read_text())
    cfg[key] = value
    (copy / part / "config.json").write_text(json.dumps(cfg))
    err = fails(capsys, argv(copy, tmp_path / "x.mp4"), 2)
    assert f"{part}/config.json: {msg}" in err


def test_an_unreadable_part_config_is_one_line(copy, tmp_path, capsys, no_work):
    (copy / "vae" / "config.json").write_text("{")
    assert re.search(r"/vae: unreadable config \(", fails(capsys, argv(copy, tmp_path / "x.mp4"), 2))


@pytest.mark.parametrize("content", [b"not safetensors at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"])
def test_embeddings_that_are_not_safetensors_are_one_line(folder, tmp_path, capsys, no_work, content):
    bad = tmp_path / "e.safetensors"
    bad.write_bytes(content)
    err = fails(capsys, argv(folder, tmp_path / "x.mp4", embeds=bad), 2)
    assert f"{bad}: not a safetensors file of prompt embeddings (" in err


def test_embeddings_of_the_wrong_rank_are_one_line(folder, tmp_path, capsys, no_work):
    save_file({"prompt_embeds": torch.zeros(7, 16), "negative_prompt_embeds": torch.zeros(7, 16)},
              str(tmp_path / "e.safetensors"))
    err = fails(capsys, argv(folder, tmp_path / "x.mp4", embeds=tmp_path / "e.safetensors"), 2)
    assert "prompt_embeds must be a float [batch, tokens, dim] tensor, got float32 (7, 16)" in err


# -- item 8: loading the pipeline is progress, not a stuck rank ------------------------------------------------


def test_every_part_loaded_and_every_step_beats_the_heartbeat(folder, monkeypatch):
    """The launcher's --timeout counts a rank stuck when its heartbeat stands still; at one rank there is
    no collective to beat it, so only the pipeline's own beats move it: one before each part is loaded
    (the pipeline's loading took longer than a short --timeout and killed healthy runs), one per step."""
    from ditsp.distributed import heartbeat

    counter = [0]
    monkeypatch.setattr(heartbeat, "_slot", heartbeat._slot)  # put back after the test
    heartbeat.install(counter, 0)
    seen = []
    real = gen._component

    def spy(folder, index, part):
        seen.append(counter[0])
        return real(folder, index, part)

    monkeypatch.setattr(gen, "_component", spy)
    req = gen.GenerateRequest(folder=str(folder), embeds=str(folder / "embeds.safetensors"), output=None,
                              height=32, width=48, frames=9, steps=3, guidance=4.0, progress=False)
    gen.rank_generate(One(), req)
    assert len(seen) == 3 and 0 < seen[0] < seen[1] < seen[2]  # a beat before each part's load
    assert counter[0] >= seen[2] + 1 + 3  # the last part loaded, then each step


def test_the_library_refuses_what_the_command_refuses(folder, tmp_path):
    d = load_file(str(folder / "embeds.safetensors"))
    d["prompt_embeds"][0, 0, 0] = float("inf")
    save_file(d, str(tmp_path / "inf.safetensors"))
    with pytest.raises(ParallelizeError, match="prompt_embeds holds 1 NaN/Inf"):
        gen.load_embeds(tmp_path / "inf.safetensors", 4.0)
