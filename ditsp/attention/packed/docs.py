"""Packed documents: one token stream holding several independent sequences.

A packed input is one token stream (THD: ``[tokens, heads, head_dim]``) plus
``cu_seqlens`` (document boundaries: document ``d`` is rows
``cu_seqlens[d]:cu_seqlens[d+1]``), a per-document ``causal`` flag and an
optional per-document joint text length (text K/V that every token of the
document also attends, never causal). Attention never crosses a document.

:class:`PackedDocs` is an immutable value; its :meth:`signature` is what every
cache (dispatch, ring schedule) is keyed by and what the ranks of a group
agree on before a collective depends on it (:func:`agree_docs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...distributed.agree import agree
from ...distributed.comm import Comm


class PackedDocsError(ValueError):
    """A packed input's document metadata is malformed (empty document, bad boundaries)."""


@dataclass(frozen=True)
class PackedDocs:
    """Document boundaries of a packed stream, each document causal or bidirectional."""

    cu_seqlens: tuple[int, ...]
    causal: tuple[bool, ...]
    text_lens: tuple[int, ...]

    @classmethod
    def make(cls, cu_seqlens: Sequence[int], causal: bool | Sequence[bool] = False,
             text_lens: Sequence[int] | None = None) -> "PackedDocs":
        """Validate and build. ``causal`` is one flag for all documents or one per document."""
        cu = tuple(int(v) for v in cu_seqlens)
        if len(cu) < 2 or cu[0] != 0:
            raise PackedDocsError(f"cu_seqlens must start at 0 and name at least one document, got {list(cu)}")
        n = len(cu) - 1
        for d in range(n):
            if cu[d + 1] < cu[d]:
                raise PackedDocsError(f"cu_seqlens must not decrease: document {d} runs {cu[d]}..{cu[d + 1]}")
            if cu[d + 1] == cu[d]:
                raise PackedDocsError(
                    f"document {d} is empty (cu_seqlens[{d}] == cu_seqlens[{d + 1}] == {cu[d]}); "
                    "drop empty documents before packing")
        flags = (bool(causal),) * n if isinstance(causal, bool) else tuple(bool(c) for c in causal)
        if len(flags) != n:
            raise PackedDocsError(f"{len(flags)} causal flags for {n} documents")
        texts = (0,) * n if text_lens is None else tuple(int(t) for t in text_lens)
        if len(texts) != n or any(t < 0 for t in texts):
            raise PackedDocsError(f"text_lens must be {n} non-negative lengths, got {list(texts)}")
        return cls(cu, flags, texts)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], causal: bool | Sequence[bool] = False,
                     text_lens: Sequence[int] | None = None) -> "PackedDocs":
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + int(n))
        return cls.make(cu, causal, text_lens)

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        cu = self.cu_seqlens
        return tuple(cu[d + 1] - cu[d] for d in range(self.num_docs))

    @property
    def text_offsets(self) -> tuple[int, ...]:
        out = [0]
        for t in self.text_lens:
            out.append(out[-1] + t)
        return tuple(out)

    def area(self, d: int) -> int:
        """Query-key pairs of document ``d`` (its text included)."""
        n = self.lengths[d]
        return (n * (n + 1) // 2 if self.causal[d] else n * n) + n * self.text_lens[d]

    def signature(self) -> tuple:
        """Everything schedules depend on; hashable, equal on ranks that must agree."""
        return (self.cu_seqlens, self.causal, self.text_lens)


def agree_docs(comm: Comm, docs: PackedDocs, what: str = "the packed documents") -> None:
    """Raise on every rank unless all ranks of ``comm`` hold the same document signature.

    Runs on every call (one small object gather): skipping it on a cached
    signature could let ranks with different inputs take different paths.
    """
    if comm.world_size > 1:
        agree(comm, f"{what} (cu_seqlens, causal flags, text lengths)",
              {"cu_seqlens": list(docs.cu_seqlens), "causal": list(docs.causal), "text": list(docs.text_lens)})
