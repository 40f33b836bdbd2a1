"""A checkpoint read by the ranks of a group: each rank from its own memory map, or one reader that
sends the others every tensor as stored.

Two ways (:data:`READS`):

- ``every-rank``: each rank opens the file and copies its tensors out of its own memory map. The
  ranks of a host share the kernel's page cache, so the file comes off the disk once however many
  ranks read it; each rank pays one copy per tensor, in parallel with the others.
- ``one-reader``: group rank :data:`READER` opens the file; its description (names, shapes, stored
  formats, FP8 scales, and the tensors under :data:`INLINE_BYTES`, which the loaders' checks may
  read) goes to the others in one object broadcast; then, as the loader reads each tensor, the
  reader sends it over :meth:`Comm.broadcast` as its stored bytes (FP8 and GGUF blocks stay
  quantized on the wire, bf16 stays bf16), after a small header (which tensor, its dtype and
  shape, or the reader's read error). A rank holds the weights it keeps plus one tensor in flight;
  the receivers never open the file. Used only where every rank of the group is on one host (the
  group's ranks agree on it); a group over several hosts reads every-rank.

Which is the default (:data:`DEFAULT_READ`) is measured, not assumed: ``ditsp bench weights-sp``
(``benchmarks/results/weights_sp.md``).

Errors are the same on every rank, never a hang: the reader's open failure is broadcast in place
of the description; a loader's checks run through :func:`settle`, which raises the lowest failing
rank's message on every rank; a tensor the reader fails to read is announced in its header. Every
rank reads the (same) tensors in the same order because the loaders' code depends only on the
description, which is the same on every rank.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, TypeVar

import torch

from ..distributed.comm import Comm
from .formats import Checkpoint, FormatError, error_line, open_any
from .stored import StoredTensor

READS = ("every-rank", "one-reader")
DEFAULT_READ = "every-rank"  # measured: benchmarks/results/weights_sp.md (docs/performance.md, weights)
READER = 0  # the group rank that opens the file in one-reader mode
INLINE_BYTES = 1 << 10  # tensors up to this size travel inside the description (RoPE frequencies, FP8 scales)

# The dtypes a stored tensor is read as (a header names one by its index).
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
               torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
MAX_DIMS = 8
HEADER = 4 + MAX_DIMS  # int64: tensor index, status (0 data, 1 error), dtype index, ndim, dims...

T = TypeVar("T")


def check_read(read: str | None) -> str:
    """``read`` as a :data:`READS` name (None: :data:`DEFAULT_READ`); anything else raises ValueError."""
    read = DEFAULT_READ if read is None else read
    if read not in READS:
        raise ValueError(f"unknown weights read {read!r}; choose from {', '.join(READS)}")
    return read


def settle(comm: Comm | None, fn: Callable[[], T], error: type[Exception] = FormatError) -> T:
    """``fn()`` on every rank of ``comm``'s group; if it raises on any rank, every rank raises
    ``error`` with the lowest failing rank's message (one small all-gather; nobody waits forever)."""
    comm = comm or Comm.single()
    out, msg, cause = None, None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - any failure becomes the group's verdict
        msg, cause = (str(e) if isinstance(e, (error, FormatError)) else error_line(e)), e
    msgs = comm.all_gather_object(msg) if comm.world_size > 1 else [msg]
    first = next((m for m in msgs if m is not None), None)
    if first is not None:
        if cause is not None and isinstance(cause, error) and str(cause) == first:
            raise cause
        raise error(first) from cause
    return out


def choose_read(comm: Comm, read: str | None, path_or_sd) -> str:
    """The read every rank of the group uses: ``read`` (agreed), one-reader only for a file on one host."""
    read = check_read(read)
    if comm.world_size == 1:
        return "every-rank"
    is_path = isinstance(path_or_sd, (str, os.PathLike))
    seen = comm.all_gather_object((read, socket.gethostname(), is_path))
    if len({r for r, _, _ in seen}) > 1:
        raise ValueError("ranks disagree on the weights read: " + ", ".join(f"rank {i} {r}" for i, (r, _, _) in
                                                                             enumerate(seen)))
    one_host = len({h for _, h, _ in seen}) == 1
    return "one-reader" if read == "one-reader" and one_host and all(p for _, _, p in seen) else "every-rank"


def open_group(path_or_sd, comm: Comm | None = None, read: str | None = None,
               error: type[Exception] = FormatError) -> Checkpoint:
    """The checkpoint's description on every rank of ``comm``'s group, read as ``read`` says
    (:func:`choose_read`); a problem raises ``error`` with the same message on every rank."""
    comm = comm or Comm.single()
    mode = choose_read(comm, read, path_or_sd)
    if mode == "every-rank":
        return settle(comm, lambda: open_any(path_or_sd, error), error)
    wire = _Wire(comm, READER, str(path_or_sd))
    if comm.rank == READER:
        try:
            ckpt = open_any(path_or_sd, error)
            manifest = _manifest(ckpt)
        except Exception as e:  # noqa: BLE001 - the verdict goes to every rank first
            msg = str(e) if isinstance(e, (error, FormatError)) else f"{path_or_sd}: unreadable checkpoint " \
                                                                    f"({error_line(e)})"
            comm.broadcast_object(("error", msg), READER)
            raise error(msg) from None
        comm.broadcast_object(("ok", manifest), READER)
        return _reader_checkpoint(ckpt, manifest, wire)
    status, payload = comm.broadcast_object(None, READER)
    if status == "error":
        raise error(payload)
    return _receiver_checkpoint(payload, wire)


# ----------------------------------------------------------------------------- the description


def _manifest(ckpt: Checkpoint) -> dict:
    """What the receivers need to describe the file as the reader does (small tensors included)."""
    rows = []
    for k, e in ckpt.entries.items():
        scale = e.read_scale() if e.read_scale is not None else None
        inline = e.read() if e.nbytes <= INLINE_BYTES else None
        if inline is not None:
            inline = inline.detach().clone().contiguous()
        rows.append((k, e.source, tuple(e.shape), e.fmt, int(e.nbytes), e.scale_source, scale, inline))
    return {"path": ckpt.path, "format": ckpt.format, "markers": list(ckpt.markers), "entries": rows}


def _entry(row, read: Callable[[], torch.Tensor], owned: bool) -> StoredTensor:
    k, source, shape, fmt, nbytes, scale_source, scale, inline = row
    if inline is not None:
        read, owned = (lambda t=inline: t), False  # the description's copy: each use copies it
    return StoredTensor(source, shape, fmt, nbytes, read, scale_source,
                        (lambda s=scale: s) if scale is not None else None, owned)


def _reader_checkpoint(ckpt: Checkpoint, manifest: dict, wire: "_Wire") -> Checkpoint:
    entries = {}
    for i, row in enumerate(manifest["entries"]):
        e = ckpt.entries[row[0]]
        entries[row[0]] = _entry(row, (lambda i=i, e=e: wire.send(i, e)), e.owned)
    return Checkpoint(ckpt.path, ckpt.format, entries, list(ckpt.markers), ckpt._close)


def _receiver_checkpoint(manifest: dict, wire: "_Wire") -> Checkpoint:
    entries = {row[0]: _entry(row, (lambda i=i: wire.recv(i)), True) for i, row in enumerate(manifest["entries"])}
    return Checkpoint(manifest["path"], manifest["format"] + "+peer", entries, list(manifest["markers"]))


# ----------------------------------------------------------------------------- the wire


class _Wire:
    """One tensor at a time from the reader: a header, then its stored bytes (see the module doc)."""

    def __init__(self, comm: Comm, src: int, path: str):
        self.comm, self.src, self.path = comm, src, path

    def _header(self, values) -> torch.Tensor:
        h = torch.zeros(HEADER, dtype=torch.int64)
        h[: len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
        return self.comm.broadcast(self._out(h), self.src, kind="weights_header").cpu()

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        dev = self.comm.wire_device
        return t if dev == "cpu" else t.to(dev)

    def send(self, i: int, e: StoredTensor) -> torch.Tensor:
        try:
            t = e.read()
            if t.dtype not in WIRE_DTYPES or t.dim() > MAX_DIMS:
                raise FormatError(f"tensor {e.source!r} is read as {t.dtype} with {t.dim()} dims, which the "
                                  f"one-reader wire does not carry")
        except Exception as ex:  # noqa: BLE001 - announced to the receivers before raising here
            msg = str(ex) if isinstance(ex, FormatError) else f"{self.path}: tensor {e.source!r} unreadable " \
                                                              f"({error_line(ex)})"
            data = torch.frombuffer(bytearray(msg.encode()), dtype=torch.uint8)
            self._header([i, 1, 0, 1, data.numel()])
            self.comm.broadcast(self._out(data), self.src, kind="weights")
            raise FormatError(msg) from None
        self._header([i, 0, WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape])
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel():
            self.comm.broadcast(self._out(flat), self.src, kind="weights")
        return t

    def recv(self, i: int) -> torch.Tensor:
        h = self._header([]).tolist()
        if h[0] != i:
            raise FormatError(f"{self.path}: the reader sent tensor #{h[0]} where this rank reads #{i} "
                              f"(the ranks' loaders read in different orders)")
        if h[1] != 0:
            buf = self._out(torch.empty(h[4], dtype=torch.uint8))
            self.comm.broadcast(buf, self.src, kind="weights")
            raise FormatError(bytes(buf.cpu().tolist()).decode())
        dtype, shape = WIRE_DTYPES[h[2]], tuple(h[4: 4 + h[3]])
        n = 1
        for s in shape:
            n *= s
        buf = self._out(torch.empty(n * dtype.itemsize, dtype=torch.uint8))
        if buf.numel():
            self.comm.broadcast(buf, self.src, kind="weights")
        return buf.cpu().view(dtype).reshape(shape)
