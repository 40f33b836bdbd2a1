"""The table of models (ditsp/models/seedvr2/presets.py): no silent random weights, the shipped weights found
from an installed wheel, the 1.4B's shape, and each model's defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ditsp.cli import main
from ditsp.models.seedvr2 import presets
from ditsp.models.seedvr2.weights import WeightsSpec

ROOT = Path(__file__).resolve().parents[1]


def _err(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("model", ["seedvr2-3b", "seedvr2-7b", "seedvr2-1.4b"])
def test_released_models_without_checkpoints_stop_before_any_rank(model, tmp_path, capsys, monkeypatch):
    """No checkpoints: one line naming the files to pass, exit 1, and no rank is ever started."""
    from ditsp.io.testclip import make_test_clip
    import ditsp.distributed.launcher as launcher

    clip = str(make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=5, fps=12, audio=False))
    started = []
    monkeypatch.setattr(launcher.LocalCluster, "__init__", lambda *a, **k: started.append(1))
    rc, err = _err(capsys, ["upscale", clip, "-o", str(tmp_path / "o.mp4"), "--model", model, "--sp", "2"])
    assert rc != 0 and not started and "\n" not in err, err
    assert err.startswith("ditsp upscale: error:") and "--dit" in err and "--vae" in err and "--random-weights" in err


def test_random_weights_only_when_asked_and_said_first(tmp_path, capsys):
    """Seeded random weights on --random-weights, and the report's first line says so."""
    from ditsp.io.testclip import make_test_clip

    clip = str(make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=5, fps=12, audio=False))
    with pytest.raises(ValueError, match="--random-weights"):
        WeightsSpec("tiny-8x")
    assert WeightsSpec("tiny-8x", random_weights=True).random
    rc = main(["upscale", clip, "-o", str(tmp_path / "o.mp4"), "--model", "tiny-8x", "--random-weights",
               "--no-progress"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[0].startswith("RANDOM WEIGHTS") and any(line.startswith("RANDOM WEIGHTS") for line in out[1:])


def test_the_default_model_loads_the_shipped_weights():
    """`--model tiny` (the default) names the files the package ships, not seeded weights."""
    spec = WeightsSpec()
    assert spec.model == presets.DEFAULT_MODEL == "tiny" and not spec.random
    dit, vae = presets.MODELS["tiny"].shipped_files
    assert spec.dit == str(dit) and spec.vae == str(vae) and dit.is_file() and vae.is_file()
    from ditsp.models.seedvr2.weights import load

    models = load(spec)
    assert models.vae.cfg == presets.vae_config("tiny") and models.dit.cfg == presets.dit_config("tiny")
    assert all(torch.isfinite(p).all() for p in models.dit.parameters())


def test_the_shipped_weights_come_from_an_installed_wheel(tmp_path):
    """A wheel built from the tree holds the weights, and installed outside the source tree the default model
    finds them there (package data, not the repository)."""
    import shutil

    src, wheels = tmp_path / "src", tmp_path / "wheels"  # built from a copy: the build leaves nothing in the tree
    shutil.copytree(ROOT / "ditsp", src / "ditsp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("ditsp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"ditsp/models/seedvr2/trained/tiny/dit.safetensors", "ditsp/models/seedvr2/trained/tiny/vae.safetensors"} \
        <= set(names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    code = ("import ditsp, os; from ditsp.models.seedvr2.weights import WeightsSpec; s = WeightsSpec(); "
            "print(ditsp.__file__); print(s.dit); print(os.path.isfile(s.dit) and os.path.isfile(s.vae))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    where, dit, found = p.stdout.split()
    assert where.startswith(str(site)) and dit.startswith(str(site)) and found == "True", p.stdout


def test_the_1_4b_is_six_blocks_of_the_7b():
    """SeedVR2-1.4B: the 7B's widths and heads, six blocks; its tensors are the 7B's first six blocks' and the
    rest (a 7B checkpoint cut to six blocks loads strictly into it)."""
    from ditsp.models.meta import meta_device
    from ditsp.models.seedvr2.nadit.model import NaDiT

    small, big = presets.dit_config("seedvr2-1.4b"), presets.dit_config("seedvr2-7b")
    assert (small.num_layers, small.vid_dim, small.heads, small.variant) == (6, big.vid_dim, big.heads, "7b")
    assert 1.3e9 < small.param_count() < 1.6e9
    with meta_device():
        a, b = NaDiT(small).state_dict(), NaDiT(big).state_dict()
    cut = {k: v for k, v in b.items() if not k.startswith("blocks.") or int(k.split(".")[1]) < 6}
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in cut.items()}
    assert sum(v.numel() for v in a.values() if v.dtype.is_floating_point) >= small.param_count()


def test_a_six_block_checkpoint_loads_strictly_at_the_7b_structure(tmp_path):
    """The 1.4B's loading path on a file of its shape at tiny widths: six 7B-family blocks load strictly into a
    six-block config, and a four-block model refuses them naming both block counts."""
    from safetensors.torch import save_file

    from ditsp.models.seedvr2.nadit.checkpoint import CheckpointError
    from ditsp.models.seedvr2.nadit.config import TINY_7B
    from ditsp.models.seedvr2.nadit.model import build_model, init_random_

    six = TINY_7B.with_layers(6)
    from ditsp.models.seedvr2.nadit.model import NaDiT

    net = init_random_(NaDiT(six), 3)
    path = tmp_path / "six.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    loaded = build_model(six, checkpoint=str(path))
    assert all(torch.equal(p, q) for p, q in zip(loaded.state_dict().values(), net.state_dict().values()))
    with pytest.raises(CheckpointError, match="checkpoint has 6 blocks but the model has 4"):
        build_model(TINY_7B, checkpoint=str(path))


def test_each_model_has_its_default_output():
    """The released models restore at the reference's 1280x720 area; the tiny one at the 2x it was trained for."""
    assert presets.MODELS["seedvr2-3b"].area == (1280, 720) and presets.MODELS["seedvr2-3b"].scale is None
    assert presets.MODELS["tiny"].scale == 2.0
    assert presets.vae_config("tiny").spatial_factor == 2 and presets.vae_config("seedvr2-3b").spatial_factor == 8
