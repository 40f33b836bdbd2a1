"""NaDiT: the SeedVR2 3B diffusion transformer with window-aligned SP."""

from .checkpoint import CheckpointError, load_checkpoint, load_text_embedding, read_state_dict
from .config import PRESETS, SEEDVR2_3B, SMALL, TINY, NaDiTConfig, get_config
from .model import NaDiT, x0_from_v

__all__ = [
    "NaDiT", "NaDiTConfig", "x0_from_v", "get_config", "PRESETS", "SEEDVR2_3B", "TINY", "SMALL",
    "load_checkpoint", "load_text_embedding", "read_state_dict", "CheckpointError",
]
