"""Issue #13 items 4 and 8: resource checks before `ditsp run` starts ranks, and bad arguments of
every command as one line on stderr with a non-zero exit, before any work."""

import os
import re

import pytest
import torch

from ditsp.cli import main
from ditsp.commands import run as run_cmd
from ditsp.memory import available_bytes

from .cli_errors import fails

pytestmark = pytest.mark.timeout(120)

RUN = ["run", "--model", "tiny", "--grid", "5,20,36"]


@pytest.fixture
def no_spawn(monkeypatch):
    """Any attempt to start ranks or run a forward fails the test."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr("ditsp.models.seedvr2.job.forward.run", boom)
    monkeypatch.setattr("ditsp.distributed.dispatch.dispatch", boom)


# ---------------------------------------------------------------- item 4: resources before ranks


def test_available_bytes_shared_with_upscale():
    from ditsp.models.seedvr2.job import budget

    assert budget.available_bytes is available_bytes
    assert 0 < available_bytes(4) <= available_bytes(1)


def test_too_many_ranks_for_memory_refused(capsys, no_spawn):
    err = fails(capsys, [*RUN, "--sp", "1000"])
    assert "not enough memory" in err and "GiB per rank" in err and "1000 local ranks" in err


def test_model_too_big_for_max_memory_refused(capsys, no_spawn):
    err = fails(capsys, ["run", "--model", "seedvr2-3b", "--grid", "5,20,36", "--sp", "2", "--max-memory", "4"])
    assert "weights 12.6" in err and "--max-memory is 4.00 GiB" in err


def test_estimate_counts_weights_and_token_share():
    from ditsp.models.seedvr2.nadit.config import get_config

    cfg = get_config("seedvr2-3b")
    one = run_cmd.estimate_rank_memory(cfg, "bf16", (21, 45, 80), 1, None, 0, False, False)
    four = run_cmd.estimate_rank_memory(cfg, "bf16", (21, 45, 80), 4, None, 0, True, False)
    assert one.weights == cfg.param_count() * 2 and four.activations * 4 >= one.activations
    assert four.base == run_cmd.RANK_BASE_BYTES and one.base == 0


def test_cores_oversubscription(capsys, monkeypatch, no_spawn):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    err = fails(capsys, [*RUN, "--sp", "9", "--max-memory", "100"])
    assert "9 local ranks on 1 CPU core" in err and "--force" in err


def test_cores_warning_and_force(capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    seen = {}
    monkeypatch.setattr("ditsp.models.seedvr2.job.forward.run", lambda spec, **k: seen.setdefault("spec", spec) and _fake_summary(spec))
    assert main([*RUN, "--sp", "2", "--max-memory", "100", "--json"]) == 0
    assert "warning: 2 ranks x 1 thread on 1 CPU core" in capsys.readouterr().err
    assert main([*RUN, "--sp", "9", "--force", "--json"]) == 0  # past 8 per core: no estimate, no core limit
    assert seen["spec"].sp == 2  # (what the machine's memory cannot hold is refused even so: test_reliability)


def _fake_summary(spec):
    return {"spec": {}, "world_size": spec.sp}


# ---------------------------------------------------------------- item 8: small CLI defects


@pytest.mark.parametrize("extra,msg", [
    (["--sp", "1", "--layers", "0"], "--layers: must be an integer >= 1"),
    (["--sp", "1", "--repeats", "0"], "--repeats: must be an integer >= 1"),
    (["--sp", "1", "--timeout", "0"], "--timeout: must be a finite number of seconds >= 1"),
    (["--sp", "2", "--timeout", "1e-9"], "--timeout: must be a finite number of seconds >= 1"),
    (["--sp", "2", "--timeout", "inf"], "--timeout: must be a finite number of seconds >= 1"),
    (["--sp", "1", "--warmup", "-1"], "--warmup: must be an integer >= 0"),
    (["--sp", "1", "--threads", "0"], "--threads: must be an integer >= 1"),
    (["--sp", "0"], "--sp: must be an integer >= 1"),
    (["--sp", "1", "--max-memory", "-2"], "--max-memory: must be a finite number > 0"),
    (["--sp", "2", "--planner", "foo"], "unknown planner 'foo'"),
    (["--sp", "1", "--checkpoint", "/nonexistent/w.pth"], "no such file"),
    (["--sp", "1", "--frames", "5"], "--frames goes with --resolution"),
])
def test_run_bad_arguments(capsys, no_spawn, extra, msg):
    assert msg in fails(capsys, [*RUN, *extra])


def test_run_layers_beyond_preset_with_checkpoint(capsys, no_spawn, tmp_path):
    ck = tmp_path / "w.pth"
    ck.write_bytes(b"x")
    assert "tiny has 4 layers" in fails(capsys, [*RUN, "--sp", "1", "--layers", "5", "--checkpoint", str(ck)])


@pytest.mark.parametrize("sp", [1, 2])
def test_run_bad_checkpoint_is_one_line(capsys, tmp_path, sp):
    bad = tmp_path / "garbage.pth"
    bad.write_bytes(b"not a checkpoint")
    err = fails(capsys, [*RUN, "--sp", str(sp), "--checkpoint", str(bad)], code=1)
    assert "unreadable checkpoint" in err and str(bad) in err


def test_run_mismatched_checkpoint_is_one_line(capsys, tmp_path):
    ck = tmp_path / "other.pth"
    torch.save({"foo.weight": torch.zeros(2)}, ck)
    err = fails(capsys, [*RUN, "--sp", "1", "--checkpoint", str(ck)], code=1)
    assert err.startswith("ditsp run: error: checkpoint does not match the model:") and "missing (" in err


@pytest.mark.parametrize("extra,msg", [
    (["--layers", "0"], "--layers: must be an integer >= 1"),
    (["--planner", "foo"], "unknown planner 'foo'"),
    (["--frames", "5"], "--frames goes with --resolution"),
    (["--max-plan-memory", "0"], "--max-plan-memory: must be a finite number > 0"),
])
def test_plan_bad_arguments(capsys, extra, msg):
    assert msg in fails(capsys, ["plan", "--grid", "5,20,36", "--sp", "2", *extra])


def test_plan_plot_into_missing_folder_checked_first(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("ditsp.models.seedvr2.job.plan_report.plan_request",
                        lambda *a, **k: pytest.fail("planned before checking --plot"))
    err = fails(capsys, ["plan", "--grid", "5,20,36", "--sp", "2", "--plot", str(tmp_path / "no" / "p.png")])
    assert "does not exist" in err


@pytest.mark.parametrize("argv,msg", [
    (["bench", "attention", "--sp", "2", "--seq", "8", "--heads", "2", "--strategies", "foo"], "unknown name(s) 'foo'"),
    (["bench", "attention", "--sp", "2", "--seq", "8", "--heads", "2", "--strategies", "usp-ring"], "2D mesh"),
    (["bench", "attention", "--sp", "2", "--seq", "8", "--heads", "2", "--iters", "0"], "--iters: must be"),
    (["bench", "attention", "--sp", "2", "--seq", "8", "--heads", "2", "--warmup", "-1"], "--warmup: must be"),
    (["bench", "attention", "--sp", "2", "--seq", "0", "--heads", "2"], "--seq: must be"),
    (["bench", "forward", "--sp", "2,x"], "--sp: must be comma-separated integers >= 1"),
    (["bench", "forward", "--sp", "2,0"], "--sp: must be comma-separated integers >= 1"),
    (["bench", "forward", "--layers", "0"], "--layers: must be an integer >= 1"),
    (["bench", "forward", "--repeats", "0"], "--repeats: must be an integer >= 1"),
    (["bench", "forward", "--grid", "1,2"], "--grid"),
    (["bench", "forward", "--model", "nope"], "invalid choice"),
    (["bench", "planners", "--ilp-seconds", "-1"], "--ilp-seconds: must be a finite number >= 0"),
    (["verify", "somewhere", "--sp", "1,,2"], "--sp: must be comma-separated integers >= 1"),
    (["verify", "somewhere", "--sp", "0"], "--sp: must be comma-separated integers >= 1"),
])
def test_bench_and_verify_bad_arguments(capsys, no_spawn, monkeypatch, argv, msg):
    monkeypatch.setattr("ditsp.bench.attention.run_bench", lambda *a, **k: pytest.fail("benchmark started"))
    monkeypatch.setattr("ditsp.bench.forward.measure", lambda *a, **k: pytest.fail("benchmark started"))
    assert msg in fails(capsys, argv)


def test_bench_forward_out_not_creatable(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("ditsp.bench.forward.measure", lambda *a, **k: pytest.fail("benchmark started"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "--out" in fails(capsys, ["bench", "forward", "--out", str(blocker / "sub")])


# ---------------------------------------------------------------- issue #44 items 10 and 13


def test_sp_0_is_the_commands_own_error(capsys, tmp_path, no_spawn):
    """Before: the top-level usage (`usage: ditsp [-h] {plan,run,...}`) and `ditsp: error: --sp must be >= 1`."""
    with pytest.raises(SystemExit) as e:
        main(["upscale", str(tmp_path / "in.mp4"), "-o", str(tmp_path / "out.mp4"), "--sp", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: ditsp upscale "), err
    assert re.search(r"^ditsp upscale: error: argument --sp: must be an integer >= 1, got '?0'?$", err, re.M), err


@pytest.mark.parametrize("argv", [["upscale", "in.mp4", "-o", "out.mp4"], ["generate", "folder", "--embeds", "e",
                                                                           "-o", "x.mp4"], ["train"]])
@pytest.mark.parametrize("value", ["inf", "nan", "1e-9", "0", "-5"])
def test_every_stuck_rank_timeout_is_range_checked(capsys, no_spawn, argv, value):
    """`--timeout inf` was a traceback (train, upscale); `--timeout 1e-9` 38 lines of C++ frames (a 0 ms
    connect timeout at the rendezvous) before its error."""
    err = fails(capsys, [*argv, f"--timeout={value}"])
    assert err.endswith(f"argument --timeout: must be a finite number of seconds >= 1, got '{value}'"), err


def test_a_failed_rank_of_run_prints_the_error_line_first(capsys, monkeypatch):
    """A rank killed during `ditsp run` printed the launcher's traceback (~70 lines) before the error line."""
    from ditsp.distributed.launcher import RankError

    report = ("rank_forward failed on 2 ranks: rank 1: died of SIGKILL (exit code -9)\n"
              "--- rank 0: no answer; every thread's stack ---\nThread 0x1 (most recent call first):\n  File x")

    def killed(spec, **kw):
        raise RankError(report)

    monkeypatch.setattr("ditsp.models.seedvr2.job.forward.run", killed)
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--sp", "2", "--max-memory", "100"])
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in lines if "warning:" not in ln]  # the oversubscription warning on a small machine
    assert e.value.code == 1
    assert lines[0] == "ditsp run: error: rank_forward failed on 2 ranks: rank 1: died of SIGKILL (exit code -9)"
    assert lines[1:] == report.splitlines()[1:] and "Traceback" not in "\n".join(lines)


def test_doctor_says_what_it_is_doing_as_it_goes(capsys, monkeypatch):
    """It printed nothing for 2.5-7 minutes at the released widths: each check is named before it runs."""
    from ditsp import fixed_shape_probe as fsp

    seen = []

    def check(kind):
        def run(*a, **k):
            seen.append((kind, capsys.readouterr().err))  # what stderr said just before this check ran
            return {"shape": "s", "holds": True}
        return run

    for kind in ("gemm", "attention", "conv"):
        monkeypatch.setattr(fsp, f"_{kind}", check(kind))
    assert main(["doctor", "--model", "tiny", "--dtype", "fp32,bf16", "--json"]) == 0
    assert [k for k, _ in seen] == ["gemm", "gemm", "attention", "conv"] * 2
    assert "ditsp doctor: probing tiny's kernel shapes (fp32, bf16" in seen[0][1]
    for i, ((kind, err), dtype) in enumerate(zip(seen, ["fp32"] * 4 + ["bf16"] * 4)):
        assert err.strip().splitlines()[-1] == f"ditsp doctor: check {i + 1} of 8: {kind}, {dtype}"
