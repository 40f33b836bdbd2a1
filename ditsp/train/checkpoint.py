"""Training checkpoints: written atomically, resumed bit for bit.

A checkpoint holds everything the next step depends on: the trainable
modules' weights, the optimizer's state (AdamW moments and step counts), the
step number and the loss history. The data and the noise of step ``s`` are a
pure function of (seed, s) (:mod:`.data`, :mod:`.loop`), so no RNG state is
needed. The file is written to a temporary name in the same directory and
renamed over the old one, so a crash leaves either the old or the new
checkpoint, never half of one. Final weights go out as safetensors.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMAT = 1


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path`` (same directory, so the rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a checkpoint or weights file is an ordinary output
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(path: Path, modules: dict, optimizer: torch.optim.Optimizer, step: int, losses: list[float],
         config: dict) -> None:
    state = {"format": FORMAT, "step": int(step), "losses": list(losses), "config": dict(config),
             "modules": {k: m.state_dict() for k, m in modules.items()}, "optimizer": optimizer.state_dict()}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load(path: Path, modules: dict, optimizer: torch.optim.Optimizer, config: dict) -> tuple[int, list[float]]:
    """Restore ``modules`` and ``optimizer`` from ``path``; returns (step, losses). The run's
    configuration must match the checkpoint's (except the step count and output paths)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: unreadable training checkpoint ({type(e).__name__})") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: training checkpoint format {state.get('format')}, expected {FORMAT}")
    keep = ("steps", "out", "resume", "progress", "json", "checkpoint_every", "plot")
    mine = {k: v for k, v in config.items() if k not in keep}
    theirs = {k: v for k, v in state["config"].items() if k not in keep}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError(f"{path}: checkpoint was made with different settings ({', '.join(diff)})")
    for k, m in modules.items():
        m.load_state_dict(state["modules"][k])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["losses"])


def export_weights(path: Path, module: torch.nn.Module) -> None:
    """The module's weights as safetensors (fp32, contiguous), atomically."""
    tensors = {k: v.detach().float().contiguous().clone() for k, v in module.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
