"""A reference vector set: its config and kind, the error measure, the one-line error and the text report
every checker shares."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch


REL_TOL = 1e-5


ClusterFactory = Callable[[int], object]  # n -> a live LocalCluster of n ranks


class VectorSetError(ValueError):
    """The folder is not a vector set this library can check."""


def read_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise VectorSetError(f"{directory}: no config.json (not a reference vector set)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VectorSetError(f"{path}: unreadable ({e})") from None


def detect_kind(config: dict) -> str:
    """The component a vector set's config describes: ``"nadit"``, ``"vae"`` or ``"pipeline"``."""
    model = str(config.get("model", ""))
    if "NaDiT" in model or config.get("block_type") == "mmdit_sr":
        return "nadit"
    if "VAE" in model or "latent_channels" in config:
        return "vae"
    if "transform" in config or "colorfix_source" in config:
        return "pipeline"
    raise VectorSetError(f"cannot tell which component this vector set is for (model {model!r})")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def format_verify(result: dict) -> str:
    """The text report of :func:`verify_vectors`'s result."""
    head = f"{result['kind']} vectors {result['dir']}"
    if "model" in result:
        m = result["model"]
        head += (f": {m['variant']} family, dim {m['vid_dim']}, {m['heads']}x{m['head_dim']} heads, "
                 f"{m['layers']} layers, grid {'x'.join(map(str, result.get('grid', [])))}")
    lines = [head, f"  bar: max|port - ref| <= {result['threshold']:g} x max|ref| ({result.get('ref_max_abs', 0):.4g})"]
    for r in result["runs"]:
        extra = "" if r["ranks_agree"] else ", ranks disagree"
        if "first_divergence" in r:
            extra += f", first divergence at {r['first_divergence']}"
        lines.append(f"  SP={r['degree']}: rel err {r['rel_err']:.2e}  {'PASS' if r['pass'] else 'FAIL'}  "
                     f"({r['path']}{extra})")
    lines.append("PASS" if result["pass"] else "FAIL")
    return "\n".join(lines)
