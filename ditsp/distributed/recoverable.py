"""A job's own process group, formed again after a step fails on one rank: its peers learn of it at once.

A step that fails on one rank (an allocation failure, say) leaves its peers waiting for it inside a
collective, until the group's timeout. :meth:`RecoverableGroup.attempt` runs a step so that every rank
learns of such a failure at once and all go on together:

1. the failing rank records in the rendezvous store, under the name of the group's generation, that the
   generation failed;
2. it leaves the generation's group (:meth:`.comm.Comm.leave`): its gloo connections close, so a peer's
   pending and later collectives with it fail at once; the shared-memory all-gather is flagged; an NCCL
   group is aborted, and each peer's watch thread (:class:`_Watch`) aborts its own as soon as the record
   appears, since an NCCL peer may be blocked on the device rather than in a call;
3. a peer whose collective failed finds the record and leaves too, so its own peers fail in turn;
4. every rank drops what the attempt held (its traceback frames, the cached CUDA blocks), forms the next
   generation (a process group of its own over the default group's store: a new name, new keys) and the
   ranks all-gather each one's failure, so all of them know which rank failed where.

An attempt that every rank finishes ends with one barrier, so no rank goes on before it is known that
none failed. An error the caller does not call recoverable, or a broken collective with no record, is
raised as it is.

The generations are process groups of their own over every rank of the default group, never the group
the job was given: that one (a launcher's, a server worker's) outlives the job and is not broken here.
A job on a group that is not the whole default group (rare: a sub-group) runs on it, and a failure there
is raised as it is: a new generation would need every rank of the default group.
"""

from __future__ import annotations

import datetime
import gc
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm import Comm, CommStats

KEY = "ditsp-failed/"  # store key prefix: KEY + a generation's group name exists once that generation failed
WATCH_POLL_S = 0.05  # how often an NCCL rank's watch thread looks for a failure record


@dataclass(frozen=True)
class Attempt:
    """How a step went on every rank: its result on this rank, or every rank's failure record."""

    result: Any = None
    failures: tuple = ()  # the records of the ranks that failed (rank order); empty when the step succeeded

    @property
    def failed(self) -> bool:
        return bool(self.failures)


class RecoverableGroup:
    """The group a job's recoverable steps run on (module doc); ``comm`` is the current generation's."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None):
        self.stats = stats or CommStats()  # one count of the job's traffic, across generations
        self.generation = 0
        world = 1 if group is None else dist.get_world_size(group)
        self._own = world > 1 and world == dist.get_world_size()
        self.can_recover = world == 1 or self._own
        self._name = None
        if self._own:
            self._store = dist.distributed_c10d._get_default_store()  # torch's handle on the rendezvous store
            self._backend = dist.get_backend(group)
            self._timeout = _timeout(group)
            self.comm = self._form()
        else:
            self.comm = Comm.of(group, self.stats)

    def _form(self) -> Comm:
        pg = dist.new_group(backend=self._backend, timeout=self._timeout)
        self._name = KEY + pg.group_name
        return Comm(pg, self.stats)

    def attempt(self, fn: Callable[[Comm], Any], recoverable: Callable[[Exception], dict | None]) -> Attempt:
        """Run ``fn(comm)`` on every rank; every rank returns whether it succeeded on all of them.

        ``recoverable(e)``: this rank's record of a failure the caller recovers from (a small JSON-able
        dict), or None to raise ``e``. After a failure the group is a new generation: what the caller
        built on the old ``comm`` must be built again."""
        watch = _Watch(self._store, self._name, self.comm) if self._own and self._backend == "nccl" else None
        try:
            out = fn(self.comm)
            self.comm.barrier()  # every rank got here: none failed
            return Attempt(out)
        except Exception as e:  # noqa: BLE001 - sorted below: recoverable, a peer's recorded failure, or raised
            mine = recoverable(e) if self.can_recover else None
            if mine is None and not self._recorded():
                raise
            _forget(e)
        finally:
            if watch is not None:
                watch.stop()
        return self._recover(mine)

    def _recorded(self) -> bool:
        """Whether a rank recorded that the current generation failed."""
        return self._own and self._store.check([self._name])

    def _recover(self, mine: dict | None) -> Attempt:
        if self.comm.world_size == 1:
            _release()
            return Attempt(failures=(mine,))
        if mine is not None:
            self._store.add(self._name, 1)  # before leaving: a peer that finds the group broken finds this
        self.comm.leave()
        _release()
        self.comm = self._form()
        self.generation += 1
        everyone = self.comm.all_gather_object(mine)
        return Attempt(failures=tuple(f for f in everyone if f is not None))

    def close(self) -> None:
        """The job is over: its generation's group goes (the group it was given stays)."""
        if self._own:
            self.comm.leave()


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The collective timeout ``group`` was made with (the generations keep it), or None for torch's default."""
    for device in ("cpu", "cuda"):
        try:
            t = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, TypeError):
            continue
        return t if isinstance(t, datetime.timedelta) else datetime.timedelta(seconds=float(t))
    return None


def _forget(e: BaseException) -> None:
    """Clear the frames of a failed attempt's traceback (and of the exceptions it chains): their tensors and
    their handles on the group (a pending collective's work, a ``group=`` argument) go with them."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _release() -> None:
    """Free what nothing holds any more: reference cycles now, and the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _Watch:
    """NCCL: aborts this rank's group as soon as a failure of its generation is recorded, so a rank blocked on
    the device (a kernel waiting for the rank that failed) is released; gloo needs none (its calls fail when
    the failing rank's connections close)."""

    def __init__(self, store, key: str, comm: Comm):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, key, comm.group), daemon=True,
                                        name="ditsp-failure-watch")
        self._thread.start()

    def _run(self, store, key: str, pg) -> None:
        while not self._stop.wait(WATCH_POLL_S):
            if store.check([key]):
                pg.abort()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
