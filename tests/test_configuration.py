"""Every switch is a field with a documented default that its environment variable overrides
(docs/configuration.md): the CPU settings (read once per process, a block may run under others), the
transport's agreement mode, and the docs table, which lists every ``DITSP_*`` variable the code reads."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ditsp.config import ParallelConfig, ParallelConfigError
from ditsp.cpu import gemm, settings
from ditsp.cpu.settings import CpuSettings
from ditsp.distributed import shm_gather
from ditsp.distributed import transport as tp
from ditsp.models.seedvr2.vae import channels_last, winograd

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
DEFAULTS = {"gemm": "onednn", "malloc": "reuse", "malloc_restart": False, "shm_collectives": True,
            "vae_winograd": True, "vae_channels_last": True}


def test_the_cpu_defaults_are_the_documented_ones():
    assert dataclasses.asdict(CpuSettings()) == DEFAULTS
    assert CpuSettings.from_env({}) == CpuSettings()
    assert CpuSettings.from_env({v: "" for v in settings.ENV.values()}) == CpuSettings()  # empty is unset


@pytest.mark.parametrize("field, raw, value", [
    ("gemm", " BLAS ", "blas"), ("malloc", "system", "system"), ("malloc", "Hugepages", "hugepages"),
    ("malloc_restart", "1", True), ("shm_collectives", "0", False), ("vae_winograd", "0", False),
    ("vae_channels_last", "0", False), ("vae_winograd", "1", True),
])
def test_each_variable_overrides_its_field(field, raw, value):
    got = CpuSettings.from_env({settings.ENV[field]: raw})
    assert getattr(got, field) == value
    assert dataclasses.replace(got, **{field: DEFAULTS[field]}) == CpuSettings()  # nothing else moved


@pytest.mark.parametrize("field, raw, choices", [
    ("gemm", "mkl", "onednn, blas"), ("malloc", "huge", "reuse, hugepages, system"),
    ("shm_collectives", "yes", "1, 0"), ("vae_winograd", "on", "1, 0"), ("malloc_restart", "true", "1, 0"),
])
def test_a_bad_value_is_one_line_naming_the_variable(field, raw, choices):
    with pytest.raises(ValueError) as e:
        CpuSettings.from_env({settings.ENV[field]: raw})
    assert str(e.value) == f"{settings.ENV[field]}={raw!r}: expected one of {choices}"
    with pytest.raises(ValueError, match=field):
        CpuSettings(**{field: raw})


def test_a_block_runs_under_other_settings_and_then_as_before():
    before = settings.current()
    assert before == settings.process()
    with settings.use(shm_collectives=False, vae_winograd=False, vae_channels_last=False) as inside:
        assert settings.current() is inside and inside.gemm == before.gemm
        assert not shm_gather.enabled() and not winograd.enabled() and not channels_last.enabled()
        with gemm.use_route("blas"):
            assert gemm.route() == "blas" and not settings.current().vae_winograd  # blocks nest
    assert settings.current() == before
    with pytest.raises(ValueError, match="unknown GEMM route"):
        with gemm.use_route("mkl"):
            pass


_READ = """
import json, os
from ditsp.cpu import gemm, malloc, settings
from ditsp.distributed import shm_gather
from ditsp.models.seedvr2.vae import channels_last, winograd
def now():
    return [gemm.route(), malloc.policy(), settings.process().malloc_restart, shm_gather.enabled(),
            winograd.enabled(), channels_last.enabled()]
first = now()
for field, var in settings.ENV.items():  # changed after the first read: the process keeps what it read
    os.environ[var] = {"gemm": "onednn", "malloc": "hugepages"}.get(field, "1")
print(json.dumps([first, now()]))
"""


def test_a_process_reads_its_environment_once():
    env = {k: v for k, v in os.environ.items() if k not in settings.ENV.values()}
    env.update({settings.ENV["gemm"]: "blas", settings.ENV["malloc"]: "system", settings.ENV["shm_collectives"]: "0",
                settings.ENV["vae_winograd"]: "0", settings.ENV["vae_channels_last"]: "0"})
    out = subprocess.run([sys.executable, "-c", _READ], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, later = json.loads(out.stdout)
    assert first == later == ["blas", "system", False, False, False, False]


def test_the_agreement_mode_is_a_config_field_the_variable_overrides():
    assert ParallelConfig().a2a_agree is None
    assert tp.TransportSettings.resolve(ParallelConfig(), {}).agree == "key"  # the default
    s = tp.TransportSettings.resolve(ParallelConfig(), {tp.ENV_AGREE: " Every "})
    assert s.agree == "every" and dict(s.sources)["agree"] == "env"
    s = tp.TransportSettings.resolve(ParallelConfig(a2a_agree="key"), {tp.ENV_AGREE: "every"})
    assert s.agree == "key" and dict(s.sources)["agree"] == "config"  # a value on the config wins
    with pytest.raises(ParallelConfigError, match="a2a_agree must be one of key, every"):
        ParallelConfig(a2a_agree="sometimes")
    with pytest.raises(ValueError, match="agree from env"):
        tp.TransportSettings.resolve(None, {tp.ENV_AGREE: "sometimes"})


def _table() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `DITSP_") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_variable_the_code_reads_is_in_the_docs_table():
    names = set()
    sources = [*ROOT.joinpath("ditsp").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
               *ROOT.joinpath("benchmarks").rglob("*.py"), ROOT / "Makefile"]
    for path in sources:
        names |= {m.rstrip("_") for m in re.findall(r"DITSP_[A-Z0-9][A-Z0-9_]*", path.read_text())}
    rows, text = _table(), DOC.read_text()
    retired = {"DITSP_ULYSSES_A2A", "DITSP_ULYSSES_A2A_LONG_TRAINING"}  # old names, named below the table
    assert names - retired <= set(rows), sorted(names - retired - set(rows))
    assert all(f"`{n}`" in text for n in retired)
    assert len(rows) >= 15


def test_the_docs_table_gives_each_cpu_setting_its_field_and_default():
    rows = _table()
    for field, var in settings.ENV.items():
        _, where, default, _, _ = rows[var]
        assert where == f"`CpuSettings.{field}`"
        value = DEFAULTS[field]
        assert default == f"`{int(value) if isinstance(value, bool) else value}`"
    for field, var in (("a2a_policy", tp.ENV_POLICY), ("a2a_long_training", tp.ENV_LONG),
                       ("a2a_capacity_bytes", tp.ENV_CAPACITY), ("a2a_agree", tp.ENV_AGREE)):
        assert rows[var][1] == f"`ParallelConfig.{field}`"
