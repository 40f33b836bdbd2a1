"""SeedVR2's causal video VAE, ported, with chunked, sharded (time / height / both), tiled and auto execution."""

from .checkpoint import CheckpointError, load_checkpoint
from .config import PRESETS, RELEASED, TINY, VaeConfig
from .model import Posterior, VideoVAE

__all__ = ["CheckpointError", "load_checkpoint", "PRESETS", "RELEASED", "TINY", "VaeConfig", "Posterior", "VideoVAE"]
