"""`ditsp bench malloc` end to end on small shapes: a process per policy, the rows, the same bits, the files."""

import json

import pytest

from ditsp.cpu import malloc as cpu_malloc
from ditsp.cli import main

pytestmark = pytest.mark.timeout(300)


def test_malloc_bench_rows_bits_and_files(tmp_path, capsys):
    argv = ["bench", "malloc", "--clip", "1,16,16", "--latent", "1,8,8", "--layers", "1", "--dtype", "fp32",
            "--rounds", "1", "--calls", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "malloc.json").read_text())["rows"]
    policies = ("system", "hugepages", "reuse")
    assert [(r["case"], r["policy"]) for r in rows] == [(case, p) for case in ("vae", "dit") for p in policies]
    assert all(r["same_bits"] and r["cpu_s"] > 0 and r["peak_gib"] > 0 for r in rows)
    # each process ran under the policy it was given, whatever this process runs under
    entries = [":".join(cpu_malloc.tunables(p)) for p in policies]
    assert all(r["in_effect"] for r in rows)
    assert [r["tunables"] for r in rows] == entries * 2
    text = (tmp_path / "malloc.md").read_text()
    assert "CPU vs system" in text
    assert ("| vae | fp32 | hugepages (no effect here) |" in text) == (not entries[1])


def test_malloc_bench_rejects_an_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "malloc", "--policy", "system,keep"])
    assert "--policy system,keep: choose from reuse, hugepages, system" in capsys.readouterr().err
