"""Check the port against a reference vector set: one device and window-aligned SP at several degrees.

A vector set is a folder with ``config.json`` (the model's hyper-parameters
under their plain names), ``weights.safetensors`` (the reference state_dict,
reference key names) and ``io.safetensors`` (inputs ``vid_in``, ``txt_in``,
``timestep`` and the reference output ``vid_out``; optionally ``emb``,
``vid_patch_in``, ``txt_proj_in`` and per-block ``block<i>.vid``/``.txt``).

:func:`verify_vectors` reads the config, picks the checker of its kind
(:func:`detect_kind`, :data:`CHECKERS`) and returns a plain dict (JSON-ready);
:func:`format_verify` renders it as text. A run passes when
``max |port - ref| <= 1e-5 * max |ref|``. Only NaDiT sets have a checker so
far; other components register theirs in :data:`CHECKERS`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

REL_TOL = 1e-5
ClusterFactory = Callable[[int], object]  # n -> a live LocalCluster of n ranks


class VectorSetError(ValueError):
    """The folder is not a vector set this library can check."""


def read_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise VectorSetError(f"{directory}: no config.json (not a reference vector set)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VectorSetError(f"{path}: unreadable ({e})") from None


def detect_kind(config: dict) -> str:
    """The component a vector set's config describes: ``"nadit"``, ``"vae"`` or ``"pipeline"``."""
    model = str(config.get("model", ""))
    if "NaDiT" in model or config.get("block_type") == "mmdit_sr":
        return "nadit"
    if "VAE" in model or "latent_channels" in config:
        return "vae"
    if "transform" in config or "colorfix_source" in config:
        return "pipeline"
    raise VectorSetError(f"cannot tell which component this vector set is for (model {model!r})")


# -- NaDiT --------------------------------------------------------------------


def nadit_config(config: dict, name: str = "vectors"):
    """The :class:`~.nadit.NaDiTConfig` a NaDiT vector set's ``config.json`` describes (3B or 7B family)."""
    from .nadit.config import NaDiTConfig

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
    from safetensors.torch import load_file

    from .nadit import NaDiT, load_checkpoint

    cfg = nadit_config(read_config(directory), Path(directory).name)
    model = NaDiT(cfg).eval()
    load_checkpoint(model, Path(directory) / "weights.safetensors")  # strict, reference key names
    io = load_file(Path(directory) / "io.safetensors")
    missing = [k for k in ("vid_in", "txt_in", "timestep", "vid_out") if k not in io]
    if missing:
        raise VectorSetError(f"{directory}/io.safetensors lacks {missing}")
    return cfg, model, io


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def _nadit_rank(ctx, directory: str, planner: str) -> tuple[float, str, str]:
    """One rank of a window-SP run: (relative error, output digest, runtime report)."""
    from ...config import ParallelConfig
    from .parallelize import parallelize

    cfg, model, io = _load_nadit(directory)
    rt = parallelize(cfg, ParallelConfig.window(ctx.world_size, window_planner=planner, window_path="window"),
                     model.grid_of(io["vid_in"].shape), ctx.group)
    out = model(io["vid_in"], io["txt_in"], io["timestep"], runtime=rt)
    return rel_err(out.reshape(io["vid_out"].shape), io["vid_out"]), _digest(out), rt.report(heads=cfg.heads)


@torch.no_grad()
def check_nadit(directory: str | os.PathLike, degrees: Sequence[int] = (1, 2, 3),
                cluster_factory: ClusterFactory | None = None, planner: str = "lpt") -> dict:
    """Run a NaDiT vector set on one device and under window-aligned SP at each of ``degrees``."""
    from ...distributed.launcher import LocalCluster

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
            out = model(io["vid_in"], io["txt_in"], io["timestep"], states=states)
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


CHECKERS: dict[str, Callable[..., dict]] = {"nadit": check_nadit}


def estimate_bytes(directory: str | os.PathLike) -> int:
    """Bytes one process needs to check the set: the model ``config.json`` describes (built on the meta
    device, so nothing is allocated) twice (the model and the file's tensors while loading), plus the io file."""
    directory = os.fspath(directory)
    kind = detect_kind(read_config(directory))
    with torch.device("meta"):
        if kind == "nadit":
            from .nadit import NaDiT

            model = NaDiT(nadit_config(read_config(directory), Path(directory).name))
        elif kind == "vae":
            from .vae.config import VaeConfig
            from .vae.model import VideoVAE

            try:
                model = VideoVAE(VaeConfig.from_json(Path(directory) / "config.json"))
            except (KeyError, TypeError, ValueError) as e:
                raise VectorSetError(f"{directory}: config.json does not describe a VAE "
                                     f"({type(e).__name__}: {e})") from None
        else:
            model = None
    params = sum(p.numel() * 4 for p in model.parameters()) if model is not None else 0
    files = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    return 2 * params + files


def verify_vectors(directory: str | os.PathLike, degrees: Sequence[int] = (1, 2, 3),
                   cluster_factory: ClusterFactory | None = None) -> dict:
    """Check the reference vector set in ``directory`` at each SP degree (1: one device).

    ``cluster_factory(n)``, when given, supplies a live LocalCluster of n ranks
    (e.g. a test's pool); otherwise one is started and closed per degree.
    Returns ``{"kind", "dir", "threshold", "runs": [{"degree", "path", "rel_err",
    "ranks_agree", "pass", ...}], "pass", ...}``.
    """
    kind = detect_kind(read_config(directory))
    if kind not in CHECKERS:
        raise VectorSetError(f"{directory}: no checker for {kind} vector sets yet (have: {', '.join(sorted(CHECKERS))})")
    return CHECKERS[kind](directory, degrees, cluster_factory)


def format_verify(result: dict) -> str:
    """The text report of :func:`verify_vectors`'s result."""
    head = f"{result['kind']} vectors {result['dir']}"
    if "model" in result:
        m = result["model"]
        head += (f": {m['variant']} family, dim {m['vid_dim']}, {m['heads']}x{m['head_dim']} heads, "
                 f"{m['layers']} layers, grid {'x'.join(map(str, result.get('grid', [])))}")
    lines = [head, f"  bar: max|port - ref| <= {result['threshold']:g} x max|ref| ({result.get('ref_max_abs', 0):.4g})"]
    for r in result["runs"]:
        extra = "" if r["ranks_agree"] else ", ranks disagree"
        if "first_divergence" in r:
            extra += f", first divergence at {r['first_divergence']}"
        lines.append(f"  SP={r['degree']}: rel err {r['rel_err']:.2e}  {'PASS' if r['pass'] else 'FAIL'}  "
                     f"({r['path']}{extra})")
    lines.append("PASS" if result["pass"] else "FAIL")
    return "\n".join(lines)


# -- VAE ----------------------------------------------------------------------


def _load_vae(directory: str):
    """(model, io) of a VAE vector set; weights rebuilt by the seeded recipe when the set ships none."""
    from safetensors.torch import load_file

    from .vae.checkpoint import load_checkpoint
    from .vae.config import VaeConfig
    from .vae.fixtures import seeded_vae

    cfg_json = read_config(directory)
    try:
        cfg = VaeConfig.from_json(Path(directory) / "config.json")
    except (KeyError, TypeError, ValueError) as e:
        raise VectorSetError(f"{directory}: config.json does not describe a VAE ({type(e).__name__}: {e})") from None
    weights = Path(directory) / "weights.safetensors"
    if weights.is_file():
        from .vae.model import VideoVAE

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
    from ...distributed.comm import Comm
    from .vae.sharded import ParallelVAE

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
    from ...distributed.launcher import LocalCluster

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


# -- pipeline arithmetic --------------------------------------------------------


def check_pipeline(directory: str | os.PathLike, degrees: Sequence[int] = (1,),
                   cluster_factory: ClusterFactory | None = None) -> dict:
    """Check a pipeline-arithmetic vector set (transform, padding, condition, sampler, decoder latent,
    colour fix, uint8) at the tolerances its README states: resize 1e-5, transform 2e-5, colour fix
    1e-6 (absolute), everything else exact. Nothing here depends on the SP degree: one run is reported,
    and its ``rel_err`` is the worst error as a fraction of that check's tolerance (an exact check
    that differs counts as infinity), so the bar is 1."""
    from safetensors.torch import load_file

    from .pipeline import color_fix as cf
    from .pipeline import condition as cond
    from .pipeline.padding import reference_pad
    from .pipeline.transform import area_resize, to_uint8, to_uint8_values, transform_frames

    directory = os.fspath(directory)
    config = read_config(directory)
    io = load_file(str(Path(directory) / "io.safetensors"))
    errs: dict[str, float] = {}

    def close(name, a, b, tol):
        if tuple(a.shape) != tuple(b.shape):
            errs[name] = float("inf")
            return
        e = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        errs[name] = e / tol

    def exact(name, ok):
        errs[name] = 0.0 if ok else float("inf")

    for case in config.get("transform", {}).get("cases", []):
        n = case["name"]
        x = io[f"{n}.in_u8"]
        close(f"{n}.resized", area_resize(x.float() / 255.0, case["res_h"], case["res_w"]), io[f"{n}.resized"], 1e-5)
        close(f"{n}.out", transform_frames(x, case["res_h"], case["res_w"]), io[f"{n}.out"], 2e-5)
    for sp in (1, 2, 4):
        if f"pad.out_sp{sp}" in io:
            exact(f"pad.out_sp{sp}", torch.equal(reference_pad(io["pad.in"], sp), io[f"pad.out_sp{sp}"]))
    for case in config.get("condition", {}).get("cases", []):
        n = case["name"]
        latent, noise, v = io[f"{n}.latent"], io[f"{n}.noise"], io[f"{n}.v"]
        got_noise, got_aug = cond.draw_noises(latent, case["seed"])
        exact(f"{n}.noise", torch.equal(got_noise, noise) and torch.equal(got_aug, io[f"{n}.aug_noise"]))
        scale = 0.1 if "inference_seedvr_" in case["script"] else cond.SEEDVR2_COND_NOISE_SCALE
        c = cond.augment_condition(latent, io[f"{n}.aug_noise"], scale)
        exact(f"{n}.dit_vid_in", torch.equal(cond.dit_input(noise, c), io[f"{n}.dit_vid_in"]))
        x0 = cond.one_step_x0(noise, v)
        exact(f"{n}.x0", torch.equal(x0, io[f"{n}.x0"]))
        exact(f"{n}.vae_decode_in", torch.equal(cond.decoder_latent(x0).float(), io[f"{n}.vae_decode_in"]))
    if "euler4.x_T" in io:
        calls = iter(range(4))
        x0 = cond.euler_sample(io["euler4.x_T"], lambda x, t: io["euler4.v"][next(calls)], steps=4)
        exact("euler4.x0", torch.equal(x0, io["euler4.x0"]))
    for n in ("cf0", "cf1"):
        if f"{n}.content" in io:
            content, style = io[f"{n}.content"], io[f"{n}.style"]
            close(f"{n}.wavelet", cf.apply_color_fix(content, style, "wavelet"), io[f"{n}.wavelet"], 1e-6)
            close(f"{n}.wavelet_bf16content", cf.apply_color_fix(content.bfloat16(), style, "wavelet"),
                  io[f"{n}.wavelet_bf16content"], 1e-6)
            close(f"{n}.adain", cf.apply_color_fix(content, style, "adain"), io[f"{n}.adain"], 1e-6)
    if "u8.in" in io:
        exact("u8.out", torch.equal(to_uint8_values(io["u8.in"]), io["u8.out"]))
    if "post.decoded" in io:
        ori = io["post.u8_fp32decoded"].shape[0]
        decoded = io["post.decoded"][:ori]
        style = io["post.input_CTHW"].permute(1, 0, 2, 3)
        exact("post.u8_fp32decoded", torch.equal(to_uint8(cf.apply_color_fix(decoded, style)), io["post.u8_fp32decoded"]))
    if not errs:
        raise VectorSetError(f"{directory}: no pipeline vectors found in io.safetensors")
    worst = max(errs, key=errs.get)
    run = {"degree": 1, "path": f"pipeline arithmetic, {len(errs)} checks", "rel_err": errs[worst],
           "ranks_agree": True, "errors": errs}
    run["pass"] = errs[worst] <= 1.0
    if not run["pass"]:
        run["first_divergence"] = worst
    return {"kind": "pipeline", "dir": directory, "threshold": 1.0, "ref_max_abs": 1.0, "runs": [run],
            "pass": run["pass"]}


CHECKERS["vae"] = check_vae
CHECKERS["pipeline"] = check_pipeline
