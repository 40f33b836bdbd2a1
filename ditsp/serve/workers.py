"""Persistent worker processes that form, lose and re-form SP groups without reloading weights.

What one worker process runs (the server's handle on it is
:class:`~.handles.Worker`). A worker is a spawned process that lives as long as the server. It
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
- ``job``: :func:`~ditsp.models.seedvr2.job.restore.rank_upscale`, with rank 0's
  progress written to a shared array the server reads.

A worker dies with the server, also while it is still starting (:mod:`.boot`
arms the kernel's parent-death signal before any heavy import; the launcher's
``die_with_parent`` adds a watchdog). Weights that fail to load from storage
are answered as :class:`WeightsLoadError`, which stops the server. When a
peer dies mid-collective, gloo raises on the survivors (the dead peer's
sockets close); a survivor then drops its process group at once, so peers
blocked on it fail too, and it waits for the next ``form``.
"""

from __future__ import annotations

import os
import signal
import time
import traceback

import torch

from ..cpu import malloc as cpu_malloc
from ..distributed.comm import Comm
from ..models.meta import meta_device
from ..distributed.elastic import STORE_PREFIX, ElasticGroup  # noqa: F401 - STORE_PREFIX re-exported
from ..distributed.launcher import _loopback_ifname, die_with_parent, error_line
from ..weights import is_quantized
from ..models.seedvr2.nadit.model import NaDiT
from ..models.seedvr2.vae import VideoVAE
from ..models.seedvr2.presets import dit_config, vae_config
from ..config import ParallelConfig
from ..models.seedvr2.parallelize import parallelize
from ..distributed.heartbeat import install
from ..models.seedvr2.job.restore import rank_upscale
from ..models.seedvr2 import weights


# -- worker side ----------------------------------------------------------------

PEER_LOST_SIGNAL = signal.SIGUSR2  # the server's "a peer of your group died" to a worker inside a job
_in_job = [False]


class WeightsLoadError(RuntimeError):
    """The checkpoints failed to load from storage (corrupt, non-finite, wrong shapes...): any worker would
    fail the same way, so the server stops instead of replacing workers (the controller reads the name)."""


class PeerLost(RuntimeError):
    """The server said a peer of this worker's group died: the job stops now instead of computing on
    until its next collective fails (seconds on a large window)."""


def _on_peer_lost(signum, frame) -> None:
    if _in_job[0]:  # only inside a job: between commands the signal is ignored
        _in_job[0] = False
        raise PeerLost("a peer of this group was lost; the job stops to re-form the group")


def progress_to(shared):
    """A job's progress callback in a worker: rank 0's step counts go to the shared array (done, total) the
    server copies into the job's row."""

    def progress(done: int, total: int, label: str) -> None:
        shared[0], shared[1] = done, total

    return progress


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
        dit = NaDiT(dit_config(spec.model))
        vae = VideoVAE(vae_config(spec.model))
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
        try:
            weights.load(spec, comm=comm if not any(h for h, _ in pairs) else None)
        except Exception as e:  # noqa: BLE001 - reported to the server as what it is
            raise WeightsLoadError(error_line(e)) from e
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
    """The DiT grids a request's windows use (for warming the plan cache at a new degree): its plan's."""
    return req.plan.grids


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


def worker_main(index: int, port: int, timeout_s: float, threads: int, tasks, answers, progress, beats,
                parent_pid: int) -> None:
    """A worker's life (started by :func:`.boot.worker_entry`): hello, then commands until told to stop."""
    die_with_parent(parent_pid)  # the watchdog (the kernel's signal is armed already)
    install(beats, 0)  # collectives and pipeline stages bump it: the server's stuck-worker check
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    ifname = _loopback_ifname()
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    torch.set_num_threads(threads)
    report_progress = progress_to(progress)
    # import what a job needs now, so neither a job nor a joining rank pays for it later
    from ..io import probe, read, write  # noqa: F401
    from ..models.seedvr2 import parallelize  # noqa: F401
    from ..models.seedvr2.job import restore  # noqa: F401
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
                req = payload["req"]  # planned for this group's size (the ranks check it)
                progress[0], progress[1] = 0, 0
                _in_job[0] = True
                try:
                    out = rank_upscale(group.context(), req, progress=report_progress)
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
