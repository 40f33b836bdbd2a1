"""The CPU-only switches of one process: :class:`CpuSettings`, each field's default overridable by an
environment variable (docs/configuration.md lists them with what each does).

They are settings of a process, not of a request: the oneDNN route and the allocator are fixed when a
process starts, and the ranks and server workers it starts inherit its environment, so an environment
variable reaches every process of a job. They are read from the environment once (:func:`process`,
a one-line error for a value that is not a choice); a block of one thread may run under others
(:func:`use`), as the benchmarks and tests that weigh a trick on against off do.

Nothing here imports torch: the ``ditsp`` program reads these before torch is loaded.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Iterator, Mapping

GEMM_ROUTES = ("onednn", "blas")
MALLOC_POLICIES = ("reuse", "hugepages", "system")
CHOICES = {"gemm": GEMM_ROUTES, "malloc": MALLOC_POLICIES}  # the named fields' values; the others are on/off
SWITCH = {"1": True, "0": False}  # how an environment variable spells an on/off field

# Each field's environment variable.
ENV = {
    "gemm": "DITSP_CPU_GEMM",
    "malloc": "DITSP_CPU_MALLOC",
    "malloc_restart": "DITSP_CPU_MALLOC_RESTART",
    "shm_collectives": "DITSP_SHM_COLLECTIVES",
    "vae_winograd": "DITSP_VAE_WINOGRAD",
    "vae_channels_last": "DITSP_VAE_CHANNELS_LAST",
}


@dataclass(frozen=True)
class CpuSettings:
    """What a process does to run fast on a CPU (the tricks are listed in :mod:`ditsp.cpu`).

    - ``gemm``: the route of float32 CPU inference linears, ``onednn`` or ``blas`` (:mod:`.gemm`).
    - ``malloc``: the glibc allocator policy of big CPU buffers, ``reuse``, ``hugepages`` or ``system``
      (:mod:`.malloc`); it takes effect in processes started with it (ranks, server workers), and in the
      ``ditsp`` program itself only when that was started with it or ``malloc_restart`` is on.
    - ``malloc_restart``: the ``ditsp`` program starts itself again once, before it loads torch, under
      the allocator policy (about 30 ms). Off: it runs as started.
    - ``shm_collectives``: all-gathers between CPU ranks of one machine through shared memory instead of
      gloo's sockets (:mod:`ditsp.distributed.shm_gather`); every rank of a group must allow it.
    - ``vae_winograd``: the VAE's wide 3x3x3 convs by Winograd under the fast kernel policy
      (:mod:`ditsp.models.seedvr2.vae.winograd`).
    - ``vae_channels_last``: the VAE's activations channels-last under the fast kernel policy on CPU
      (:mod:`ditsp.models.seedvr2.vae.channels_last`).

    The allocator and the shared-memory all-gather change no bits. The GEMM route changes the rounding
    of float32 linears under either kernel policy (under the deterministic one each route is still
    bitwise equal across SP degrees); Winograd and channels-last apply under the fast policy only.
    """

    gemm: str = "onednn"
    malloc: str = "reuse"
    malloc_restart: bool = False
    shm_collectives: bool = True
    vae_winograd: bool = True
    vae_channels_last: bool = True

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in CHOICES and v not in CHOICES[f.name]:
                raise ValueError(f"{f.name} must be one of {', '.join(CHOICES[f.name])}, got {v!r}")
            if f.name not in CHOICES and not isinstance(v, bool):
                raise ValueError(f"{f.name} must be True or False, got {v!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CpuSettings":
        """The defaults, each overridden by its environment variable where set; ValueError (one line,
        naming the variable) for a value that is not one of its choices."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            var = ENV[f.name]
            raw = environ.get(var, "").strip()
            if not raw:
                continue
            choices = {c: c for c in CHOICES[f.name]} if f.name in CHOICES else SWITCH
            value = raw.lower() if f.name in CHOICES else raw
            if value not in choices:
                raise ValueError(f"{var}={raw!r}: expected one of {', '.join(choices)}")
            values[f.name] = choices[value]
        return cls(**values)


_process: CpuSettings | None = None
_block: ContextVar[CpuSettings | None] = ContextVar("ditsp_cpu_settings", default=None)


def process() -> CpuSettings:
    """This process's settings: read from its environment at the first call, the same ever after."""
    global _process
    if _process is None:
        _process = CpuSettings.from_env()
    return _process


def current() -> CpuSettings:
    """The settings in force here: a :func:`use` block's, else the process's."""
    return _block.get() or process()


@contextmanager
def use(**changes) -> Iterator[CpuSettings]:
    """Run this thread's block with ``changes`` to the settings in force (fields by name), e.g.
    ``use(vae_winograd=False)``. Processes started inside it still read their own environment."""
    token = _block.set(replace(current(), **changes))
    try:
        yield _block.get()
    finally:
        _block.reset(token)
