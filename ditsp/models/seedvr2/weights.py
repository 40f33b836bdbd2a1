"""The three SeedVR2 pieces a restoration needs, built once per rank: DiT, VAE, text embedding.

A model name picks a DiT preset and its VAE preset (:mod:`.presets`). Weights
come from the given checkpoints, else from the files the package ships for the
model (``tiny``), else, only when ``random_weights`` asks for it, are seeded
identically on every rank (a smoke test of the whole path, not a restoration).
The released text input is ``pos_emb.pt``; without one a seeded embedding of
the preset's shape stands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...dtypes import DTYPES
from ...weights.load import quantize_
from .. import resident
from .nadit.config import PRESETS as DIT_PRESETS
from .nadit.model import build_model
from .vae import VideoVAE, load_checkpoint
from .vae.fixtures import seeded_vae
from .vae.config import PRESETS as VAE_PRESETS

from .presets import MODELS, OFFERED, check_weights, default_dtype, model as model_of  # noqa: F401 - re-exported
from ...weights import error_line
from .nadit.checkpoint import CheckpointError
from .vae import CheckpointError as VAECheckpointError
from ...weights.fp8 import canonical
from ...weights.shared import check_read
from .nadit.checkpoint import load_text_embedding
from ..meta import meta_device


@dataclass(frozen=True)
class WeightsSpec:
    """Everything that determines the weights on a rank (the per-process cache key)."""

    model: str = "tiny"
    dit: str | None = None
    vae: str | None = None
    text_embedding: str | None = None
    dtype: str = "fp32"
    seed: int = 0
    weights_dtype: str | None = None  # "fp8"/"fp8_e5m2": quantize float weights at load (ditsp/weights)
    read: str | None = None  # how an SP group reads the files (ditsp/weights/shared.py READS; None: its default)
    random_weights: bool = False  # seeded random weights where no file is named (smoke tests, benchmarks)

    def __post_init__(self):
        canonical(self.weights_dtype)  # an unknown name raises here, before any rank loads
        check_read(self.read)
        m = model_of(self.model)
        if m.dit not in DIT_PRESETS:
            raise ValueError(f"model {self.model!r} has no DiT preset")
        check_weights(self.model, self.dit, self.vae, self.random_weights)
        if m.shipped_files and not self.random_weights:  # the weights shipped with the package fill the gaps
            dit, vae = m.shipped_files
            object.__setattr__(self, "dit", self.dit or str(dit))
            object.__setattr__(self, "vae", self.vae or str(vae))

    @property
    def random(self) -> bool:
        """Whether any piece is seeded random weights (the report says so on its first line)."""
        return not (self.dit and self.vae)


@dataclass
class SeedVR2:
    """A rank's DiT, VAE and text embedding."""

    spec: WeightsSpec
    dit: torch.nn.Module
    vae: VideoVAE
    text: torch.Tensor


def _key(spec: WeightsSpec, device) -> tuple:
    return ("seedvr2", spec, str(device))


def load(spec: WeightsSpec, device: torch.device | str = "cpu", comm=None) -> SeedVR2:
    """The pieces of ``spec`` for this process (built on first use; the process's one model cache).

    ``comm``: the SP group's ranks, loading the checkpoints together when none of them holds the
    pieces yet (the way ``spec.read`` names, ``ditsp/weights/shared.py``; a bad file is the same error
    on every rank); where some already hold them the others load alone."""
    key = _key(spec, device)
    if comm is not None and comm.world_size > 1 and not all(comm.all_gather_object(resident.peek(key) is None)):
        comm = None
    return resident.get(key, lambda: _build(spec, device, comm))


def _build(spec: WeightsSpec, device, comm=None) -> SeedVR2:
    dtype = DTYPES[spec.dtype]
    m = model_of(spec.model)
    dit = build_model(m.dit, checkpoint=spec.dit, seed=spec.seed, dtype=dtype, device=device,
                      weights_dtype=spec.weights_dtype, comm=comm, read=spec.read)
    vae_cfg = VAE_PRESETS[m.vae]
    if spec.vae:
        with meta_device():  # streamed: tensors are read one by one into the final dtype
            vae = VideoVAE(vae_cfg)
        _load_vae(vae, spec.vae, dtype, spec.weights_dtype, comm, spec.read)
    else:
        vae = quantize_(seeded_vae(vae_cfg, spec.seed + 7), spec.weights_dtype, dtype)
    vae = vae.to(device=device, dtype=dtype).eval().requires_grad_(False)
    cfg = dit.cfg
    if spec.text_embedding:
        text = load_text_embedding(spec.text_embedding, cfg.txt_in_dim)
    else:
        text = torch.randn(cfg.txt_len, cfg.txt_in_dim, generator=torch.Generator().manual_seed(spec.seed + 11))
    return SeedVR2(spec, dit, vae, text.to(device))


def _load_vae(vae, path: str, dtype: torch.dtype = torch.float32, weights_dtype: str | None = None, comm=None,
              read: str | None = None) -> None:
    """The VAE checkpoint into ``vae``; an unreadable file is one line (never torch's advice to load unsafely)."""

    try:
        load_checkpoint(vae, path, dtype=dtype, weights_dtype=weights_dtype, comm=comm, read=read)
    except (CheckpointError, VAECheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - a pickle payload, a truncated file, a wrong format
        raise CheckpointError(f"{path}: unreadable VAE checkpoint ({error_line(e)})") from None


def cached(spec: WeightsSpec, device: torch.device | str = "cpu") -> SeedVR2 | None:
    """The pieces of ``spec`` if this process holds them already, else None (nothing is loaded)."""
    return resident.peek(_key(spec, device))


def install(models: SeedVR2, device: torch.device | str = "cpu") -> None:
    """Make ``models`` (weights received in memory, e.g. from a peer rank) what :func:`load` returns."""
    resident.put(_key(models.spec, device), models)
