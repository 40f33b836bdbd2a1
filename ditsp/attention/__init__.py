"""Global-attention sequence parallelism: Ulysses, Ring, USP and AllGather-KV (forward and backward)."""

from .usp import USP, AllGatherKV, Ring, SPAttention, Ulysses

__all__ = ["SPAttention", "Ulysses", "Ring", "AllGatherKV", "USP"]
