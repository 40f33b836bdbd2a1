"""Training checkpoints: written atomically, checked when read, resumed bit for bit.

A checkpoint holds everything the next step depends on: the trainable
modules' weights, the optimizer's state (AdamW moments and step counts), the
step number and the loss history. The data and the noise of step ``s`` are a
pure function of (seed, s) (:mod:`.data`, :mod:`.loop`), so no RNG state is
needed. The file is written to a temporary name in the same directory and
renamed over the old one, so a crash leaves either the old or the new
checkpoint, never half of one; a failed write (a full disk) is one line naming
the file and the free space, and the old checkpoint stays. A checkpoint never
holds NaN or Inf: :func:`save` refuses before writing, :func:`load` refuses a
file that does (or that is malformed in any way) before anything is loaded.
Final weights go out as safetensors.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..weights.formats import error_line

FORMAT = 1
KEYS = ("format", "step", "losses", "config", "modules", "optimizer")


class NonFiniteError(ValueError):
    """A loss, a gradient or a weight that is NaN or Inf: the run stops rather than train or save it."""


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path`` (same directory, so the rename is atomic). A failed
    write raises one-line :class:`OSError` naming ``path`` and the free space (torch's own message for a
    full disk is ``unexpected pos 704 vs 598``); ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a checkpoint or weights file is an ordinary output
        os.replace(tmp, path)
    except (OSError, RuntimeError, SafetensorError) as e:
        _unlink(tmp)
        free = shutil.disk_usage(path.parent).free
        err = OSError(f"{path}: cannot write it ({error_line(e)}); {free / 2**20:.0f} MiB free on its disk")
        err.errno = getattr(e, "errno", None)
        raise err from e
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(tmp: str) -> None:
    if os.path.exists(tmp):
        os.unlink(tmp)


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold NaN or Inf."""
    return [name for name, t in tensors
            if torch.is_tensor(t) and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _param_names(modules: dict, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name (``<module>.<parameter>``), in its state_dict's index order."""
    by_id = {id(p): f"{k}.{n}" for k, m in modules.items() for n, p in m.named_parameters()}
    return [by_id.get(id(p), f"parameter {i}") for i, p in
            enumerate(p for g in optimizer.param_groups for p in g["params"])]


def _state_tensors(modules: dict, optimizer_state: dict, names: list[str]):
    """(name, tensor) of every module weight and optimizer moment of a checkpoint's state."""
    for k, sd in modules.items():
        for n, t in sd.items():
            yield f"{k}.{n}", t
    for i, st in optimizer_state.get("state", {}).items():
        for n, t in st.items():
            yield f"optimizer {n} of {names[i] if isinstance(i, int) and 0 <= i < len(names) else i}", t


def save(path: Path, modules: dict, optimizer: torch.optim.Optimizer, step: int, losses: list[float],
         config: dict) -> None:
    """Write the checkpoint of ``step`` atomically; :class:`NonFiniteError` (nothing written) if any
    weight, moment or loss is NaN or Inf."""
    opt = optimizer.state_dict()
    state = {"format": FORMAT, "step": int(step), "losses": list(losses), "config": dict(config),
             "modules": {k: m.state_dict() for k, m in modules.items()}, "optimizer": opt}
    bad = nonfinite(_state_tensors(state["modules"], opt, _param_names(modules, optimizer)))
    bad += [f"the loss of step {i + 1}" for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        raise NonFiniteError(f"{path}: not written at step {step}: {len(bad)} tensor(s) hold NaN or Inf "
                             f"({_names(bad)})")
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load(path: Path, modules: dict, optimizer: torch.optim.Optimizer, config: dict) -> tuple[int, list[float]]:
    """Restore ``modules`` and ``optimizer`` from ``path``; returns (step, losses). The run's
    configuration must match the checkpoint's (except the step count and output paths), and the file
    must hold exactly this run's weights and AdamW state, all finite: otherwise one-line ValueError
    and nothing is loaded."""
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: training checkpoint not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path}: unreadable training checkpoint (an empty file)")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no central directory
        raise ValueError(f"{path}: unreadable training checkpoint (not a zip archive: cut short, or another "
                         f"kind of file)")
    try:  # weights_only: a pickle payload is refused, never run
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, not a zip, a payload: any reader failure
        raise ValueError(f"{path}: unreadable training checkpoint ({error_line(e)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: not a ditsp training checkpoint (format {got!r}, expected {FORMAT})")
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ValueError(f"{path}: malformed training checkpoint: no {', '.join(missing)}")
    if not isinstance(state["config"], dict):
        raise ValueError(f"{path}: malformed training checkpoint: its config is a {type(state['config']).__name__}")
    keep = ("steps", "out", "resume", "progress", "json", "checkpoint_every", "plot")
    mine = {k: v for k, v in config.items() if k not in keep}
    theirs = {k: v for k, v in state["config"].items() if k not in keep}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError(f"{path}: checkpoint was made with different settings ({', '.join(diff)})")
    problem = _mismatch(state, modules, optimizer)
    if problem:
        raise ValueError(f"{path}: malformed training checkpoint: {problem}")
    for k, m in modules.items():
        m.load_state_dict(state["modules"][k])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), [float(v) for v in state["losses"]]


def _mismatch(state: dict, modules: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """What makes ``state`` not this run's checkpoint (None: it is): step and losses, every module's
    names, shapes and dtypes, the optimizer's groups and per-parameter moments, and NaN/Inf anywhere."""
    step, losses = state["step"], state["losses"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a count"
    if not isinstance(losses, list) or len(losses) != step or not all(isinstance(v, float) for v in losses):
        return f"the loss history is not {step} numbers"
    if not isinstance(state["modules"], dict) or set(state["modules"]) != set(modules):
        return f"modules {sorted(state['modules']) if isinstance(state['modules'], dict) else '?'}, " \
               f"expected {sorted(modules)}"
    for k, m in modules.items():
        sd, want = state["modules"][k], m.state_dict()
        if not isinstance(sd, dict) or set(sd) != set(want):
            have = set(sd) if isinstance(sd, dict) else set()
            return (f"{k}: missing {_names(sorted(set(want) - have))}; unexpected "
                    f"{_names(sorted(have - set(want))) or 'none'}")
        wrong = []
        for n, w in want.items():
            t = sd[n]
            if not torch.is_tensor(t):
                wrong.append(f"{k}.{n}: a {type(t).__name__}, model {tuple(w.shape)} {w.dtype}")
            elif t.shape != w.shape or t.dtype != w.dtype:
                wrong.append(f"{k}.{n}: {tuple(t.shape)} {t.dtype}, model {tuple(w.shape)} {w.dtype}")
        if wrong:
            return f"mis-shaped or mistyped: {_names(wrong)}"
    opt, params = state["optimizer"], [p for g in optimizer.param_groups for p in g["params"]]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if (not isinstance(groups, list) or len(groups) != len(optimizer.param_groups)
            or any(not isinstance(g, dict) or len(g.get("params", ())) != len(mine["params"])
                   for g, mine in zip(groups, optimizer.param_groups))
            or not isinstance(opt.get("state"), dict)):
        return "its optimizer state is not this run's (parameter groups differ)"
    for i, st in opt["state"].items():
        if not (isinstance(i, int) and 0 <= i < len(params)) or not isinstance(st, dict):
            return f"its optimizer state names parameter {i!r} of {len(params)}"
        for n, t in st.items():
            if not torch.is_tensor(t) or (t.numel() != 1 and t.shape != params[i].shape):
                return f"optimizer {n} of parameter {i}: shape " \
                       f"{tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}, parameter {tuple(params[i].shape)}"
    bad = nonfinite(_state_tensors(state["modules"], opt, _param_names(modules, optimizer)))
    bad += [f"the loss of step {i + 1}" for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        return f"{len(bad)} tensor(s) hold NaN or Inf ({_names(bad)}); resume from an earlier copy or start afresh"
    return None


def export_weights(path: Path, module: torch.nn.Module) -> None:
    """The module's weights as safetensors (fp32, contiguous), atomically; never NaN or Inf."""
    tensors = {k: v.detach().float().contiguous().clone() for k, v in module.state_dict().items()}
    bad = nonfinite(tensors.items())
    if bad:
        raise NonFiniteError(f"{path}: not written: {len(bad)} tensor(s) hold NaN or Inf ({_names(bad)})")
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
