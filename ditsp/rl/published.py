"""The policy's weights as the trainer publishes them for spot workers: one file per version, in shared memory.

The trainer is the live peer every spot worker copies its weights from. After each update it writes the
transformer's weights (version ``v``: the weights step ``v`` samples with) to ``v<v>.pt`` in a folder under
``/dev/shm`` (a RAM file system on Linux; the system's temporary folder elsewhere), written to a temporary
name and renamed, so a worker never reads half a file. A worker that joins, or whose group re-forms, reads
the version its request names: nothing comes from the peer it lost. The trainer keeps the last
:data:`KEEP` versions (exploration reads the previous one while rollouts read the current one; every version
when the premise is audited, since audit requests may run late) and removes the folder when the run ends.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..train.checkpoint import atomic_write

KEEP = 3  # versions kept: the current, the previous (stale exploration) and one being replaced


def _root() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def digest(state: dict[str, torch.Tensor]) -> str:
    """A short hash of weights by name: equal digests, equal bits."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Published:
    """The trainer's side: :meth:`publish` a version, :attr:`folder` for the workers, :meth:`close` at the end."""

    def __init__(self, folder: str | None = None, keep_all: bool = False):
        self.folder = folder or tempfile.mkdtemp(prefix="ditsp-rl-weights-", dir=_root())
        self.keep = None if keep_all else KEEP  # every version: audits may score old ones late
        self.versions: list[int] = []
        self.digests: dict[int, str] = {}

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> str:
        """Write ``state`` as ``version`` (atomically); older versions beyond :data:`KEEP` are removed."""
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        atomic_write(path_of(self.folder, version), lambda tmp: torch.save(state, tmp))
        self.digests[version] = digest(state)
        self.versions.append(version)
        while self.keep is not None and len(self.versions) > self.keep:
            old = self.versions.pop(0)
            try:
                os.unlink(path_of(self.folder, old))
            except FileNotFoundError:
                pass
        return self.digests[version]

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def path_of(folder: str, version: int) -> Path:
    return Path(folder) / f"v{int(version)}.pt"


def read(folder: str, version: int) -> dict[str, torch.Tensor]:
    """The weights of ``version`` (one line when the file is gone: the run moved past it)."""
    path = path_of(folder, version)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: weights version {version} is no longer published") from None
