"""The VAE checker: one device and the sharded VAE at each degree against the reference tensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .vectors import ClusterFactory, REL_TOL, VectorSetError, _digest, read_config, rel_err
from ..vae.checkpoint import load_checkpoint
from ..vae.config import VaeConfig
from ..vae.fixtures import seeded_vae
from ....distributed.comm import Comm
from ..vae.sharded import ParallelVAE
from ....distributed.launcher import LocalCluster
from safetensors.torch import load_file
from ..vae.model import VideoVAE


def _load_vae(directory: str):
    """(model, io) of a VAE vector set; weights rebuilt by the seeded recipe when the set ships none."""

    cfg_json = read_config(directory)
    try:
        cfg = VaeConfig.from_json(Path(directory) / "config.json")
    except (KeyError, TypeError, ValueError) as e:
        raise VectorSetError(f"{directory}: config.json does not describe a VAE ({type(e).__name__}: {e})") from None
    weights = Path(directory) / "weights.safetensors"
    if weights.is_file():
        vae = VideoVAE(cfg).eval()
        load_checkpoint(vae, weights)
    else:
        vae = seeded_vae(cfg, int(cfg_json.get("seed", 1234)))
    io = load_file(Path(directory) / "io.safetensors")
    missing = [k for k in ("video", "posterior_mean", "posterior_logvar", "decoded_from_mean") if k not in io]
    if missing:
        raise VectorSetError(f"{directory}/io.safetensors lacks {missing}")
    return vae, io


@torch.no_grad()
def _vae_one_device(vae, io, chunk) -> dict:
    post = vae.encode(io["video"], chunk=chunk)
    errs = {"posterior_mean": rel_err(post.mean, io["posterior_mean"]),
            "posterior_logvar": rel_err(post.logvar, io["posterior_logvar"]),
            "decoded_from_mean": rel_err(vae.decode(io["posterior_mean"], chunk=chunk), io["decoded_from_mean"])}
    if "sample_noise" in io and "latent_pipeline" in io:
        latent = vae.channels_last(vae.to_latent(post.sample(io["sample_noise"])))[0]
        errs["latent_pipeline"] = rel_err(latent, io["latent_pipeline"])
    if "latent_pipeline" in io and "decoded" in io:
        z = vae.from_latent(vae.channels_first(io["latent_pipeline"][None]))
        errs["decoded"] = rel_err(vae.decode(z, chunk=chunk), io["decoded"])
    return errs


@torch.no_grad()
def _vae_rank(ctx, directory: str) -> list:
    """One rank: (mode, worst relative error, digest, report) of every sharded mode."""

    torch.set_num_threads(1)
    vae, io = _load_vae(directory)
    pv = ParallelVAE(vae, Comm(ctx.group))
    out = []
    for mode in ("time", "height", "height+chunks"):
        enc = pv.encode(io["video"], mode=mode)
        dec = pv.decode(io["posterior_mean"], mode=mode)
        err = max(rel_err(enc.posterior.mean, io["posterior_mean"]), rel_err(enc.posterior.logvar, io["posterior_logvar"]),
                  rel_err(dec, io["decoded_from_mean"]))
        out.append((mode, err, _digest(enc.posterior.mean) + _digest(dec), enc.report))
    return out


def check_vae(directory: str | os.PathLike, degrees: Sequence[int] = (1, 2, 3),
              cluster_factory: ClusterFactory | None = None) -> dict:
    """Check a VAE vector set: one device (plain and chunked: posterior mean/logvar, pipeline latent,
    decoded, decoded from the mean), and at each SP degree > 1 the sharded modes (time, height,
    height+chunks; every rank must return the same bytes)."""

    directory = os.fspath(directory)
    vae, io = _load_vae(directory)
    result = {"kind": "vae", "dir": directory, "threshold": REL_TOL,
              "ref_max_abs": io["decoded_from_mean"].abs().max().item(), "runs": []}
    for n in degrees:
        n = int(n)
        if n < 1:
            raise ValueError(f"SP degree must be >= 1, got {n}")
        if n == 1:
            for chunk, path in ((None, "single device"), (1, "single device, chunked")):
                errs = _vae_one_device(vae, io, chunk)
                worst = max(errs, key=errs.get)
                run = {"degree": 1, "path": path, "rel_err": errs[worst], "ranks_agree": True, "errors": errs}
                if errs[worst] > REL_TOL:
                    run["first_divergence"] = worst
                run["pass"] = run["rel_err"] <= REL_TOL
                result["runs"].append(run)
            continue
        if cluster_factory is not None:
            results = cluster_factory(n).run(_vae_rank, directory)
        else:
            with LocalCluster(n, timeout_s=300.0, threads=1) as cluster:
                results = cluster.run(_vae_rank, directory)
        for i, (mode, _, _, report) in enumerate(results[0]):
            errs = [r[i][1] for r in results]
            run = {"degree": n, "path": f"VAE {mode}", "rel_err": max(errs), "rank_rel_err": errs,
                   "ranks_agree": len({r[i][2] for r in results}) == 1}
            run["pass"] = run["rel_err"] <= REL_TOL and run["ranks_agree"]
            result["runs"].append(run)
    result["pass"] = all(r["pass"] for r in result["runs"])
    return result
