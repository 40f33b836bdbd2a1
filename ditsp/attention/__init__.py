"""Global-attention sequence parallelism: Ulysses, Ring, USP and AllGather-KV (forward and backward),
and the public sequence helpers :func:`shard` / :func:`gather` (gradient convention in :mod:`.sequence`)."""

from .sequence import gather, shard, splits
from .usp import LAYOUTS, USP, AllGatherKV, Ring, SPAttention, Ulysses

__all__ = ["SPAttention", "Ulysses", "Ring", "AllGatherKV", "USP", "LAYOUTS", "shard", "gather", "splits"]
