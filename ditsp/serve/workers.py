"""Persistent worker processes that form, lose and re-form SP groups without reloading weights.

A :class:`Worker` is one spawned process that lives as long as the server. It
keeps its weights (the per-process cache of :mod:`ditsp.models.seedvr2.weights`)
across groups. The server hosts one TCPStore on 127.0.0.1; every group
*generation* rendezvouses under its own key prefix (``ditsp-gen<g>/``), so a
new group never sees a dead one's keys. Forming a group on a worker is:
destroy the old default process group (if any), then ``init_process_group``
over a :class:`~torch.distributed.PrefixStore` with the new rank and world
size. A one-rank group needs no process group at all.

Commands a worker runs (one at a time, answered over its own pipe):

- ``form``: join generation ``g`` as rank ``r`` of ``w``;
- ``weights``: make sure every rank of the group holds the weights of a spec:
  ranks that already hold them (in the cache) send them to those that do not
  with one byte broadcast from the lowest such rank; only when no rank holds
  them are they loaded from storage;
- ``replan``: build the SP runtimes of the grids recent jobs used (the server
  sends the same list to every rank) at the new degree (window plans are
  cached, so this fills the cache before the next job needs it);
- ``job``: :func:`~ditsp.models.seedvr2.restore.rank_upscale`, with rank 0's
  progress written to a shared array the server reads.

A worker dies with the server (the launcher's ``die_with_parent``). When a
peer dies mid-collective, gloo raises on the survivors (the dead peer's
sockets close); a survivor then drops its process group at once, so peers
blocked on it fail too, and it waits for the next ``form``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from ..cpu import malloc as cpu_malloc
from ..distributed.comm import Comm
from ..models.meta import meta_device
from ..distributed.elastic import STORE_PREFIX, ElasticGroup  # noqa: F401 - STORE_PREFIX re-exported
from ..distributed.launcher import _loopback_ifname, die_with_parent, error_line
from ..weights import is_quantized
from ..models.seedvr2.nadit.config import get_config
from ..models.seedvr2.nadit.model import NaDiT
from ..models.seedvr2.vae import VideoVAE
from ..models.seedvr2.vae.config import PRESETS as VAE_PRESETS
from ..models.seedvr2.weights import MODELS
from ..io.probe import count_frames, probe
from ..models.seedvr2.pipeline import frame_geometry, plan_windows
from ..models.seedvr2.pipeline.padding import padded_length
from ..config import ParallelConfig
from ..models.seedvr2.parallelize import parallelize
from ..distributed.heartbeat import install
from ..models.seedvr2.restore import rank_upscale
from ..models.seedvr2 import weights


class WorkerDied(RuntimeError):
    """A worker process ended (its pipe closed or its process exited)."""


# -- worker side ----------------------------------------------------------------

PEER_LOST_SIGNAL = signal.SIGUSR2  # the server's "a peer of your group died" to a worker inside a job
_in_job = [False]


class PeerLost(RuntimeError):
    """The server said a peer of this worker's group died: the job stops now instead of computing on
    until its next collective fails (seconds on a large window)."""


def _on_peer_lost(signum, frame) -> None:
    if _in_job[0]:  # only inside a job: between commands the signal is ignored
        _in_job[0] = False
        raise PeerLost("a peer of this group was lost; the job stops to re-form the group")


class _Progress:
    """A stand-in for tqdm's bar inside a worker: rank 0's step counts go to a shared array."""

    shared = None  # multiprocessing Array('l', 2): done, total

    def __init__(self, *args, total=None, disable=False, **kwargs):
        self.n, self.total, self.disable = 0, int(total or 0), disable
        self._publish()

    def _publish(self):
        if not self.disable and _Progress.shared is not None:
            _Progress.shared[0], _Progress.shared[1] = self.n, self.total

    def update(self, n=1):
        self.n += n
        self._publish()

    def set_postfix_str(self, *args, **kwargs):
        pass

    def close(self):
        pass


def _tensors(models) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a weights set, in a fixed order: DiT and VAE parameters and buffers, the text."""
    out = []
    for prefix, mod in (("dit", models.dit), ("vae", models.vae)):
        out += [(f"{prefix}.p.{n}", t) for n, t in mod.named_parameters()]
        out += [(f"{prefix}.b.{n}", t) for n, t in mod.named_buffers()]
    out.append(("text", models.text))
    return out


def _quantized(models) -> bool:
    return is_quantized(models.dit) or is_quantized(models.vae)


def _skeleton(spec):
    """The DiT and VAE of ``spec`` with unallocated storage (no initialisation, no file read)."""
    with meta_device():
        dit = NaDiT(get_config(spec.model))
        vae = VideoVAE(VAE_PRESETS[MODELS[spec.model]])
    return dit.to_empty(device="cpu"), vae.to_empty(device="cpu")


def _set_tensor(root: torch.nn.Module, dotted: str, kind: str, t: torch.Tensor) -> None:
    mod_name, _, leaf = dotted.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if kind == "p":
        mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[leaf] = t


def share_weights(spec, comm: Comm) -> dict:
    """Give every rank of ``comm``'s group the weights of ``spec``; the ranks holding them send them."""
    t0 = time.perf_counter()
    have = weights.cached(spec) is not None
    # The copy rebuilds a receiver from a float skeleton: quantized weights (FP8/GGUF kept as stored
    # bytes) are not sent; a rank that lacks them loads them from storage.
    shareable = have and not _quantized(weights.cached(spec))
    pairs = comm.all_gather_object((have, shareable))
    flags = [s for _, s in pairs]
    if all(h for h, _ in pairs):
        return {"source": "cache", "copy_s": 0.0, "bytes": 0}
    if not any(flags):
        if have:
            return {"source": "cache", "copy_s": 0.0, "bytes": 0}
        # From storage: together when no rank holds them (spec.read may name one reader for the group),
        # else alone (the holders have returned and take no part in a collective).
        weights.load(spec, comm=comm if not any(h for h, _ in pairs) else None)
        return {"source": "storage", "copy_s": time.perf_counter() - t0, "bytes": 0}
    src = flags.index(True)
    if comm.rank == src:
        tensors = _tensors(weights.cached(spec))
        manifest = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors]
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors]
        flat = torch.cat(raw) if raw else torch.zeros(0, dtype=torch.uint8)
        comm.broadcast_object([manifest, flat.numel()], src)
        comm.broadcast(flat, src, kind="weights")
        return {"source": "sent", "copy_s": time.perf_counter() - t0, "bytes": int(flat.numel())}
    manifest, nbytes = comm.broadcast_object(None, src)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    comm.broadcast(flat, src, kind="weights")
    if have:  # this rank held them already: nothing to install
        return {"source": "cache", "copy_s": time.perf_counter() - t0, "bytes": 0}
    dit, vae = _skeleton(spec)
    roots = {"dit": dit, "vae": vae}
    off, text = 0, None
    for name, shape, dtype in manifest:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        t = flat[off : off + n].clone().view(dt).reshape(shape)
        off += n
        if name == "text":
            text = t
            continue
        root, kind, dotted = name.split(".", 2)
        _set_tensor(roots[root], dotted, kind, t)
    dit.eval().requires_grad_(False)
    vae.eval().requires_grad_(False)
    weights.install(weights.SeedVR2(spec, dit, vae, text))
    return {"source": "peer", "copy_s": time.perf_counter() - t0, "bytes": int(nbytes)}


def request_grids(req) -> list[tuple[int, int, int]]:
    """The DiT grids a request's windows use (for warming the plan cache at a new degree)."""
    info = probe(req.input)
    frames = info.frames if info.frames is not None else count_frames(req.input)
    geo = frame_geometry(info.width, info.height, area=req.area, size=req.size)
    window = req.window_frames or padded_length(frames)
    grids = set()
    for win in plan_windows(frames, window, min(req.overlap, window - 1), req.seed):
        t = (padded_length(win.stop - win.start) - 1) // 4 + 1
        grids.add((t, geo.out_height // 16, geo.out_width // 16))  # VAE 8x8, patch 1x2x2
    return sorted(grids)


def replan(spec, grids, planner: str, comm: Comm) -> dict:
    """Build the SP runtimes of ``grids`` on ``comm``'s group (fills the plan cache)."""
    t0 = time.perf_counter()
    models = weights.cached(spec)
    world = comm.world_size
    if models is not None:
        for grid in grids:
            parallelize(models.dit.cfg, ParallelConfig.window(world, window_planner=planner), tuple(grid),
                        comm.group)
    return {"replan_s": time.perf_counter() - t0, "grids": len(grids)}


def _worker_main(index: int, port: int, timeout_s: float, threads: int, tasks, answers, progress,
                 parent_pid: int, beats=None) -> None:
    die_with_parent(parent_pid)
    if beats is not None:
        install(beats, 0)  # collectives and pipeline stages bump it: the server's stuck-worker check
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    ifname = _loopback_ifname()
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    torch.set_num_threads(threads)
    import tqdm  # local: imported in the worker process only, which swaps in its progress reporter

    tqdm.tqdm = _Progress  # rank_upscale's progress bar reports to the server instead of a terminal
    _Progress.shared = progress
    # import what a job needs now, so neither a job nor a joining rank pays for it later
    from ..io import probe, read, write  # noqa: F401
    from ..models.seedvr2 import parallelize, restore  # noqa: F401
    from ..models.seedvr2.vae import sharded  # noqa: F401

    group = ElasticGroup(port, timeout_s)
    signal.signal(PEER_LOST_SIGNAL, _on_peer_lost)
    answers.send((0, True, {"pid": os.getpid()}))
    while True:
        item = tasks.get()
        if item is None:
            break
        cmd_id, name, payload = item
        try:
            if name == "form":
                out = group.form(**payload)
            elif name == "weights":
                out = share_weights(payload["spec"], group.comm())
            elif name == "replan":
                out = replan(payload["spec"], payload["grids"], payload["planner"], group.comm())
            elif name == "job":
                req = replace(payload["req"], sp=group.world)
                progress[0], progress[1] = 0, 0
                _in_job[0] = True
                try:
                    out = rank_upscale(group.context(), req)
                finally:
                    _in_job[0] = False
            elif name == "load":
                t0 = time.perf_counter()
                weights.load(payload["spec"])
                out = {"load_s": time.perf_counter() - t0}
            elif name == "ping":
                out = {"pid": os.getpid()}
            else:
                raise ValueError(f"unknown worker command {name!r}")
            answers.send((cmd_id, True, out))
        except BaseException as e:  # noqa: BLE001 - any failure goes back; the group is dropped
            group.drop()
            group.world = 1
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            answers.send((cmd_id, False, f"{error_line(e)}\n{tb}"))
        if name == "job":  # idle until the next job: hold only what is live (the reuse policy keeps the rest)
            cpu_malloc.release_free_heap()
    group.drop()


# -- server side ----------------------------------------------------------------


class Worker:
    """One persistent worker process (spawned; see the module doc)."""

    def __init__(self, index: int, port: int, timeout_s: float = 60.0, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.index = index
        self.tasks = ctx.Queue()
        reader, writer = ctx.Pipe(duplex=False)
        self.answers = reader
        self.progress = ctx.Array("l", 2, lock=False)
        self.beats = ctx.Array("Q", 1, lock=False)
        self.proc = ctx.Process(target=_worker_main, name=f"ditsp-serve-worker-{index}", daemon=True,
                                args=(index, port, timeout_s, threads, self.tasks, writer, self.progress,
                                      os.getpid(), self.beats))
        with cpu_malloc.for_new_processes():
            self.proc.start()
        writer.close()
        self.ready = False
        self.has_weights = False
        self._ids = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """True once the process has started and answered its hello."""
        if not self.ready and self.answers.poll(timeout):
            cid, ok, _ = self.answers.recv()
            self.ready = ok and cid == 0
        return self.ready

    def send(self, name: str, payload: dict | None = None) -> int:
        self._ids += 1
        self.tasks.put((self._ids, name, payload or {}))
        return self._ids

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.tasks.put(None)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(timeout=3)
        self.kill()


def call(workers: list[Worker], name: str, payloads: list[dict], timeout_s: float,
         on_wait=None, interrupt: bool = False) -> tuple[dict, dict, list[Worker]]:
    """Send one command to each worker and collect the answers.

    Returns ``(results, errors, dead)``: answers by worker index, error texts
    by worker index, and the workers that died meanwhile. Once a worker dies or
    fails, the others get a short grace to answer (a survivor blocked in a
    collective with the dead one fails soon after); with ``interrupt`` they
    are told at once (:data:`PEER_LOST_SIGNAL`), so they stop their job
    instead of computing until their next collective fails. ``timeout_s`` is a
    stuck-worker check: a worker that has answered nothing and whose heartbeat
    (collectives, pipeline stages) has not moved for that long is stuck; a long
    job that progresses is not. ``on_wait()`` is called about twice a second
    while waiting (progress, cancellation).
    """
    ids = {w.index: w.send(name, p) for w, p in zip(workers, payloads)}
    results: dict = {}
    errors: dict = {}
    dead: list[Worker] = []
    grace = None
    pending = {w.index: w for w in workers}
    start = time.monotonic()
    seen = {w.index: w.beats[0] for w in workers}
    moved = {w.index: start for w in workers}
    while pending:
        now = time.monotonic()
        for w in pending.values():
            if w.beats[0] != seen[w.index]:
                seen[w.index], moved[w.index] = w.beats[0], now
        deadline = min(moved[i] for i in pending) + timeout_s
        limit = deadline if grace is None else min(deadline, grace)
        if now >= limit:
            break
        waitables = {}
        for w in pending.values():
            waitables[w.answers] = w
            waitables[w.proc.sentinel] = w
        ready = multiprocessing.connection.wait(list(waitables), timeout=min(0.5, limit - now))
        for w in {id(waitables[r]): waitables[r] for r in ready}.values():
            got = None
            try:
                while w.answers.poll():
                    cid, ok, payload = w.answers.recv()
                    if cid == ids[w.index]:
                        got = (ok, payload)
            except (EOFError, OSError):
                pass
            if got is not None:
                (results if got[0] else errors)[w.index] = got[1]
                pending.pop(w.index)
                if not got[0]:
                    grace = grace or time.monotonic() + 10.0
            elif not w.alive:
                w.noticed_at = time.monotonic()
                w.proc.join(timeout=1)
                dead.append(w)
                errors[w.index] = f"worker {w.index} (pid {w.pid}) died (exit code {w.proc.exitcode})"
                pending.pop(w.index)
                grace = grace or time.monotonic() + 10.0
                if interrupt:
                    for other in pending.values():
                        try:
                            os.kill(other.pid, PEER_LOST_SIGNAL)
                        except OSError:
                            pass
        if on_wait is not None:
            on_wait()
    for idx, w in pending.items():
        errors[idx] = f"worker {idx} did not answer {name!r} in time (no progress for {timeout_s:g} s)"
    return results, errors, dead
