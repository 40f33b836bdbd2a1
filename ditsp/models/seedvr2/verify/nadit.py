"""The NaDiT checker: one device and window-aligned SP at each degree against the reference output."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .vectors import ClusterFactory, REL_TOL, VectorSetError, _digest, read_config, rel_err
from ..nadit.config import NaDiTConfig
from ..nadit import NaDiT, load_checkpoint
from ....config import ParallelConfig
from ..parallelize import parallelize, single_runtime
from ....distributed.launcher import LocalCluster
from safetensors.torch import load_file


def nadit_config(config: dict, name: str = "vectors"):
    """The :class:`~.nadit.NaDiTConfig` a NaDiT vector set's ``config.json`` describes (3B or 7B family)."""

    c = config
    try:
        variant = "7b" if c.get("mlp_type") == "normal" else "3b"
        if variant == "3b" and c.get("mlp_type", "swiglu") != "swiglu":
            raise VectorSetError(f"unknown mlp_type {c['mlp_type']!r}")
        layers = int(c["num_layers"])
        windows = [tuple(int(v) for v in w) for w in c.get("window", [[4, 3, 3]] * layers)]
        if len(set(windows)) != 1:
            raise VectorSetError(f"per-layer window counts differ ({sorted(set(windows))}); "
                                 "the runtime takes one window count for every layer")
        if int(c.get("txt_dim", c["vid_dim"])) != int(c["vid_dim"]):
            raise VectorSetError("txt_dim differs from vid_dim; NaDiT needs them equal")
        common = dict(
            name=name, variant=variant, vid_in_channels=int(c["vid_in_channels"]),
            vid_out_channels=int(c["vid_out_channels"]), vid_dim=int(c["vid_dim"]), txt_in_dim=int(c["txt_in_dim"]),
            heads=int(c["heads"]), head_dim=int(c["head_dim"]), num_layers=layers,
            norm_eps=float(c.get("norm_eps", 1e-5)), patch_size=tuple(int(v) for v in c.get("patch_size", (1, 2, 2))),
            num_windows=windows[0], window_methods=tuple(c["window_method"]) if "window_method" in c else (),
            txt_len=int(c.get("txt_len", 58)),
        )
        if variant == "7b":
            return NaDiTConfig(
                **common, mm_layers=layers,
                mlp_hidden=int(c.get("mlp_hidden", int(c.get("expand_ratio", 4)) * int(c["vid_dim"]))),
                rope_dim=int(c.get("rope_class_dim", int(c["head_dim"]) // 2)),
                rope_max_freq=float(c.get("rope_max_freq", 256.0)))
        return NaDiTConfig(**common, mm_layers=int(c["mm_layers"]), mlp_hidden=int(c["swiglu_hidden"]),
                           rope_dim=int(c["rope_dim"]), rope_theta=float(c.get("rope_theta", 10000.0)))
    except KeyError as e:
        raise VectorSetError(f"config.json lacks {e.args[0]!r}") from None


def _load_nadit(directory: str):

    cfg = nadit_config(read_config(directory), Path(directory).name)
    model = NaDiT(cfg).eval()
    load_checkpoint(model, Path(directory) / "weights.safetensors")  # strict, reference key names
    io = load_file(Path(directory) / "io.safetensors")
    missing = [k for k in ("vid_in", "txt_in", "timestep", "vid_out") if k not in io]
    if missing:
        raise VectorSetError(f"{directory}/io.safetensors lacks {missing}")
    return cfg, model, io


@torch.no_grad()
def _nadit_rank(ctx, directory: str, planner: str) -> tuple[float, str, str]:
    """One rank of a window-SP run: (relative error, output digest, runtime report)."""

    cfg, model, io = _load_nadit(directory)
    rt = parallelize(cfg, ParallelConfig.window(ctx.world_size, window_planner=planner, window_path="window"),
                     model.grid_of(io["vid_in"].shape), ctx.group)
    out = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=rt)
    return rel_err(out.reshape(io["vid_out"].shape), io["vid_out"]), _digest(out), rt.report(heads=cfg.heads)


@torch.no_grad()
def check_nadit(directory: str | os.PathLike, degrees: Sequence[int] = (1, 2, 3),
                cluster_factory: ClusterFactory | None = None, planner: str = "lpt") -> dict:
    """Run a NaDiT vector set on one device and under window-aligned SP at each of ``degrees``."""

    directory = os.fspath(directory)
    cfg, model, io = _load_nadit(directory)
    ref = io["vid_out"]
    result = {
        "kind": "nadit", "dir": directory,
        "model": {"variant": cfg.variant, "vid_dim": cfg.vid_dim, "heads": cfg.heads, "head_dim": cfg.head_dim,
                  "layers": cfg.num_layers, "schedule": list(cfg.window_methods), "params": cfg.param_count()},
        "grid": list(model.grid_of(io["vid_in"].shape)), "threshold": REL_TOL,
        "ref_max_abs": ref.abs().max().item(), "runs": [],
    }
    for n in degrees:
        n = int(n)
        if n < 1:
            raise ValueError(f"SP degree must be >= 1, got {n}")
        if n == 1:
            states: dict = {}
            out = model(io["vid_in"], io["txt_in"], io["timestep"], states=states,
                        runtime=single_runtime(cfg, model.grid_of(io["vid_in"].shape)))
            err = rel_err(out.reshape(ref.shape), ref)
            run = {"degree": 1, "path": "single device", "rel_err": err, "ranks_agree": True}
            if err > REL_TOL:  # point at the first intermediate the reference also stored that disagrees
                for k, v in states.items():
                    if k in io and io[k].numel() == v.numel() and rel_err(v.reshape(io[k].shape), io[k]) > REL_TOL:
                        run["first_divergence"] = k
                        break
        else:
            if cluster_factory is not None:
                results = cluster_factory(n).run(_nadit_rank, directory, planner)
            else:
                with LocalCluster(n, timeout_s=300.0, threads=1) as cluster:
                    results = cluster.run(_nadit_rank, directory, planner)
            errs = [r[0] for r in results]
            run = {"degree": n, "path": results[0][2], "rel_err": max(errs), "rank_rel_err": errs,
                   "ranks_agree": len({r[1] for r in results}) == 1}
        run["pass"] = run["rel_err"] <= REL_TOL and run["ranks_agree"]
        result["runs"].append(run)
    result["pass"] = all(r["pass"] for r in result["runs"])
    return result
