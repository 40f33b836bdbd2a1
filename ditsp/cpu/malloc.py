"""How the C allocator serves torch's big CPU buffers: the ``malloc`` policy of :class:`~.settings.CpuSettings`.

torch's CPU tensors come from glibc's ``malloc``, which maps every block over 32 MiB afresh with ``mmap``
and unmaps it on free. A VAE or DiT activation of that size is then faulted in on every call, and the
kernel zeroes every page of it first. On this project's 2-core machine that was 30-40% of a 17x128x128
fp32 VAE encode's CPU time; at SP=2 a whole job spent a fifth of its CPU time in the kernel's page
clearing, twice one device's share, because a rank's height slab makes fewer, bigger blocks than one
device's frame chunks, which stay under the threshold and are reused.

glibc reads its settings (``GLIBC_TUNABLES``) once, when a process starts, so a policy is applied by
starting the process with them: the spawned ranks and server workers of ditsp's launcher and server start
under it (:func:`for_new_processes`); forked ranks share the parent's. The ``ditsp`` program itself runs
as it was started, unless ``DITSP_CPU_MALLOC_RESTART=1`` (the ``malloc_restart`` field) has it start
itself again once under the policy (:func:`reexec`, before it imports torch), or it is started with the
variables :func:`rank_environment` names (``python -m ditsp.cpu.malloc`` prints them). The policies:

- ``reuse`` (default): blocks up to 1 GiB come from the heap and freed ones stay in the process, so
  the next window's buffers of the same sizes take the same pages: no fault, no clearing. The heap is
  on transparent huge pages (glibc 2.35 or newer). glibc's per-thread cache and fast bins are off:
  torch asks for 64-byte aligned blocks, glibc cuts a small piece off each end of the block it found,
  and those pieces, parked in the cache or a fast bin, kept a freed block from merging back to the
  size the same request needs, so the heap grew by every buffer freed. With both off a freed block
  merges at once. The heap keeps its high-water mark until the process ends or
  :func:`release_free_heap` hands the free part back (a server worker does after each job), as a GPU
  caching allocator does; small C++ allocations cost about 0.1 us more each.
- ``hugepages``: glibc asks the kernel for transparent huge pages on the blocks it maps and on its
  heap, so a big buffer costs one fault per 2 MiB instead of per 4 KiB, still cleared on every call;
  the memory used is unchanged. Needs glibc 2.35 or newer and THP not ``never``.
- ``system``: glibc's own behaviour, untouched.

A policy does nothing where the C library is not glibc (or glibc is older than it needs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

from ..scoped_env import scoped_env
from . import settings

ENV = settings.ENV["malloc"]
POLICIES = settings.MALLOC_POLICIES
DEFAULT = settings.CpuSettings.malloc
APPLIED = "DITSP_CPU_MALLOC_APPLIED"  # set by reexec: this process started with its policy's tunables

_HUGETLB = "glibc.malloc.hugetlb=1"
_TUNABLES = {
    "reuse": (_HUGETLB, f"glibc.malloc.mmap_threshold={1 << 30}", f"glibc.malloc.trim_threshold={1 << 62}",
              "glibc.malloc.tcache_count=0", "glibc.malloc.mxfast=0"),
    "hugepages": (_HUGETLB,),
    "system": (),
}
_MIN_GLIBC_HUGETLB = (2, 35)
_MIN_GLIBC_TUNABLES = (2, 31)  # the malloc tunables reuse sets (mxfast came last; hugetlb itself with 2.35)
# GLIBC_TUNABLES when this module was first imported, before any of ditsp's code could set it: what glibc read
# at this process's start (a forked process keeps its parent's, as it keeps the parent's glibc settings).
_STARTED = os.environ.get("GLIBC_TUNABLES", "")


def policy(environ=None) -> str:
    """The policy asked for: this process's (:func:`.settings.process`), or that of ``environ`` when given
    (``DITSP_CPU_MALLOC``, else :data:`DEFAULT`); one-line error if unknown."""
    return (settings.process() if environ is None else settings.CpuSettings.from_env(environ)).malloc


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, None where the C library is another (musl, macOS, Windows)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def tunables(name: str) -> tuple[str, ...]:
    """The ``GLIBC_TUNABLES`` entries of policy ``name`` on this C library (none where it has no effect)."""
    version = glibc_version()
    if version is None or version < _MIN_GLIBC_TUNABLES:
        return ()
    if version < _MIN_GLIBC_HUGETLB:
        return tuple(e for e in _TUNABLES[name] if e != _HUGETLB)
    return _TUNABLES[name]


def _merged(existing: str, entries: tuple[str, ...]) -> str:
    """``existing`` GLIBC_TUNABLES with ``entries`` added; a key the user already set is left as set."""
    present = {item.split("=", 1)[0] for item in existing.split(":") if item}
    added = [e for e in entries if e.split("=", 1)[0] not in present]
    return ":".join([item for item in existing.split(":") if item] + added)


def rank_environment(environ=None) -> dict[str, str]:
    """The environment variables a new process needs for the policy (empty when nothing is to set)."""
    entries = tunables(policy(environ))
    environ = os.environ if environ is None else environ
    if not entries:
        return {}
    existing = environ.get("GLIBC_TUNABLES", "")
    merged = _merged(existing, entries)
    return {} if merged == existing else {"GLIBC_TUNABLES": merged}


def for_new_processes():
    """A block inside which started processes (spawned ranks, server workers) start under the policy; this
    process's own environment is as before once the block ends."""
    return scoped_env(rank_environment())


def in_effect(environ=None) -> bool:
    """Whether a process started with ``environ`` runs under the policy's tunables; by default this process,
    with ``GLIBC_TUNABLES`` as it started (:data:`_STARTED`), not as it is now: a rank forked while
    :func:`for_new_processes` had set the variable runs under its parent's glibc settings."""
    if environ is not None:
        return not rank_environment(environ)
    return _merged(_STARTED, tunables(policy())) == _STARTED


def reexec() -> None:
    """Start this program again with the policy's tunables, once, if it did not start with them.

    Called first thing by the ``ditsp`` program when ``malloc_restart`` is on, before torch is imported
    (the restart costs about 30 ms). Does nothing where the policy needs nothing or the process already
    started with it."""
    extra = rank_environment()
    if not extra or os.environ.get(APPLIED) == "1" or not sys.executable or len(getattr(sys, "orig_argv", ())) < 2:
        return  # nothing to apply, applied already, or no way to start this program again: run as started
    env = dict(os.environ, **extra, **{APPLIED: "1"})
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:  # the interpreter cannot be started again here: run under glibc's own behaviour
        return


def describe(environ=None) -> str:
    """One line for ``ditsp doctor`` and reports: the policy, and whether this process runs under it."""
    name = policy(environ)
    if name == "system":
        return "system (glibc's own: big buffers mapped and faulted in afresh on every call)"
    entries = tunables(name)
    if not entries:
        needs = _MIN_GLIBC_HUGETLB if name == "hugepages" else _MIN_GLIBC_TUNABLES
        why = "no glibc" if glibc_version() is None else f"glibc older than {needs[0]}.{needs[1]}"
        return f"{name} asked, no effect here ({why})"
    state = "in effect" if in_effect(environ) else ("not in effect in this process (start it with "
                                                     "DITSP_CPU_MALLOC_RESTART=1, docs/configuration.md)")
    if _HUGETLB in entries and transparent_hugepages() == "never":
        state += ("; the kernel's transparent huge pages are off (never), so it changes nothing" if name == "hugepages"
                  else "; the kernel's transparent huge pages are off (never): the heap is in 4 KiB pages")
    return f"{name} ({':'.join(entries)}), {state}"


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (``malloc_trim``; nothing off glibc).

    Under ``reuse`` the heap keeps what a job freed for the next one; a long-lived process that goes
    idle (a server worker between jobs) calls this so it holds only what is live."""
    if glibc_version() is None:
        return
    try:
        libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.cache
def libc():
    """This process's C library, looked up once (the lookup runs ``ldconfig``: about 2 ms); raises OSError
    where there is none to load."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def transparent_hugepages() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``); None where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


if __name__ == "__main__":  # the variables that start a process under the policy, for a shell's `env`
    print(" ".join(f"{k}={v}" for k, v in rank_environment().items()))
