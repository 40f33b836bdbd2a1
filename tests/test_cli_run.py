"""`ditsp run`: JSON report keys and parity through the CLI (spawns its own ranks)."""

import json

import pytest

from ditsp.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("sp,path", [(1, "window"), (2, "window"), (2, "ulysses")])
def test_run_json_report(capsys, sp, path):
    assert main(["run", "--model", "tiny", "--grid", "5,20,36", "--sp", str(sp), "--path", path,
                 "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == sp and len(out["rank_peak_bytes"]) == sp
    assert out["max_abs_err"] <= 1e-5 * out["ref_max_abs"]
    assert ("Plan A" in out["path"]) == (path == "window")
    assert (out["bytes_moved"] > 0) == (sp > 1)
    assert out["output_shape"] == [5, 40, 72, 16]


def test_run_text_report(capsys):
    assert main(["run", "--model", "tiny", "--resolution", "640x360", "--frames", "5", "--sp", "1"]) == 0
    text = capsys.readouterr().out
    assert "centre-cropped 640x360 -> 640x352" in text and "window-aligned Plan A" in text


def test_run_rejects_bad_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--model", "tiny", "--grid", "5,20,36", "--sp", "1", "--dtype", "fp8"])
