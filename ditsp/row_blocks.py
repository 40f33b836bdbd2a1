"""Rows in cache-sized blocks: how long elementwise chains and per-row reductions run on CPU.

A chain such as RMSNorm (upcast, square, mean, scale, cast back) over a whole activation makes a
fresh whole-activation temporary per op, each mapped and page-faulted anew. Run over blocks of rows
through one reused buffer, the same ops on the same rows give the same bits (every op is per element
or per row) while the working set stays in cache.
"""

BLOCK_BYTES = 1 << 20  # one block's working buffer: about L2-sized on current x86 cores


def rows_per_block(row_bytes: int) -> int:
    """How many rows of ``row_bytes`` bytes (of the working buffer's dtype) one block holds (at least one)."""
    return max(1, BLOCK_BYTES // max(1, row_bytes))
