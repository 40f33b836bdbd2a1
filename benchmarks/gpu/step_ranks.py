"""Step 6: ranks on the device. An NCCL group of one through the torchrun entry (``init_from_env``: the
device set before any CUDA work, the group's timeout) and ``Comm``; then two gloo ranks sharing the
device with their tensors on it, so the window exchange, the text all-reduce, the output gather
(every DiT path at SP=2) and the VAE's halos and time tails (time, height, height+chunks) move
device tensors; each against the one-device result. A collective the backend cannot run on device
tensors fails its row with the backend's own error.
"""

from __future__ import annotations

import os

import torch

from ditsp.config import ParallelConfig
from ditsp.distributed.comm import Comm
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime

from . import build
from .measure import rel_err

TITLE = "NCCL group of one, two gloo ranks sharing the device"
DIT_PATHS = ("window", "halo", "ulysses")
VAE_MODES = ("time", "height", "height+chunks")
ATTENTION = ("ulysses", "ring", "allgather")  # global attention, causal: forward and backward
AGREE = 1e-4  # fp32: SP against one device (different row splits, different rounding)


def run(ctx) -> None:
    if ctx.cuda:
        _nccl_of_one(ctx)
    else:
        ctx.skip("nccl group of one", "no CUDA device: NCCL runs on GPUs only")
    _shared_device(ctx)


def _nccl_of_one(ctx) -> None:
    import torch.distributed as dist

    from ditsp.distributed.launcher import free_port, init_from_env

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = init_from_env(timeout_s=60)
        dev = rc.device
        facts = dict(backend=dist.get_backend(rc.group), device=str(dev),
                     current=torch.cuda.current_device() if dev.type == "cuda" else None,
                     async_error_handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "(torch default)"))
        t = torch.arange(4.0, device=dev)
        dist.all_reduce(t, group=rc.group)
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=rc.group)
        comm = Comm(rc.group)
        ints = comm.all_gather_ints([3, 4])
        model = build.dit(ctx.profile.ranks_model, dev, "fp32")
        grid, vid, txt = build.inputs(model.cfg, ctx.profile.ranks_size, dev)
        with torch.no_grad():
            want = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, grid))
            got = model(vid, txt, 1000.0, runtime=parallelize(model.cfg, ParallelConfig.window(1), grid, comm))
        err = rel_err(got, want)
        ok = facts["backend"] == "nccl" and facts["current"] == 0 and torch.equal(out, t) and ints == [[3, 4]] \
            and err <= AGREE
        ctx.row("nccl group of one", "ok" if ok else "FAIL", None if ok else f"{facts}, dit error {err}", **facts,
                dit_err=err)
    except Exception as e:  # noqa: BLE001
        ctx.fail("nccl group of one", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _shared_device(ctx) -> None:
    from ditsp.distributed.launcher import LocalCluster, RankError

    prof = ctx.profile
    items = [("dit", p) for p in DIT_PATHS] + [("vae", m) for m in VAE_MODES] + [("attention", a) for a in ATTENTION]
    cluster = None
    try:
        for kind, what in items:
            item = f"2 gloo ranks: {kind} {what}"
            if not ctx.fits(item, 15.0 if cluster is None else 5.0):
                continue
            if cluster is None:
                cluster = LocalCluster(2, timeout_s=max(10.0, min(40.0, ctx.remaining() - 5.0)))
            try:
                res = cluster.run(shared_rank, ctx.device.type, kind, what, prof.ranks_model, prof.ranks_size,
                                  prof.vae_widths or (16, 32, 40, 40), prof.vae_groups or 8, prof.ranks_vae_clip,
                                  timeout_s=max(5.0, ctx.remaining() - 3.0))
            except RankError as e:
                ctx.fail(item, str(e).splitlines()[0][:300])
                continue
            err = max(r["err"] for r in res)
            where = sorted({d for r in res for d in r["devices"]})
            ok = err <= AGREE and where == [ctx.device.type]
            ctx.row(item, "ok" if ok else "FAIL", None if ok else f"error {err:.2e}, outputs on {where}",
                    err=err, devices=where, collectives=res[0]["collectives"])
    finally:
        if cluster is not None:
            cluster.close()


def shared_rank(rctx, device_type, kind, what, model_name, size, vae_widths, vae_groups, clip) -> dict:
    """One rank of two on the same device: the SP result against this rank's own one-device result."""
    dev = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    comm = Comm(rctx.group)
    if kind == "attention":  # autograd: the backward's collectives too
        want, got, outs = _attention(rctx, dev, what)
        return {"err": rel_err(got, want), "devices": sorted({t.device.type for t in outs}), "collectives": {}}
    with torch.no_grad():
        if kind == "dit":
            model = build.dit(model_name, dev, "fp32")
            grid, vid, txt = build.inputs(model.cfg, size, dev)
            want = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, grid))
            rt = parallelize(model.cfg, ParallelConfig.window(2, window_path=what), grid, comm)
            comm.stats.reset()
            got = model(vid, txt, 1000.0, runtime=rt)
            outs = [got]
        else:
            from ditsp.models.seedvr2.vae import RELEASED
            from ditsp.models.seedvr2.vae.fixtures import seeded_vae
            from ditsp.models.seedvr2.vae.sharded import ParallelVAE

            vae = seeded_vae(RELEASED.with_widths(tuple(vae_widths), groups=vae_groups)).to(dev)
            T, H, W = clip
            x = torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(0)).to(dev) * 2 - 1
            one = ParallelVAE(vae)
            m1 = one.encode(x, mode="replicated").posterior.mean
            d1 = one.decode(m1, mode="replicated")
            pv = ParallelVAE(vae, comm)
            comm.stats.reset()
            m = pv.encode(x, mode=what).posterior.mean
            d = pv.decode(m1, mode=what)
            want, got, outs = torch.cat([m1.flatten(), d1.flatten()]), torch.cat([m.flatten(), d.flatten()]), [m, d]
    return {"err": rel_err(got, want), "devices": sorted({t.device.type for t in outs}),
            "collectives": {k: v["calls"] for k, v in comm.stats.as_dict().items()}}


def _attention(rctx, dev, what):
    """Causal global attention over a sequence split in two: this rank's output and input gradients against
    its rows of the one-device forward and backward (fp32, GQA)."""
    from ditsp.attention import AllGatherKV, Ring, Ulysses

    make = {"ulysses": Ulysses, "ring": Ring, "allgather": AllGatherKV}[what]
    g = torch.Generator().manual_seed(0)
    S, r = 48, rctx.rank
    q, k, v, dout = (torch.randn(1, 2 * S, h, 64, generator=g).to(dev) for h in (4, 2, 2, 4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = make(None)(*full, causal=True)
    ref.backward(dout)
    mine = [t[:, r * S:(r + 1) * S].clone().requires_grad_() for t in (q, k, v)]
    out = make(rctx.group)(*mine, causal=True)
    out.backward(dout[:, r * S:(r + 1) * S])
    rows = slice(r * S, (r + 1) * S)
    want = torch.cat([ref.detach()[:, rows].flatten()] + [t.grad[:, rows].flatten() for t in full])
    got = torch.cat([out.detach().flatten()] + [t.grad.flatten() for t in mine])
    return want, got, [out] + [t.grad for t in mine]
