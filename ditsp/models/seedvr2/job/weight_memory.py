"""What a rank holds for the SeedVR2 DiT's weights: by stored format, from a checkpoint's header or a
format name (``ditsp/weights/sizing.py`` does the counting; here the DiT's tensor shapes)."""

from __future__ import annotations

from functools import lru_cache

from ....weights.sizing import WeightBytes, by_format, of_checkpoint
from ..presets import dit_config
from ..nadit.model import NaDiT
from ....weights.fp8 import canonical
from ...meta import meta_device


@lru_cache(maxsize=16)
def dit_shapes(model: str, layers: int | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every DiT tensor of a preset, from a meta build (nothing allocated)."""

    with meta_device():
        net = NaDiT(dit_config(model, layers))
    return tuple((k, tuple(v.shape)) for k, v in net.state_dict().items())


def dit_weights(model: str, dtype: str, checkpoint: str | None = None, weights_dtype: str | None = None,
                fmt: str | None = None, layers: int | None = None) -> WeightBytes:
    """Kept bytes and dequantization buffer of the DiT on one rank.

    A checkpoint's header decides when one is given (``weights_dtype`` quantizes its float weights);
    otherwise ``fmt`` (an :data:`~ditsp.weights.sizing.ESTIMATE_FORMATS` name), ``weights_dtype``,
    or the compute dtype itself."""
    if checkpoint:
        return of_checkpoint(checkpoint, dtype, weights_dtype)

    return by_format(dict(dit_shapes(model, layers)), fmt or canonical(weights_dtype) or dtype, dtype)
