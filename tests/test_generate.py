"""`ditsp generate` on a tiny random Wan pipeline folder (precomputed prompt embeddings: no tokenizer or
text encoder files offline), under SP and CFG parallel, against one device."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

from ditsp.cli import main  # noqa: E402
from ditsp.commands.generate import rank_job  # noqa: E402
from ditsp.integrations.diffusers.generate import GenerateRequest, rank_generate  # noqa: E402

from .diffusers_cases import OUT_TOL, rel, save_tiny_wan_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_wan_pipeline(tmp_path_factory.mktemp("tinywan"))


def request(folder, **kw):
    base = dict(folder=str(folder), embeds=str(folder / "embeds.safetensors"), output=None, height=32, width=48,
                frames=9, steps=2, guidance=4.0, progress=False, return_frames=True)
    return GenerateRequest(**{**base, **kw})


class One:
    rank, world_size, group = 0, 1, None


@pytest.fixture(scope="module")
def one_device(folder):
    return rank_generate(One(), request(folder))


def test_cli_writes_the_video_and_checks(folder, tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    rc = main(["generate", str(folder), "--embeds", str(folder / "embeds.safetensors"), "-o", str(out),
               "--size", "48x32", "--frames", "9", "--steps", "2", "--guidance", "4", "--json", "--check"])
    assert rc == 0 and out.is_file()
    rep = json.loads(capsys.readouterr().out)
    assert rep["frames"] == 9 and rep["size"] == [48, 32] and len(rep["step_s"]) == 2
    assert rep["check"]["frames_max_abs_diff"] == 0  # one device twice: the same frames


@pytest.mark.parametrize("kw", [{"ulysses": 2}, {"cfg": 2}])  # SP 2; CFG 2 x SP 1
def test_parallel_generation_matches_one_device(clusters, folder, one_device, kw):
    res = clusters(2).run(rank_job, request(folder, **kw))
    rep = res[0]
    assert rel(rep["latents"], one_device["latents"]) <= OUT_TOL
    # frames are uint8 of the decoded latents: a rounding step may flip by one level at most
    assert (rep["frames_u8"].int() - one_device["frames_u8"].int()).abs().max() <= 1


@pytest.mark.parametrize("args,msg", [
    (["--size", "50x32"], "multiples of"),
    (["--frames", "8"], "4n\\+1"),
    (["--cfg-parallel", "--guidance", "1"], "needs --guidance"),
])
def test_bad_requests_fail_before_any_rank(folder, tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit):
        main(["generate", str(folder), "--embeds", str(folder / "embeds.safetensors"), "-o",
              str(tmp_path / "x.mp4")] + args)
    assert __import__("re").search(msg, capsys.readouterr().err)


def test_folder_that_is_not_a_pipeline(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path), "--embeds", "e.safetensors", "-o", str(tmp_path / "x.mp4")])
    assert "model_index.json" in capsys.readouterr().err


def test_guidance_needs_negative_embeds(folder, tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({"prompt_embeds": torch.zeros(1, 7, 16)}, str(tmp_path / "pos.safetensors"))
    with pytest.raises(SystemExit):
        main(["generate", str(folder), "--embeds", str(tmp_path / "pos.safetensors"), "-o", str(tmp_path / "x.mp4")])
    assert "negative_prompt_embeds" in capsys.readouterr().err
