"""All-gathers between the CPU ranks of one machine through shared memory instead of gloo's sockets.

gloo moves a CPU tensor between two processes of one machine over a loopback TCP connection, through
I/O threads of its own that wake the waiting rank, and a height-sharded VAE makes about sixty
all-gathers per window (each norm's frame statistics with its conv's halo rows,
:mod:`ditsp.models.seedvr2.vae.execution`), each a point where one rank waits for the other. Through
one shared segment, between two ranks on this project's 2-core VM (``ditsp bench gather``,
``benchmarks/results/gather.md``): 1 KiB in 0.009 ms instead of 0.24, 512 KiB in 0.040 instead of
0.49, and a 17x256x256 window at SP=2 encodes in 0.42 s instead of 0.48 and decodes in 1.00 s
instead of 1.07, with the same bits.

The segment holds a pair of counters per rank and a slot per rank. A call, the k-th on the group:
wait until every peer has read this rank's slot in call k - 1; copy this rank's bytes into its slot;
publish k as written; for each peer, wait until it has written k, copy its slot out; publish k as
read. A peer's bytes are read only after its counter says they are there: on x86-64 a core's stores
become visible to the others in the order it made them (the counter is stored after the copy), and
loads are not reordered with loads, so that is enough. Elsewhere (other architectures) this module
is not used, nor on groups whose ranks run on different machines, nor where a rank's ``shm_collectives``
setting (:class:`~ditsp.cpu.settings.CpuSettings`, ``DITSP_SHM_COLLECTIVES=0``) is off.

Agreement. A :class:`~ditsp.distributed.comm.Comm` sets one up after its first :data:`AFTER_CALLS`
all-gathers (so a Comm made for one call never pays the set-up), deciding from every rank's answer
(an all-gather of host, boot, namespaces, architecture and setting), so all ranks decide alike; a
payload over :data:`MAX_SLOT_BYTES` goes through gloo, and every rank knows every payload's size, so
they agree call by call too. A slot too small for a payload is replaced by a bigger segment, by all
ranks at the same call.

Never hang, never leave files: a wait ends with an error naming the peer when that peer's process is
gone or has left the group (:meth:`ShmGather.leave`: a rank that gives up on a step, so its peers do
not wait for it; both checked about every millisecond) or at the group's timeout; the segment's name is removed as
soon as every rank has mapped it, so nothing is left in ``/dev/shm`` whatever happens to the
processes, and the mapping goes with its Comm.
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from ..cpu import settings
from .heartbeat import waiting

FIRST_SLOT_BYTES = 4 << 20  # a slot's first size; doubled (or more) when a payload needs it
MAX_SLOT_BYTES = 256 << 20  # payloads over this go through gloo (n slots of it would be mapped per group)
_ORDERED_STORES = ("x86_64", "AMD64")  # architectures whose stores are seen in program order (module doc)
_HEADER = 64  # bytes per rank of counters (three used), a cache line each
_WRITTEN, _READ, _LEFT = 0, 1, 2  # a rank's counters: calls written, calls read, whether it left the group
_SPIN = 200  # checks before a waiting rank starts yielding its core
_YIELD = 20000  # checks before it starts sleeping between them

SHM_DIR = "/dev/shm"  # a RAM-backed file system: the segments live there, nameless once mapped
AFTER_CALLS = 8  # a Comm's all-gathers that go through gloo before it sets a segment up (a one-off Comm never does)


def enabled() -> bool:
    """Whether this rank's ``shm_collectives`` setting allows shared memory (default: yes)."""
    return settings.current().shm_collectives


def _machine() -> str:
    """This machine and namespace, as the same string in every process that can share a segment and see the
    others' process ids: host name, boot, the shared-memory file system and the process-id namespace."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        st = os.stat(SHM_DIR)
        parts += [f"{st.st_dev}:{st.st_ino}", os.readlink("/proc/self/ns/pid")]
    except OSError:
        return ""  # not Linux as expected: no shared segments
    return "/".join(parts)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def _timeout_s(group: dist.ProcessGroup) -> float:
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    except (AttributeError, RuntimeError, TypeError):
        return 600.0


def open_for(group: dist.ProcessGroup) -> "ShmGather | None":
    """A shared-memory all-gather for ``group`` (collective: every rank of it calls this at the same point), or
    None where gloo must serve: unless every rank runs on this machine, in one process-id namespace, on an
    architecture with ordered stores (module doc) and with the setting on, all ranks get None."""
    if dist.get_backend(group) != "gloo":
        return None
    me = (_machine(), platform.machine(), enabled() and os.access(SHM_DIR, os.W_OK), os.getpid())
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    if all(e[0] and e[0] == me[0] and e[1] in _ORDERED_STORES and e[2] for e in everyone):
        return ShmGather(group, [e[3] for e in everyone])
    return None


class ShmGather:
    """All-gather of same-sized CPU tensors among a gloo group's ranks on one x86-64 machine (module doc)."""

    def __init__(self, group: dist.ProcessGroup, pids: list[int]):
        self.group, self.pids = group, pids
        self.rank, self.n = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = _timeout_s(group)
        self.calls = 0
        self.slot = 0
        self.segment = self.counters = self.data = None
        self._map(FIRST_SLOT_BYTES)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= MAX_SLOT_BYTES

    def _map(self, slot: int) -> None:
        """A new segment with slots of ``slot`` bytes, mapped by every rank (collective); its name removed."""
        size = self.n * (_HEADER + slot)
        box = [None]
        if self.rank == 0:
            box = [os.path.join(SHM_DIR, f"ditsp-gather-{uuid.uuid4().hex}")]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        path = box[0]
        try:
            if self.rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)  # a sparse file of zeros: every counter starts at 0
                    segment = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            dist.barrier(group=self.group)  # the file exists at its size
            if self.rank != 0:
                fd = os.open(path, os.O_RDWR)
                try:
                    segment = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            dist.barrier(group=self.group)  # every rank has it mapped: the name can go
        finally:
            if self.rank == 0 and os.path.exists(path):
                os.unlink(path)
        self._release()
        self.segment, self.slot, self.calls = segment, slot, 0
        self.counters = np.ndarray((self.n, _HEADER // 8), dtype=np.int64, buffer=segment)
        self.data = torch.frombuffer(segment, dtype=torch.uint8, offset=self.n * _HEADER, count=self.n * slot)

    def _release(self) -> None:
        old, self.segment, self.counters, self.data = self.segment, None, None, None
        if old is not None:
            try:
                old.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass

    def leave(self) -> None:
        """This rank takes no further part: its flag in the segment makes every peer's wait end at once with an
        error (:meth:`.comm.Comm.leave`); the segment stays mapped by the peers until they drop it."""
        if self.counters is not None:
            self.counters[self.rank, _LEFT] = 1
        self.group = None

    def _wait(self, peer: int, column: int, value: int, deadline: float, what: str) -> None:
        counters = self.counters
        for checks in range(_SPIN):  # a short wait spins only (most end here)
            if counters[peer, column] >= value:
                return
        with waiting():  # a long one spins, yields, sleeps: not progress (the launcher's stuck check ignores its CPU)
            while counters[peer, column] < value:
                checks += 1
                if checks % 256 == 0:
                    if not _alive(self.pids[peer]):
                        raise RuntimeError(f"rank {self.rank}: rank {peer} (pid {self.pids[peer]}) is gone, in a "
                                           f"shared-memory all-gather waiting for it to {what}")
                    if counters[:, _LEFT].any():
                        left = int(np.flatnonzero(counters[:, _LEFT])[0])
                        raise RuntimeError(f"rank {self.rank}: rank {left} left the group, in a shared-memory "
                                           f"all-gather waiting for rank {peer} to {what}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {self.rank}: a shared-memory all-gather waited {self.timeout_s:g} s "
                                           f"for rank {peer} to {what} (call {value}); that rank is stuck")
                if checks < _YIELD:
                    os.sched_yield()
                else:
                    time.sleep(5e-5)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (the same shape and dtype on every rank, a CPU tensor), in rank order."""
        flat = t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        nbytes = flat.numel()
        deadline = time.monotonic() + self.timeout_s
        if nbytes > self.slot:
            for p in range(self.n):  # the last call's slots fully read before the segment goes
                if p != self.rank:
                    self._wait(p, _READ, self.calls, deadline, "finish the previous all-gather")
            self._map(max(2 * self.slot, 1 << (nbytes - 1).bit_length()))
        self.calls += 1
        k, me, slot = self.calls, self.rank, self.slot
        for p in range(self.n):
            if p != me:
                self._wait(p, _READ, k - 1, deadline, "read this rank's previous rows")
        self.data[me * slot:me * slot + nbytes].copy_(flat)
        self.counters[me, _WRITTEN] = k
        outs = []
        for p in range(self.n):
            out = torch.empty_like(t, memory_format=torch.contiguous_format)
            if p == me:
                out.copy_(t)
            else:
                self._wait(p, _WRITTEN, k, deadline, "write its rows")
                if nbytes:
                    out.view(-1).view(torch.uint8).copy_(self.data[p * slot:p * slot + nbytes])
            outs.append(out)
        self.counters[me, _READ] = k
        return outs
