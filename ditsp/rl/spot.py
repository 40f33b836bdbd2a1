"""One spot worker process: joins SP groups, pulls requests, commits each unit, and leaves when preempted.

A spot worker is spawned by :class:`~.scheduler.SpotPool` (a fresh interpreter) and dies with it: the
kernel's parent-death signal is armed before anything heavy is imported
(:mod:`ditsp.distributed.parent_death`), then the launcher's watchdog
(:func:`~ditsp.distributed.launcher.die_with_parent`). It talks to the pool over one duplex pipe and runs
the pool's *task* (pickled to it): ``task.on_group(ctx)`` (optional) once per group it joins, and
``task.run(ctx, request, seed) -> result`` for one unit on that group (``ctx`` a
:class:`~ditsp.distributed.launcher.RankContext`); the task loads the weights version a request names.

Messages from the pool: ``("form", generation, rank, world)`` (join a group: :mod:`ditsp.distributed.elastic`,
a fresh store prefix per generation), ``("run", request, generation)`` (every member computes each unit; rank
0 commits it), ``("drop",)`` (the group is gone: leave its process group), ``("stop",)``. Answers: ``hello``,
``formed``, ``pull`` (rank 0 of an idle group asks for work), ``unit``, ``done``, ``aborted``, ``failed``,
``idle``, ``bye``.

Preemption. SIGTERM while the worker waits for a message ends it at once; while it sends an answer, right
after. Inside a unit, the worker finishes the unit (and commits it) only when its mean unit time says the
unit ends within :data:`FINISH_SHARE` of the grace period (the pool writes it to the shared ``grace`` value
before signalling); otherwise it abandons the unit, which the pool returns to the queue. Either way nothing
it committed is lost. :data:`PEER_LOST` from the pool (a group member is gone) abandons the unit in flight
at once, so survivors do not compute on until their next collective fails.
"""

from __future__ import annotations

import os
import signal
import time

PEER_LOST = signal.SIGUSR2
FINISH_SHARE = 0.8  # a preempted unit is finished only when expected to end within this share of the grace


class Preempted(BaseException):
    """SIGTERM: the worker leaves (a BaseException, so no task code swallows it)."""


class PeerLost(BaseException):
    """A member of this worker's group is gone: the unit in flight is abandoned."""


class _State:
    def __init__(self, grace):
        self.grace = grace  # shared double: the grace (s) of the coming SIGTERM
        self.unit_start: float | None = None  # inside a unit since (monotonic)
        self.unit_mean_s: float | None = None
        self.term = False
        self.waiting = False  # blocked reading the pipe: a SIGTERM may end the worker right there

    def finishes_in_grace(self) -> bool:
        if self.unit_mean_s is None or self.unit_start is None:
            return False
        left = max(0.0, self.unit_mean_s - (time.monotonic() - self.unit_start))
        return left <= FINISH_SHARE * float(self.grace.value)

    def timed(self, seconds: float) -> None:
        self.unit_mean_s = seconds if self.unit_mean_s is None else 0.5 * (self.unit_mean_s + seconds)


def spot_main(parent_pid: int, name: str, port: int, timeout_s: float, task_blob: bytes, conn, grace) -> None:
    """A spot worker's life (the target of its process). The task comes pickled, and is unpickled (which may
    import a model's modules) only once the worker is armed to die with the pool's process."""
    from ..distributed.parent_death import arm_parent_death_signal  # standard library only

    arm_parent_death_signal()  # before torch loads: a pool killed while this worker imports leaves no orphan
    if os.getppid() != parent_pid:
        os._exit(1)
    from ..distributed.launcher import _loopback_ifname, die_with_parent, error_line

    die_with_parent(parent_pid)  # the watchdog too
    import pickle

    task = pickle.loads(task_blob)
    st = _State(grace)

    def on_term(signum, frame):
        # Raised only where nothing is half-written: waiting for a message, or inside a unit that would not
        # end in time. Anywhere else (sending an answer) it is noted and acted on at the next safe point.
        st.term = True
        if st.waiting or (st.unit_start is not None and not st.finishes_in_grace()):
            raise Preempted()

    def on_peer_lost(signum, frame):
        if st.unit_start is not None:
            raise PeerLost()

    os.environ["DITSP_RL_WORKER"] = name
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ifname = _loopback_ifname()
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    import torch

    from ..distributed.elastic import ElasticGroup

    torch.set_num_threads(1)
    group = ElasticGroup(port, timeout_s)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(PEER_LOST, on_peer_lost)
    try:
        if hasattr(task, "setup"):
            task.setup()
        conn.send(("hello", os.getpid()))
        while not st.term:
            st.waiting = True
            try:
                if st.term:  # signalled just before the flag was set
                    raise Preempted()
                msg = conn.recv()
            finally:
                st.waiting = False
            if msg[0] == "stop":
                break
            if msg[0] == "form":
                _, gen, rank, world = msg
                try:
                    group.form(gen, rank, world)
                    if hasattr(task, "on_group"):
                        task.on_group(group.context())
                except Exception as e:  # noqa: BLE001 - a member gone while forming: the pool re-forms
                    group.drop()
                    group.world, group.gen = 1, -1
                    conn.send(("aborted", None, gen, f"forming the group failed: {error_line(e)}", 0.0))
                    continue
                conn.send(("formed", gen))
                if rank == 0:
                    conn.send(("pull", gen))
            elif msg[0] == "drop":
                group.drop()
                group.world, group.gen = 1, -1
                conn.send(("idle",))
            elif msg[0] == "run":
                _, request, gen = msg
                if gen != group.gen:
                    continue  # a request for a group this worker has left
                _run(task, group, request, gen, conn, st, error_line)
    except Preempted:
        # Leave at once: tearing the process group down politely would wait on peers inside a collective
        # with this worker; its sockets closing is what tells them.
        _bye(conn)
        os._exit(0)
    group.drop()
    _bye(conn)
    os._exit(0)  # told to stop: nothing is left to write, and an interpreter's teardown with torch takes seconds


def _bye(conn) -> None:
    try:
        conn.send(("bye",))
    except OSError:
        pass


def _run(task, group, request, gen, conn, st, error_line) -> None:
    """Every unit of ``request`` on this worker's group; rank 0 commits each as it ends, with its wall and CPU
    seconds (an abandoned unit's CPU seconds go with its ``aborted``: the work a preemption wasted)."""
    leader = group.rank == 0
    ctx = group.context()
    for seed in request.seeds:
        t0, c0 = time.monotonic(), time.thread_time()
        st.unit_start = t0
        try:
            result = task.run(ctx, request, seed)
        except PeerLost:
            st.unit_start = None
            conn.send(("aborted", request.id, gen, "a peer of the group was lost", time.thread_time() - c0))
            return
        except Preempted:
            st.unit_start = None
            if leader:
                conn.send(("aborted", request.id, gen, "preempted", time.thread_time() - c0))
            raise
        except Exception as e:  # noqa: BLE001 - a broken collective (a peer died) or a task's own failure
            st.unit_start = None
            conn.send(("failed", request.id, gen, error_line(e), time.thread_time() - c0))
            return
        st.unit_start = None
        st.timed(time.monotonic() - t0)
        if leader:
            conn.send(("unit", request.id, gen, seed, result, time.monotonic() - t0, time.thread_time() - c0))
        if st.term:  # finished inside the grace period: committed, now leave
            return
    if leader:
        conn.send(("done", request.id, gen))
        conn.send(("pull", gen))
