"""`ditsp train` held to the bad-input standard (#44 items 5, 6, 10, 11): arguments range-checked, local
ranks the machine cannot hold refused, a non-finite loss, gradient or weight stops the run naming the step,
checkpoints never hold NaN, and every malformed checkpoint, a full disk and quantized weights are one line."""

from __future__ import annotations

import os
import pathlib
import resource
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditsp.train import checkpoint as ckpt
from ditsp.train.loop import TrainConfig, Trainer

from .cli_errors import fails

pytestmark = pytest.mark.timeout(300)

TRAIN = ["train", "--frames", "1", "--size", "32x32", "--batch", "1", "--no-progress"]




@pytest.fixture
def no_ranks(monkeypatch):
    """Any attempt to start ranks or train fails the test."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr("ditsp.distributed.launcher.launch", boom)
    monkeypatch.setattr("ditsp.train.loop.rank_train", boom)


def small(out, **kw) -> TrainConfig:
    base = dict(out=str(out), steps=1, batch=1, frames=1, size=(32, 32), progress=False, checkpoint_every=1,
                warmup=1, plot=False)
    return TrainConfig(**{**base, **kw})


# -- item 6: arguments range-checked -------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value,msg", [
    ("--lr", "0", "must be a finite number > 0"), ("--lr", "-1e-3", "must be a finite number > 0"),
    ("--lr", "nan", "must be a finite number > 0"), ("--lr", "inf", "must be a finite number > 0"),
    ("--clip", "-1", "must be a finite number > 0"), ("--clip", "nan", "must be a finite number > 0"),
    ("--clip", "0", "must be a finite number > 0"),
    ("--weight-decay", "-0.1", "must be a finite number >= 0"), ("--weight-decay", "nan", "must be a finite"),
    ("--timeout", "inf", "must be a finite number of seconds >= 1"),  # item 10: was a traceback
    ("--timeout", "1e-9", "must be a finite number of seconds >= 1"),
    ("--sp", "0", "must be an integer >= 1"),
])
def test_train_arguments_are_range_checked(tmp_path, capsys, no_ranks, flag, value, msg):
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path), f"{flag}={value}"], 2)
    assert err.startswith("ditsp train: error: ") and f"argument {flag}: {msg}" in err


@pytest.mark.parametrize("field,value", [("lr", float("nan")), ("lr", 0.0), ("clip", -1.0), ("clip", float("inf")),
                                         ("weight_decay", -1.0), ("weight_decay", float("nan"))])
def test_the_config_refuses_what_the_command_refuses(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        small(tmp_path, **{field: value})


# -- item 5: local ranks the machine cannot hold ---------------------------------------------------------------


def test_more_ranks_than_the_cores_can_take_are_refused(tmp_path, capsys, monkeypatch, no_ranks):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr("ditsp.memory.available_bytes", lambda n, device=None: 2**40 // n)  # memory enough
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path), "--sp", "64"], 2)
    assert "--sp 64: 64 local ranks on 2 CPU cores (more than 8 per core)" in err


def test_more_ranks_than_the_memory_holds_are_refused(tmp_path, capsys, monkeypatch, no_ranks):
    monkeypatch.setattr("ditsp.memory.available_bytes", lambda n, device=None: 2**30 // n)
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path), "--sp", "4"], 2)
    assert "--sp 4: 4 local ranks need about 1.2 GiB for their processes alone" in err


# -- item 6: a non-finite loss, gradient or weight stops the run -------------------------------------------------


def test_a_runaway_learning_rate_stops_at_the_step_the_loss_turned(tmp_path, capsys):
    """`--lr 1e12` exited 0 and wrote weights with a million NaNs."""
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path), "--lr", "1e12", "--steps", "20", "--checkpoint-every",
                         "1"], 1)
    assert err.startswith("ditsp train: step 2: the loss is nan; training stopped (the last checkpoint, after "
                          "step 1, is kept")
    assert not (tmp_path / "dit.safetensors").exists() and not (tmp_path / "report.json").exists()
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 1 and not ckpt.nonfinite(state["modules"]["dit"].items())


def test_a_weight_made_non_finite_by_a_step_stops_before_it_is_kept(tmp_path, monkeypatch):
    t = Trainer(small(tmp_path, steps=3))
    real = t.opt.step

    def poisoned():
        real()
        if t.step == 1:
            t.dit.txt_in.weight.data[0, 0] = float("nan")

    monkeypatch.setattr(t.opt, "step", poisoned)
    with pytest.raises(ckpt.NonFiniteError, match=r"^step 2: the optimizer step made 1 weight tensor\(s\) NaN or "
                                                  r"Inf \(dit.txt_in.weight; lr "):
        t.run()
    assert t.step == 1 and torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 1


def test_non_finite_gradients_stop_before_the_optimizer_step(tmp_path, monkeypatch):
    t = Trainer(small(tmp_path, steps=2))
    real = t.gradients

    def inf_grads(step):
        loss = real(step)
        t.params[0].grad.view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(t, "gradients", inf_grads)
    before = [p.detach().clone() for p in t.params]
    with pytest.raises(ckpt.NonFiniteError, match=r"^step 1: the gradient norm is inf .*no checkpoint was written"):
        t.run()
    assert all(torch.equal(a, p) for a, p in zip(before, t.params))  # no step taken
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_checkpoint_is_never_written_with_nan(tmp_path):
    t = Trainer(small(tmp_path))
    t.run()
    good = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        t.dit.txt_in.weight[0, 0] = float("nan")
    with pytest.raises(ckpt.NonFiniteError, match=r"not written at step 1: 1 tensor\(s\) hold NaN or Inf "
                                                  r"\(dit.txt_in.weight\)"):
        t.save()
    assert (tmp_path / "checkpoint.pt").read_bytes() == good
    with pytest.raises(ckpt.NonFiniteError, match=r"w.safetensors: not written: .* \(txt_in.weight\)"):
        ckpt.export_weights(tmp_path / "w.safetensors", t.dit)
    assert not (tmp_path / "w.safetensors").exists()


# -- items 6 and 10: --resume from a checkpoint that is not this run's, finite, whole one -----------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step run's output folder (its checkpoint.pt is what the cases below break)."""
    out = tmp_path_factory.mktemp("trained")
    Trainer(small(out)).run()
    return out


class Payload:
    """Unpickling this would create a file: a weights_only load must refuse it, not run it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _edit(state, case, marker):
    """``state`` broken as ``case`` says (None: the file is written from bytes instead)."""
    dit = state["modules"]["dit"]
    if case == "nan weight":
        dit["txt_in.weight"][0, 0] = float("nan")
    elif case == "inf moment":
        state["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[0] = float("inf")
    elif case == "wrong keys":
        dit["txt_in.extra"] = dit.pop("txt_in.weight")
    elif case == "wrong shapes":
        dit["txt_in.weight"] = dit["txt_in.weight"][:, :3].clone()
    elif case == "wrong moment shape":
        state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    elif case == "no modules":
        del state["modules"]
    elif case == "a list":
        return [1, 2, 3]
    elif case == "losses":
        state["losses"] = ["x"]
    elif case == "payload":
        state["config"] = {"x": Payload(marker)}
    return state


@pytest.mark.parametrize("case,msg", [
    ("truncated", "unreadable training checkpoint (not a zip archive: cut short, or another kind of file)"),
    ("not a zip", "unreadable training checkpoint (not a zip archive: cut short, or another kind of file)"),
    ("empty", "unreadable training checkpoint (an empty file)"),
    ("payload", "unreadable training checkpoint (not a plain tensor state_dict)"),
    ("a list", "not a ditsp training checkpoint (format 'list', expected 1)"),
    ("no modules", "malformed training checkpoint: no modules"),
    ("wrong keys", "malformed training checkpoint: dit: missing txt_in.weight; unexpected txt_in.extra"),
    ("wrong shapes", "malformed training checkpoint: mis-shaped or mistyped: dit.txt_in.weight: ("),
    ("wrong moment shape", "malformed training checkpoint: optimizer exp_avg of parameter 0: shape (3,)"),
    ("losses", "malformed training checkpoint: the loss history is not 1 numbers"),
    ("nan weight", "malformed training checkpoint: 1 tensor(s) hold NaN or Inf (dit.txt_in.weight)"),
    ("inf moment", "malformed training checkpoint: 1 tensor(s) hold NaN or Inf (optimizer exp_avg_sq of dit."),
])
def test_resume_from_a_bad_checkpoint_is_one_line_and_loads_nothing(trained, tmp_path, capsys, case, msg):
    good = (trained / "checkpoint.pt").read_bytes()
    path = tmp_path / "checkpoint.pt"
    marker = tmp_path / "payload-ran"
    if case == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif case == "not a zip":
        path.write_bytes(b"\x00garbage" * 100)
    elif case == "empty":
        path.write_bytes(b"")
    else:
        torch.save(_edit(torch.load(trained / "checkpoint.pt", weights_only=True), case, marker), path)
    t = Trainer(small(tmp_path, steps=2, resume=True))
    before = {k: v.clone() for k, v in t.dit.state_dict().items()}
    with pytest.raises(ValueError) as e:
        t.run()
    assert str(e.value).startswith(f"{path}: ") and msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert all(torch.equal(v, t.dit.state_dict()[k]) for k, v in before.items()), "nothing loaded"
    assert not marker.exists(), "the pickle payload ran"


def test_resume_from_a_bad_checkpoint_at_the_command_is_one_line(trained, tmp_path, capsys):
    state = torch.load(trained / "checkpoint.pt", weights_only=True)
    state["modules"]["dit"]["txt_in.weight"] = state["modules"]["dit"]["txt_in.weight"][:, :3].clone()
    state["config"]["warmup"] = TrainConfig.warmup  # the command's (the fixture's run warms up for one step)
    torch.save(state, tmp_path / "checkpoint.pt")
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path), "--steps", "2", "--resume", "--checkpoint-every", "1"], 1)
    assert err.startswith(f"ditsp train: {tmp_path / 'checkpoint.pt'}: malformed training checkpoint: mis-shaped")


# -- item 10: a full disk at a checkpoint write ------------------------------------------------------------------


def _file_size_limit(limit: int):
    def apply():  # a write past ``limit`` bytes fails with EFBIG, as one past a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_old_one(tmp_path):
    """torch's own message for a failed write is `unexpected pos 704 vs 598`, after a traceback."""
    (tmp_path / "checkpoint.pt").write_bytes(b"old")
    cmd = [sys.executable, "-m", "ditsp.cli", *TRAIN, "--out", str(tmp_path), "--steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, preexec_fn=_file_size_limit(2**20))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(err) == 1, r.stderr
    assert err[0].startswith(f"ditsp train: {tmp_path / 'checkpoint.pt'}: cannot write it (") and "MiB free" in err[0]
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left


def test_atomic_write_names_the_file_for_any_writer_failure(tmp_path):
    def torch_like(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    with pytest.raises(OSError, match=r"x.pt: cannot write it \(\[enforce fail .* 598\); \d+ MiB free"):
        ckpt.atomic_write(tmp_path / "x.pt", torch_like)
    assert list(tmp_path.iterdir()) == []


# -- items 10 and 11: the initial weights ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit_file(tmp_path_factory):
    from ditsp.models.seedvr2.nadit.model import build_model

    path = tmp_path_factory.mktemp("dit") / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in build_model("tiny", seed=0).state_dict().items()}, str(path))
    return path


def test_quantized_initial_weights_are_refused_in_one_line(dit_file, tmp_path, capsys):
    from ditsp.weights.convert import save_gguf, save_fp8
    from ditsp.weights.gguf_write import q8_0

    sd = load_file(str(dit_file))
    for path in (save_gguf(sd, tmp_path / "dit.gguf", q8_0), save_fp8(sd, tmp_path / "dit_fp8.safetensors")):
        err = fails(capsys, [*TRAIN, "--out", str(tmp_path / "o"), "--steps", "1", "--dit", str(path)], 1)
        assert err == (f"ditsp train: --dit {path}: quantized weights (FP8/GGUF) cannot be trained; give a float "
                       f"checkpoint (fp32/fp16/bf16 .safetensors or .pth)")


def test_non_finite_initial_weights_are_named(dit_file, tmp_path, capsys):
    """Before: `checkpoint does not match the model:` with nothing after it."""
    sd = load_file(str(dit_file))
    sd["vid_in.proj.weight"][0, 0] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    err = fails(capsys, [*TRAIN, "--out", str(tmp_path / "o"), "--steps", "1", "--dit",
                         str(tmp_path / "nan.safetensors")], 1)
    assert err.startswith("ditsp train: checkpoint does not match the model; non-finite (1); vid_in.proj.weight: "
                          "1 NaN, 0 Inf of ")


def _as_nobody(code: str) -> subprocess.CompletedProcess | None:
    """Run ``code`` in a Python that cannot read a mode-000 file: this user, or nobody (``setpriv``) when
    this is root; None when neither can be arranged."""
    import shutil

    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            return None
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd="/")


def test_a_permission_denied_checkpoint_is_not_reported_missing(dit_file, tmp_path_factory):
    """Before: `No such file or directory` (safetensors' and torch's reader word EACCES so)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="ditsp-perm-")  # outside pytest's 0700 folder, so nobody can reach it
    try:
        os.chmod(folder, 0o755)
        locked = pathlib.Path(folder) / "dit.safetensors"
        locked.write_bytes(dit_file.read_bytes())
        os.chmod(locked, 0)
        root = str(pathlib.Path(__file__).resolve().parent.parent)
        r = _as_nobody(f"import sys; sys.path.insert(0, {root!r})\n"
                       "from ditsp.weights import open_checkpoint\n"
                       "from ditsp.train.checkpoint import load\n"
                       f"for f in (open_checkpoint, lambda p: load(p, {{}}, None, {{}})):\n"
                       "    try:\n"
                       f"        f({str(locked)!r})\n"
                       "    except ValueError as e:\n"
                       "        print(e)\n")
        if r is None or r.returncode != 0:
            pytest.skip(f"cannot run as an unprivileged user here: {r and r.stderr[-300:]}")
        assert r.stdout.splitlines() == [f"{locked}: not readable (permission denied)",
                                         f"{locked}: training checkpoint not readable (permission denied)"]
    finally:
        os.chmod(locked, 0o644)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
