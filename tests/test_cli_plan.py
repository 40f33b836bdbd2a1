"""`ditsp plan`: JSON schema, text report, picture, request sizing."""

import json

import pytest

from ditsp.cli import main
from ditsp.models.seedvr2.job.sizing import request_grid


def run_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_schema_4k_sp8(capsys):
    out = run_json(capsys, "--grid", "21,135,240", "--sp", "8")
    assert out["grid"] == [21, 135, 240] and out["tokens"] == 680_400
    assert out["world_size"] == 8 and out["planner"] == "lpt" and out["transitions"] == 31
    assert out["layouts"]["regular"]["windows"] == 324 and out["layouts"]["shifted"]["windows"] == 400
    for lay in out["layouts"].values():
        assert set(lay) >= {"windows", "rank_tokens", "rank_windows", "imbalance"}
        assert lay["imbalance"] <= 1.01 and sum(lay["rank_tokens"]) == 680_400
    for name in ("regular->shifted", "shifted->regular"):
        tr = out["transition"][name]
        assert set(tr) >= {"tokens_moved", "fraction_moved", "max_rank_send_tokens", "max_rank_recv_tokens"}
        assert 0 < tr["fraction_moved"] <= 1
    b = out["bytes_per_forward"]
    assert 0 < b["window_sp"] < b["ulysses"]


def test_resolution_text_and_plot(capsys, tmp_path):
    png = tmp_path / "plan.png"
    assert main(["plan", "--resolution", "1920x1080", "--frames", "81", "--sp", "4", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "21,67,120" in text and "centre-cropped 1920x1080 -> 1920x1072" in text
    assert "transitions per forward: 31" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_request_sizing():
    r = request_grid(1280, 720, 81)
    assert r.grid == (21, 45, 80) and r.notes() == []
    r = request_grid(3840, 2160, 81)
    assert r.grid == (21, 135, 240)
    r = request_grid(1920, 1080, 80)
    assert r.padded_frames == 81 and r.grid == (21, 67, 120) and len(r.notes()) == 2
    assert request_grid(1280, 720, 1).grid == (1, 45, 80)


def test_request_sizing_follows_the_models_vae_and_patch():
    """The crop multiple, the frame padding and the latent come from the model's VAE and DiT configs."""
    r = request_grid(66, 48, 6, "tiny")  # the small restorer's VAE: 2x space, no time compression
    assert (r.crop_width, r.crop_height, r.padded_frames) == (64, 48, 6)
    assert r.latent == (6, 24, 32) and r.grid == (6, 12, 16)
    assert r.notes() == ["centre-cropped 66x48 -> 64x48 (multiples of 4)"]
    r = request_grid(66, 48, 6, "tiny-8x")  # the test vectors' VAE: the released 8x8x4
    assert r.grid == (3, 3, 4) and r.padded_frames == 9
    assert r.notes() == ["centre-cropped 66x48 -> 64x48 (multiples of 16)",
                         "padded 6 -> 9 frames by repeating the last (the causal VAE needs 4n+1)"]
    assert request_grid(1920, 1080, 80, "seedvr2-7b") == request_grid(1920, 1080, 80)


def test_model_is_a_name_of_the_table_and_sizes_the_resolution(capsys):
    # the released 8x8x4 VAE would make (2, 3, 4) of it; the small restorer's keeps every frame
    assert run_json(capsys, "--model", "tiny", "--resolution", "64x48", "--frames", "5", "--sp", "2")["grid"] == [5, 12, 16]
    assert run_json(capsys, "--model", "tiny-8x", "--resolution", "64x48", "--frames", "5", "--sp", "2")["grid"] == [2, 3, 4]
    assert run_json(capsys, "--model", "small", "--grid", "2,3,4", "--sp", "2")["grid"] == [2, 3, 4]  # hidden, accepted
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "nope", "--grid", "2,3,4", "--sp", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown model 'nope'; choose from tiny, seedvr2-3b, seedvr2-7b" in err
    assert "small" not in err  # the hidden one is accepted, not offered


@pytest.mark.parametrize("args", [
    ["--grid", "21,45"],
    ["--grid", "21,45,80", "--frames", "81"],
    ["--resolution", "1920x1080"],
    ["--resolution", "big", "--frames", "81"],
    ["--grid", "21,45,80", "--planner", "magic"],
])
def test_bad_arguments_exit_with_a_message(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *args, "--sp", "2"])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
