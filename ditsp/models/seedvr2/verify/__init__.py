"""Check the port against a reference vector set: one device and window-aligned SP at several degrees.

A vector set is a folder with ``config.json`` (the model's hyper-parameters
under their plain names), ``weights.safetensors`` (the reference state_dict,
reference key names) and ``io.safetensors`` (inputs ``vid_in``, ``txt_in``,
``timestep`` and the reference output ``vid_out``; optionally ``emb``,
``vid_patch_in``, ``txt_proj_in`` and per-block ``block<i>.vid``/``.txt``).

:func:`verify_vectors` reads the config, picks the checker of its kind
(:func:`~.vectors.detect_kind`, :data:`CHECKERS`: one module per component, :mod:`.nadit`,
:mod:`.vae`, :mod:`.pipeline`) and returns a plain dict (JSON-ready);
:func:`~.vectors.format_verify` renders it as text. A run passes when
``max |port - ref| <= 1e-5 * max |ref|``. A new component registers its checker in :data:`CHECKERS`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from .nadit import check_nadit, nadit_config
from .pipeline import check_pipeline
from .vae import check_vae
from .vectors import REL_TOL, ClusterFactory, VectorSetError, detect_kind, format_verify, read_config, rel_err
from ..nadit import NaDiT
from ..vae.config import VaeConfig
from ..vae.model import VideoVAE
from ...meta import meta_device

__all__ = ["CHECKERS", "REL_TOL", "VectorSetError", "detect_kind", "estimate_bytes", "format_verify", "nadit_config",
           "read_config", "rel_err", "verify_vectors"]

CHECKERS: dict[str, Callable[..., dict]] = {"nadit": check_nadit, "vae": check_vae, "pipeline": check_pipeline}


def estimate_bytes(directory: str | os.PathLike) -> int:
    """Bytes one process needs to check the set: the model ``config.json`` describes (built on the meta
    device, so nothing is allocated) twice (the model and the file's tensors while loading), plus the io file."""
    directory = os.fspath(directory)
    kind = detect_kind(read_config(directory))
    with meta_device():
        if kind == "nadit":
            model = NaDiT(nadit_config(read_config(directory), Path(directory).name))
        elif kind == "vae":
            try:
                model = VideoVAE(VaeConfig.from_json(Path(directory) / "config.json"))
            except (KeyError, TypeError, ValueError) as e:
                raise VectorSetError(f"{directory}: config.json does not describe a VAE "
                                     f"({type(e).__name__}: {e})") from None
        else:
            model = None
    params = sum(p.numel() * 4 for p in model.parameters()) if model is not None else 0
    files = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    return 2 * params + files


def verify_vectors(directory: str | os.PathLike, degrees: Sequence[int] = (1, 2, 3),
                   cluster_factory: ClusterFactory | None = None) -> dict:
    """Check the reference vector set in ``directory`` at each SP degree (1: one device).

    ``cluster_factory(n)``, when given, supplies a live LocalCluster of n ranks
    (e.g. a test's pool); otherwise one is started and closed per degree.
    Returns ``{"kind", "dir", "threshold", "runs": [{"degree", "path", "rel_err",
    "ranks_agree", "pass", ...}], "pass", ...}``.
    """
    kind = detect_kind(read_config(directory))
    if kind not in CHECKERS:
        raise VectorSetError(f"{directory}: no checker for {kind} vector sets yet (have: {', '.join(sorted(CHECKERS))})")
    return CHECKERS[kind](directory, degrees, cluster_factory)
