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
