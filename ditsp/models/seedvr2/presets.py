"""SeedVR2's model names (each a DiT preset and its VAE preset) and the compute dtype each defaults to.

Kept apart from :mod:`.weights` (which builds the networks) so that a front
door can list the names without importing the DiT and the VAE.
"""

from __future__ import annotations

# DiT preset -> VAE preset.
MODELS = {"seedvr2-3b": "released", "seedvr2-7b": "released", "tiny": "tiny", "tiny-7b": "tiny", "small": "tiny"}
OFFERED = ("seedvr2-3b", "seedvr2-7b", "tiny", "tiny-7b")  # what front doors list ("small": kept for old scripts)


def default_dtype(model: str) -> str:
    """The compute dtype when none is asked for: bf16 for the released models, fp32 for the seeded tiny ones."""
    return "bf16" if model.startswith("seedvr2") else "fp32"
