"""`ditsp verify` on the shipped VAE and pipeline vector sets, and on broken copies of them."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditsp.cli import main

DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.timeout(300)


def broken_copy(src: Path, dst: Path, key: str) -> Path:
    shutil.copytree(src, dst)
    io = load_file(dst / "io.safetensors")
    t = io[key].clone()
    t.view(-1)[0] += 0.5 if t.is_floating_point() else 1
    io[key] = t
    save_file(io, dst / "io.safetensors")
    return dst


@pytest.mark.parametrize("name,sp", [("vae-tiny", "1,2"), ("pipeline-tiny", "1")])
def test_shipped_sets_pass(name, sp, capsys):
    assert main(["verify", str(DATA / name), "--sp", sp]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PASS") and "FAIL" not in out


@pytest.mark.parametrize("name,key", [("vae-tiny", "decoded_from_mean"), ("pipeline-tiny", "cond_v.x0")])
def test_broken_copy_fails(name, key, tmp_path, capsys):
    d = broken_copy(DATA / name, tmp_path / name, key)
    assert main(["verify", str(d), "--sp", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


def test_the_memory_check_plans_against_the_declared_figure(monkeypatch, capsys):
    """Not the free memory of the instant: on a busy machine that refused the shipped sets. The suite declares
    16 GiB (conftest.py), in which they pass above; declared too small, the same set is refused, in one line."""
    monkeypatch.setenv("DITSP_AVAILABLE_GIB", "0.01")
    assert main(["verify", str(DATA / "vae-tiny"), "--sp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ditsp verify: error: ") and err.endswith("but 0.01 GiB is available") and "\n" not in err
