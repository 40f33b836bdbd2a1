"""How the C allocator serves torch's big CPU buffers: the ``DITSP_CPU_MALLOC`` policy.

torch's CPU tensors come from glibc's ``malloc``, which maps every block over 32 MiB afresh with ``mmap``
and unmaps it on free. A VAE or DiT activation of that size is then first touched one 4 KiB page
fault at a time (about 3 us each on a VM), on every call, and the kernel zeroes each page. On this
project's 2-core machine that was 30-40% of a 17x128x128 fp32 VAE encode's CPU time, and it made an
elementwise op on a 35 MB tensor 7x slower than on a reused buffer.

glibc reads its settings (``GLIBC_TUNABLES``) once, when a process starts, so a policy is applied by
starting the process with them: the ``ditsp`` program re-executes itself once (:func:`reexec`, before
it imports torch), and the ranks it starts inherit the setting; :func:`for_new_processes` does the same
for the ranks and server workers a library user's process spawns. The policies:

- ``hugepages`` (default): glibc asks the kernel for transparent huge pages on the blocks it maps and
  on its heap, so a big buffer costs one fault per 2 MiB instead of per 4 KiB; the memory used is
  unchanged. Needs glibc 2.35 or newer and THP not ``never``; elsewhere it does nothing.
- ``system``: glibc's own behaviour, untouched.

Keeping freed blocks in the process instead (``mmap_max=0`` and no trimming) was measured and left out:
torch allocates 64-byte aligned, and glibc 2.36 does not fit an aligned request into a freed block of
the same size, so a loop of same-sized buffers grew the heap by every buffer it freed.
"""

from __future__ import annotations

import os
import sys

from .scoped_env import scoped_env

ENV = "DITSP_CPU_MALLOC"
POLICIES = ("hugepages", "system")
DEFAULT = "hugepages"
APPLIED = "DITSP_CPU_MALLOC_APPLIED"  # set by reexec: this process started with its policy's tunables

_TUNABLES = {
    "hugepages": ("glibc.malloc.hugetlb=1",),
    "system": (),
}
_MIN_GLIBC_HUGETLB = (2, 35)


def policy(environ=None) -> str:
    """The policy asked for (``DITSP_CPU_MALLOC``, else :data:`DEFAULT`); one-line error if unknown."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower() or DEFAULT
    if value not in POLICIES:
        raise ValueError(f"{ENV}={value!r} is not a policy: choose one of {', '.join(POLICIES)}")
    return value


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
    if version is None:
        return ()
    if name == "hugepages" and version < _MIN_GLIBC_HUGETLB:
        return ()
    return _TUNABLES[name]


def _merged(existing: str, entries: tuple[str, ...]) -> str:
    """``existing`` GLIBC_TUNABLES with ``entries`` added; a key the user already set is left as set."""
    present = {item.split("=", 1)[0] for item in existing.split(":") if item}
    added = [e for e in entries if e.split("=", 1)[0] not in present]
    return ":".join([item for item in existing.split(":") if item] + added)


def rank_environment(environ=None) -> dict[str, str]:
    """The environment variables a new process needs for the policy (empty when nothing is to set)."""
    environ = os.environ if environ is None else environ
    entries = tunables(policy(environ))
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
    """Whether this process started with the policy's tunables (glibc read them at start-up)."""
    return not rank_environment(environ)


def reexec() -> None:
    """Start this program again with the policy's tunables, once, if it did not start with them.

    Called first thing by the ``ditsp`` program, before torch is imported (the restart costs about
    30 ms). Does nothing where the policy needs nothing or the process already started with it."""
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
    environ = os.environ if environ is None else environ
    name = policy(environ)
    if name == "system":
        return "system (glibc's own: big buffers mapped and faulted in afresh on every call)"
    entries = tunables(name)
    if not entries:
        why = "no glibc" if glibc_version() is None else "glibc older than 2.35"
        return f"{name} asked, no effect here ({why})"
    state = "in effect" if in_effect(environ) else "not in effect in this process (start it through `ditsp`)"
    if name == "hugepages" and transparent_hugepages() == "never":
        state += "; the kernel's transparent huge pages are off (never), so it changes nothing"
    return f"{name} ({':'.join(entries)}), {state}"


def transparent_hugepages() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``); None where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None
