"""SeedVR2's model names: each a DiT preset, a VAE preset, where its weights come from, and its defaults.

The one table of models (:data:`MODELS`). Kept apart from :mod:`.weights` (which builds the networks) so
that a front door can list the names, and refuse a model without weights, without importing the DiT and
the VAE.

Weights come from the files a user names (``--dit``/``--vae``), else from the files the package ships
(``tiny``: the small restorer trained in the repo, ``ditsp/models/seedvr2/trained/tiny``), else nowhere:
seeded random weights are built only when asked for (``random_weights``), for smoke tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TRAINED = Path(__file__).with_name("trained")  # weights shipped as package data, one folder per model


@dataclass(frozen=True)
class Model:
    """One model a front door offers."""

    name: str
    dit: str  # DiT preset (nadit/config.py PRESETS)
    vae: str  # VAE preset (vae/config.py PRESETS)
    dtype: str  # the compute dtype when none is asked for
    shipped: str | None = None  # folder under TRAINED holding dit.safetensors and vae.safetensors
    checkpoints: str = ""  # the files a user passes when nothing is shipped (named in the refusal)
    scale: float | None = None  # default output: this many times the input's sides (None: ``area``)
    area: tuple[int, int] | None = (1280, 720)  # default output area (w, h), aspect kept
    offered: bool = True  # listed by front doors (False: kept for old scripts and tests)
    # the colour fix when none is asked for (pipeline/color_fix.py): the released models' lossy VAE drifts in
    # colour; the small restorer's VAE is lossless, and the wavelet fix put the input's low frequencies (a
    # compressed video's blocks) back over its corrections: 0.01 dB under bicubic on the real video, 0.03 above
    # without (docs/performance.md)
    color_fix: str = "wavelet"

    @property
    def shipped_files(self) -> tuple[Path, Path] | None:
        """(DiT, VAE) files shipped with the package, or None."""
        if self.shipped is None:
            return None
        return TRAINED / self.shipped / "dit.safetensors", TRAINED / self.shipped / "vae.safetensors"


_RELEASED_FILES = "--dit (e.g. seedvr2_ema_3b.pth or a FP8/GGUF conversion) and --vae (ema_vae.pth)"
MODELS = {m.name: m for m in (
    Model("tiny", "tiny", "tiny-2x", "fp32", shipped="tiny", scale=2.0, area=None, color_fix="none"),
    Model("seedvr2-3b", "seedvr2-3b", "released", "bf16", checkpoints=_RELEASED_FILES),
    Model("seedvr2-7b", "seedvr2-7b", "released", "bf16",
          checkpoints=_RELEASED_FILES.replace("seedvr2_ema_3b", "seedvr2_ema_7b")),
    Model("seedvr2-1.4b", "seedvr2-1.4b", "released", "bf16",
          checkpoints="--dit (the six-block distillation of the 7B) and --vae (ema_vae.pth)"),
    # the reference vectors' structures (tests, benchmarks): seeded random weights only
    Model("tiny-8x", "tiny", "tiny", "fp32", checkpoints="--dit and --vae", scale=2.0, area=None),
    Model("tiny-7b", "tiny-7b", "tiny", "fp32", checkpoints="--dit and --vae", scale=2.0, area=None),
    Model("small", "small", "tiny", "fp32", checkpoints="--dit and --vae", scale=2.0, area=None, offered=False),
)}
OFFERED = tuple(name for name, m in MODELS.items() if m.offered)  # what front doors list
DEFAULT_MODEL = "tiny"


def model(name: str) -> Model:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(OFFERED)}") from None


def default_dtype(name: str) -> str:
    """The compute dtype when none is asked for: bf16 for the released models, fp32 for the tiny ones."""
    return model(name).dtype


def check_weights(name: str, dit: str | None, vae: str | None, random_weights: bool) -> None:
    """Refuse, in one line and before any rank starts, a model that would run without weights."""
    m = model(name)
    if random_weights or (dit and vae) or m.shipped:
        return
    missing = " and ".join(flag for flag, path in (("--dit", dit), ("--vae", vae)) if not path)
    raise ValueError(f"model {name} has no weights without checkpoints: pass {m.checkpoints} "
                     f"(missing {missing}), or --random-weights for a smoke test with seeded random weights")


def vae_config(name: str):
    """The VAE structure of model ``name`` (its factors are the one source of every latent size)."""
    from .vae.config import PRESETS  # local: the config module alone, light

    return PRESETS[model(name).vae]


def dit_config(name: str, num_layers: int | None = None):
    """The DiT structure of model ``name``."""
    from .nadit.config import get_config  # local: the config module alone, light

    return get_config(model(name).dit, num_layers)
