"""Packed multi-document sequences under SP: per-document (hybrid-context) attention.

- :mod:`.docs`: ``cu_seqlens`` + per-document causal flag + joint text length, agreement;
- :mod:`.dispatch`: contiguous / zigzag / area-weighted sharding of the stream;
- :mod:`.ring_packed`: document-aware ring with a cached schedule that skips pairs sharing no document
  (per-document blocks: the kernel table's reference kernel, causal by document position);
- :mod:`.ulysses_packed`: packed Ulysses (varlen after the all-to-all) and packed USP.
"""

from .dispatch import Dispatch, dispatch
from .docs import PackedDocs, PackedDocsError, agree_docs
from .ring_packed import packed_ring_attention, ring_schedule, shard_rows, unshard_rows
from .ulysses_packed import doc_attention, packed_ulysses_attention, packed_usp_attention, usp_rows

__all__ = ["Dispatch", "dispatch", "PackedDocs", "PackedDocsError", "agree_docs", "packed_ring_attention",
           "ring_schedule", "shard_rows", "unshard_rows", "doc_attention", "packed_ulysses_attention",
           "packed_usp_attention", "usp_rows"]
