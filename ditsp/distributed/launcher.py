"""Start ranks: join a ``torchrun`` job, or spawn N gloo ranks on this machine.

:class:`LocalCluster` keeps N spawned ranks alive and runs functions on all of
them, so tests and benchmarks pay the start-up once. A rank that raises ends
the call with its traceback (:class:`RankError`), and a call that is stuck
ends it too, and the cluster is torn down instead of hanging.

Slow is not stuck. A call is stuck once none of its unanswered ranks made
progress for its timeout: no heartbeat (a collective completed, a stage
ended) and no CPU time outside waits (:mod:`.heartbeat`). A rank computing
for minutes between two collectives, and its peers waiting for it in one,
are a slow call, however busy the machine; ranks blocked in a collective, a
lock or a sleep use no CPU and are found stuck one timeout after the last of
them stopped. The collectives' own timeout (gloo's, the store's) is only a
backstop for what the parent cannot tell from a slow rank, a rank that spins
while its peers wait: max(``timeout_s``, :data:`_COLLECTIVE_FLOOR_S`).

Failures say why, on the first line of the :class:`RankError`:

- a rank that raises: its exception (tracebacks follow);
- a stuck call: each stuck rank and where its call waits (the innermost frame,
  and the innermost of the caller's own code), then every thread's stack of
  that rank, dumped by :mod:`faulthandler` on ``SIGUSR1`` (or, without that
  signal, by a timer armed before the call's timeout) into a per-rank file
  the parent reads;
- a rank that dies (crash, ``os._exit``, failed start-up): its exit code, the
  start-up exception or the crash stack when there is one;
- a function, argument or result that cannot be pickled: said at once (the
  call is pickled in the parent, the result in the rank), not after the deadline.

Ranks die with their parent: on Linux the kernel kills them when the parent
dies (``PR_SET_PDEATHSIG``), and everywhere a watchdog thread exits the rank
when the parent's pipe closes or its pid changes. Ranks stay in the parent's
process group, so a signal to that group (Ctrl-C, ``kill -TERM -PGID``)
reaches them too. ``PR_SET_PDEATHSIG`` fires when the *thread* that started
the ranks exits: start a LocalCluster from a thread that outlives it.

Ranks are spawned (a fresh interpreter each), or with ``fork=True`` forked
from the parent where :func:`fork_is_safe`: a command's fresh process, whose
imports (torch, the job's modules: 1.5-2 s of CPU per rank) the ranks then
share instead of repeating. A forked rank drops the parent's exit and signal
handlers and dies with its parent the same way.

The rendezvous store is hosted by the parent and listens on 127.0.0.1 only
(a pre-bound loopback socket), and gloo is pinned to the loopback interface
where there is one (``GLOO_SOCKET_IFNAME``), so local ranks open no port on
other interfaces.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ..cpu import malloc as cpu_malloc
from ..memory import check_local_ranks
from .heartbeat import Progress, install
from .parent_death import arm_parent_death_signal

LOOPBACK = "127.0.0.1"
_START_S = 60.0  # the no-progress window's floor at start-up and while a rank imports the call's module
_COLLECTIVE_FLOOR_S = 600.0  # a collective waits on its peers at least this long (the backstop, module doc)
_GRACE_S = 5.0  # once a rank failed, how long its peers get to report theirs
_STACK_WAIT_S = 2.0  # how long the parent waits for a hung rank's stack dump
# what a starting rank is waiting on (its slot of the shared `started` array before its first call)
_PHASE_STORE, _PHASE_GROUP, _PHASE_READY = -2, -3, -4
_PHASES = {0: "starting the process and importing (no ditsp code has run yet)",
           _PHASE_STORE: "connecting to the rendezvous store", _PHASE_GROUP: "joining the gloo process group",
           _PHASE_READY: "sending its hello"}


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


@dataclass(frozen=True)
class RankContext:
    """What a function run on a rank receives: its rank and the SP group handle."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup
    device: torch.device


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> RankContext:
    """Join the job ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR...).

    NCCL when CUDA is available, else gloo. The returned group is WORLD, passed
    on explicitly; build sub-groups with :mod:`ditsp.config`. Under NCCL the rank's device
    (``LOCAL_RANK``) is set before any CUDA work and the group is bound to it (its communicator
    made at once, so a broken link fails here); a collective past ``timeout_s`` or an NCCL error
    ends the rank's process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, torch's default, pinned
    unless the user set it) instead of leaving it hung.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("init_from_env needs torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables")
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device("cpu")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        nccl = {"device_id": device} if backend == "nccl" and device.type == "cuda" else {}
        if nccl:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **nccl)
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def listening_socket() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 at a free port (clients that connect before a store serves it
    wait in its backlog)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_store(world_size: int, timeout_s: float, sock: socket.socket | None = None
                   ) -> tuple[dist.TCPStore, tuple[str, int]]:
    """A TCPStore server listening on 127.0.0.1 only, and its address.

    (Left to itself the server listens on every interface; handed a bound
    loopback socket, it listens there: ``sock`` from :func:`listening_socket`, or a new one.)
    The store owns the socket from here on.
    """
    sock = sock or listening_socket()
    try:
        addr = sock.getsockname()[:2]
        store = dist.TCPStore(LOOPBACK, addr[1], world_size, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it goes
    return store, addr


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


# -- rank side ------------------------------------------------------------------


def _kill_self() -> None:
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Exit this rank once its parent is gone (parent pipe closed, or re-parented)."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    while True:
        if sentinel is not None:
            try:
                if multiprocessing.connection.wait([sentinel], timeout=poll_s):
                    break
            except OSError:
                break
        else:
            time.sleep(poll_s)
        if os.getppid() != parent_pid:
            break
    _kill_self()


def die_with_parent(parent_pid: int) -> None:
    """Make this process end when ``parent_pid`` does (Linux: kernel signal; everywhere: a watchdog).

    ``DITSP_NO_PDEATHSIG=1`` leaves the kernel signal out (tests of the watchdog alone).
    """
    if os.environ.get("DITSP_NO_PDEATHSIG") != "1":
        arm_parent_death_signal()  # where it cannot, the watchdog below covers it
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        _kill_self()
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="ditsp-parent-watchdog", daemon=True).start()


def _stack_file(path: str):
    """Where faulthandler writes this rank's stacks: on SIGUSR1 and on a crash."""
    fh = open(path, "ab", buffering=0)  # O_APPEND: writes land at the end, also after a truncate
    faulthandler.enable(file=fh, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
    return fh


class _Answers:
    """A rank's answers to the parent over its own pipe: no lock shared with other ranks, so a
    rank that dies mid-send cannot block its peers' answers (as a shared queue's lock would)."""

    def __init__(self, rank: int, conn):
        self.rank, self.conn = rank, conn

    def put(self, item) -> None:
        _, call_id, ok, payload = item
        self.conn.send((call_id, ok, payload))


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def error_line(e: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line: a multi-line message (a checkpoint report, say) joined with "; ", so the
    first line of a rank's report names the problem, not just its title."""
    parts = [p.strip().rstrip(":") for p in str(e).splitlines() if p.strip()]
    text = f"{type(e).__name__}: {'; '.join(parts)}" if parts else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _forget_parent(listen_fd: int | None) -> None:
    """What a forked rank inherited from the parent's interpreter and is not its own: the parent's exit
    handlers (they would remove the parent's temporary folders when the rank exits), its signal handlers
    (the CLI's SIGTERM handler would turn a stop into an exception the call loop reports and survives),
    and its copy of the rendezvous store's listening socket."""
    atexit._clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if listen_fd is not None:
        os.close(listen_fd)


def _worker(rank: int, world: int, port: int, timeout_s: float, threads: int, tasks, answers,
            parent_pid: int | None = None, stack_path: str | None = None, beats=None, started=None,
            forked: bool = False, listen_fd: int | None = None, waits=None) -> None:
    if forked:
        _forget_parent(listen_fd)
    if parent_pid is not None:
        die_with_parent(parent_pid)
    results = _Answers(rank, answers)
    fh = _stack_file(stack_path) if stack_path else None
    if beats is not None:
        install(beats, rank, waits)
    if started is not None:
        started[rank] = _PHASE_STORE  # imports done, this function runs: next, the rendezvous store
    try:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
        ifname = _loopback_ifname()
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        torch.set_num_threads(threads)
        store = dist.TCPStore(LOOPBACK, port, world, False, datetime.timedelta(seconds=timeout_s))
        if started is not None:
            started[rank] = _PHASE_GROUP
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if started is not None:
            started[rank] = _PHASE_READY
        ctx = RankContext(rank, world, dist.group.WORLD, torch.device("cpu"))
        results.put((rank, -1, True, bytes(ForkingPickler.dumps(None))))
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the parent
        results.put((rank, -1, False, f"{error_line(e)}\n{_format_exc(e)}"))
        return
    timer = fh is not None and not hasattr(signal, "SIGUSR1")
    while True:
        item = tasks.get()
        if item is None:
            break
        call_id, call_timeout, blob = item
        if fh is not None:
            os.ftruncate(fh.fileno(), 0)  # stacks in the file belong to the current call
            if timer:  # no SIGUSR1 here: dump just before the parent's deadline instead
                faulthandler.dump_traceback_later(max(0.1, call_timeout - 1.0), file=fh)
        try:
            fn, args, kwargs = ForkingPickler.loads(blob)  # may import the function's module: seconds
        except BaseException as e:  # noqa: BLE001
            if timer:
                faulthandler.cancel_dump_traceback_later()
            msg = f"cannot unpickle the call on rank {rank}: {type(e).__name__}: {e}\n{_format_exc(e)}"
            results.put((rank, call_id, False, msg))
            continue
        if started is not None:
            started[rank] = call_id  # the stuck-rank check starts now, not while the call was imported
        try:
            out = fn(ctx, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            results.put((rank, call_id, False, f"{error_line(e)}\n{_format_exc(e)}"))
            continue
        finally:
            if timer:
                faulthandler.cancel_dump_traceback_later()
        try:
            payload = ForkingPickler.dumps(out)
        except BaseException as e:  # noqa: BLE001
            msg = (f"the result ({type(out).__name__}) cannot be pickled back to the parent: "
                   f"{type(e).__name__}: {e}\n{_format_exc(e)}")
            results.put((rank, call_id, False, msg))
            continue
        results.put((rank, call_id, True, bytes(payload)))
    dist.destroy_process_group()
    # Every answer is written to the pipe (send returns when it has). What is left is the exit handlers
    # (multiprocessing's release the semaphores a rank made, e.g. tqdm's lock) and the interpreter's
    # teardown of torch's modules, which took 1.4 s of the parent's close at SP=2: run the first only.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- parent side ----------------------------------------------------------------


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"died of {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"died (exit code {code})"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def fork_is_safe(threads: int) -> bool:
    """Whether ranks may be forked from this process rather than spawned (they start with its imports:
    no interpreter start, no torch import, seconds of CPU each).

    Only where a child cannot inherit a half-held lock or a thread pool it would wait on: one compute
    thread per rank (an OpenMP pool this process may have started is never entered in a child), no other
    Python thread here, CUDA not initialised, and the platform forks."""
    return (threads == 1 and threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
            and not torch.cuda.is_initialized())


def _check_main_importable() -> None:
    """Spawned ranks re-run the parent's main module from its file; one that is not a file (a script read
    from stdin, ``python - < x.py``) kills every rank at import with an error only stderr shows."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return  # an interactive session (nothing to import) or ``python -m`` (imported by name)
    if not os.path.isfile(path):
        raise RankError(f"start-up: spawned ranks re-import the main module, but it is {path!r}, not a file "
                        f"they can import (a script read from stdin?); run it from a file, with the work under "
                        f"`if __name__ == \"__main__\":`, or as a module (python -m)")


def _sweep_rank_dirs() -> None:
    """Remove the stack-dump folders of launchers that are gone (killed before they could remove their own)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) < 4 or parts[:2] != ["ditsp", "ranks"] or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its launcher still runs
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)\s*$')
_STDLIB = tuple(os.path.normpath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"],
                                                        sysconfig.get_paths()["platstdlib"]})


def _short_path(path: str) -> str:
    """A frame's file as a person reads it: from the package down, or relative to the working folder."""
    p = path.replace(os.sep, "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in p:
            return p.rsplit(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    return os.path.basename(path) if rel.startswith("..") else rel


def _callers_own(path: str) -> bool:
    """Whether a frame is the caller's code (ditsp's or the called function's), not Python's or a package's."""
    p = path.replace(os.sep, "/")
    if "/ditsp/" in p:
        return True
    return not (p.startswith(_STDLIB) or "/site-packages/" in p or "/dist-packages/" in p or p.startswith("<"))


def waiting_at(stacks: str) -> str | None:
    """Where a stuck rank's call waits, from its faulthandler dump: the innermost frame of the thread running
    the call, and the innermost frame of the caller's own code when that is another (``all_reduce
    (torch/distributed/distributed_c10d.py:3252) from all_gather_rows (ditsp/distributed/comm.py:170)``)."""
    for block in stacks.split("\n\n"):
        frames = [m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
        if not any(fn == "_worker" and _short_path(path).endswith("launcher.py") for path, _, fn in frames):
            continue
        path, line, fn = frames[0]
        at = f"{fn} ({_short_path(path)}:{line})"
        own = next((f for f in frames if _callers_own(f[0])), None)
        if own is not None and own != frames[0] and own[2] != "_worker":
            at += f" from {own[2]} ({_short_path(own[0])}:{own[1]})"
        return at
    return None


class LocalCluster:
    """N gloo ranks on this machine, reused across calls.

    ``timeout_s`` is how long a call may go without progress before it is
    stuck (module doc), the start-up's at least :data:`_START_S`; ``threads``
    is each rank's compute threads.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, threads: int = 1, fork: bool = False):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1 (compute threads per rank), got {threads!r}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")

        check_local_ranks(world_size, "world_size")  # before any process is spawned
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.threads = threads
        self._procs: list = []
        self._calls = 0
        self._store = self._addr = None
        self._stack_dir: str | None = None
        self._started = None
        self._fork = fork
        self._start()

    @property
    def store_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the rendezvous store listens on (None when closed)."""
        return self._addr

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        fork = self._fork and fork_is_safe(self.threads)
        if not fork:
            _check_main_importable()
        _sweep_rank_dirs()
        ctx = mp.get_context("fork" if fork else "spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._answers = [reader for reader, _ in pipes]
        # the store is made on this socket once the ranks are started: a forked rank copies no store thread
        sock = listening_socket()
        port = sock.getsockname()[1]
        self._stack_dir = tempfile.mkdtemp(prefix=f"ditsp-ranks-{os.getpid()}-")  # the pid: swept once it is gone
        weakref.finalize(self, shutil.rmtree, self._stack_dir, True)  # also if the cluster is never closed
        self._beats = ctx.Array("Q", self.world_size, lock=False)  # each rank's progress counter
        self._waits = ctx.Array("Q", self.world_size, lock=False)  # each rank's spin-wait counter (odd: inside)
        collective_s = max(self.timeout_s, _COLLECTIVE_FLOOR_S)
        self._started = ctx.Array("q", self.world_size, lock=False)  # the call each rank has unpickled
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, collective_s, self.threads, self._tasks[r], pipes[r][1],
                      os.getpid(), self._stack_path(r), self._beats, self._started, fork,
                      sock.fileno() if fork else None, self._waits),
                daemon=True,
                name=f"ditsp-rank-{r}",
            )
            for r in range(self.world_size)
        ]
        try:
            with cpu_malloc.for_new_processes():  # spawned ranks start under it; forked ones share ours
                for p in self._procs:
                    p.start()
        except BaseException:
            sock.close()
            self.close(force=True)
            raise
        for _, writer in pipes:
            writer.close()  # the ranks hold theirs: a rank's end closing means the rank is gone
        self._store, self._addr = loopback_store(self.world_size, collective_s, sock)
        self._collect(-1, self.timeout_s, "start-up")

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stacks")

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(self._stack_path(rank), "rb") as f:
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _hung_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's stack of each hung rank (asked for with SIGUSR1 where there is one)."""
        alive = [r for r in ranks if self._procs[r].is_alive()]
        if hasattr(signal, "SIGUSR1"):
            for r in alive:
                try:
                    os.kill(self._procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
        end = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < end and not all(self._read_stacks(r) for r in alive):
            time.sleep(0.05)
        time.sleep(0.1)  # let a dump that has begun finish
        return {r: self._read_stacks(r) for r in ranks}

    def _receive(self, rank: int, call_id: int):
        """``(ok, result or error text)`` of ``rank`` for ``call_id``; None when nothing for this call."""
        conn, proc = self._answers[rank], self._procs[rank]
        closed = False
        try:
            while conn.poll():
                cid, ok, payload = conn.recv()
                if cid != call_id:
                    continue
                if not ok:
                    return False, payload
                try:
                    return True, ForkingPickler.loads(payload)
                except BaseException as e:  # noqa: BLE001
                    return False, (f"the result of rank {rank} cannot be unpickled in the parent: "
                                   f"{type(e).__name__}: {e}\n{_format_exc(e)}")
        except (EOFError, OSError):
            closed = True  # the rank's end is closed: it is gone
        if not closed and proc.is_alive():
            return None
        proc.join(timeout=1.0)  # its pipe closed or its process ended: let it finish going
        crash = self._read_stacks(rank)
        note = ""
        if call_id == -1 and self._started is not None and self._started[rank] == 0:
            note = (" at start-up, before any ditsp code ran (importing the main module or unpickling the rank's "
                    "arguments failed; the rank's own error went to stderr)")
        return False, _death(proc.exitcode) + note + (f"\n{crash}" if crash else "")

    def _collect(self, call_id: int, timeout_s: float, what: str) -> list:
        """Every rank's answer. The call is stuck once none of the ranks that have not answered made progress
        (:class:`~.heartbeat.Progress`) for ``timeout_s``, or for max(:data:`_START_S`, ``timeout_s``) at
        start-up and while a rank has not yet unpickled the call (importing its module). An answer is progress
        too: the peers a finishing rank leaves behind had been waiting for it, and are about to be woken."""
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        grace = None  # once a rank failed, peers get a few seconds to report theirs
        start = time.monotonic()
        progress = Progress(timeout_s, start)
        window = timeout_s
        answered = start  # when the last answer came
        while len(out) + len(errors) < self.world_size:
            now = time.monotonic()
            pending = [r for r in range(self.world_size) if r not in out and r not in errors]
            starting = call_id == -1 or any(self._started[r] != call_id for r in pending)
            window = max(_START_S, timeout_s) if starting else timeout_s
            looks = [progress.look(r, now, self._procs[r].pid, self._beats[r], self._waits[r]) for r in pending]
            last = max(looks + [answered])
            limit = last + window if grace is None else min(last + window, grace)
            if now >= limit:
                break
            waitables = {self._answers[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            ready = multiprocessing.connection.wait(list(waitables), timeout=min(limit - now, 0.5))
            for r in sorted({waitables[w] for w in ready}):
                if r in out or r in errors:
                    continue
                got = self._receive(r, call_id)
                if got is None:
                    continue  # a late answer from an earlier, failed call
                ok, value = got
                answered = time.monotonic()
                if ok:
                    out[r] = value
                else:
                    errors[r] = value
                    grace = grace or time.monotonic() + _GRACE_S
        if errors or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in errors]
            stacks = self._hung_stacks(missing) if missing else {}
            self.close(force=True)
            raise RankError(self._report(what, window, errors, missing, stacks, grace is not None))
        return [out[r] for r in range(self.world_size)]

    def _report(self, what, window_s, errors, missing, stacks, after_failure) -> str:
        """One line naming what went wrong on which rank (a stuck rank: where it waits), then the details."""
        by_line: dict[str, list[int]] = {}
        for r, tb in sorted(errors.items()):
            by_line.setdefault(_first_line(tb), []).append(r)
        summary = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {line}"
                   for line, rs in by_line.items()]
        if missing:
            why = (f"no answer within {_GRACE_S:g} s of the failure above" if after_failure
                   else f"made no progress for {window_s:g} s (no heartbeat, no CPU time outside waits)")
            if what == "start-up" and self._started is not None:  # what the start was waiting on
                why += " (" + "; ".join(sorted({_PHASES.get(self._started[r], "running") for r in missing})) + ")"
            places = [f"rank {r} in {at}" for r in missing if (at := waiting_at(stacks.get(r) or ""))]
            if places:
                why += ": " + ", ".join(places)
            summary.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} {why}")
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        for r in missing:
            st = stacks.get(r) or "(no stack dump came back)"
            phase = ""
            if what == "start-up" and self._started is not None:
                phase = f" (it was {_PHASES.get(self._started[r], 'running')})"
            parts.append(f"--- rank {r}: no answer{phase}; every thread's stack ---\n{st}")
        return f"{what} failed on {self.world_size} ranks: " + "; ".join(summary) + "\n" + "\n".join(parts)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; the per-rank results in rank order.

        ``fn`` must be importable by name (a module-level function); ``fn``, the
        arguments and the results must pickle. A call that cannot be pickled
        raises :class:`RankError` at once, and the cluster stays up.
        """
        name = getattr(fn, "__name__", "call")
        if not self.alive:
            self.close(force=True)
            self._start()
        try:  # one pickle per rank: shared tensors hand out their file descriptor once per pickle
            blobs = [bytes(ForkingPickler.dumps((fn, args, kwargs))) for _ in range(self.world_size)]
        except Exception as e:  # noqa: BLE001
            raise RankError(f"{name}: cannot send the call to the ranks (function or arguments do not pickle): "
                            f"{type(e).__name__}: {e}") from e
        self._calls += 1
        limit = timeout_s or self.timeout_s
        for q, blob in zip(self._tasks, blobs):
            q.put((self._calls, limit, blob))
        return self._collect(self._calls, limit, name)

    def close(self, force: bool = False) -> None:
        if self._procs:
            if not force:
                for q in self._tasks:
                    q.put(None)
                for p in self._procs:
                    p.join(timeout=5)
            for p in self._procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            self._procs = []
        self._store = self._addr = None  # the store server stops and closes its socket
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
            self._stack_dir = None

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(force=exc_type is not None)  # Ctrl-C or a failure: busy ranks would not read a stop


def launch(fn: Callable, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1, **kwargs) -> list:
    """Spawn ``world_size`` local gloo ranks, run ``fn(ctx, *args)`` once, return per-rank results."""
    with LocalCluster(world_size, timeout_s=timeout_s, threads=threads) as cluster:
        return cluster.run(fn, *args, **kwargs)
