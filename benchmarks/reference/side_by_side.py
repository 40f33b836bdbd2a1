#!/usr/bin/env python
"""Side-by-side CPU benchmark: ditsp's SeedVR2 DiT and VAE against the SeedVR reference code itself.

A standalone script (not part of the ``ditsp`` package, never imported by the tests). Setup and
usage: ``benchmarks/reference/README.md``.

Both sides run the same seeded weights. ``prepare`` builds the reference's own modules in the
reference's Python environment (the 3B DiT at released widths with ``--layers`` blocks, the VAE at
released widths), seeds their parameters and saves their state dicts under the reference's key
names; ditsp reads those files through its own checkpoint loaders. Inputs (DiT latent and text as
``ditsp.models.seedvr2.nadit.model.random_inputs`` makes them, VAE clips and latents) are written
once and read by both sides.

Every measurement is one fresh process, pinned to one core (``taskset -c``) with one torch thread:
build, one warm-up call, then timed calls; it reports process CPU time (user + sys) and wall time
per call and the process's peak RSS. Per repetition the sides of a case run one after another, the
order rotated by repetition. ditsp runs as its users run it: under ``ditsp.fixed_shape.FAST`` and
with the environment ``ditsp.cpu.malloc.rank_environment()`` gives (the default
allocator policy); a third side, ``ditsp-system``, runs ditsp with the plain system allocator. The
reference runs with the default environment.

Each finished process appends one JSON line to ``<work>/runs.jsonl``; a rerun skips what is there,
so an interrupted run resumes. ``report`` (also run at the end of ``run``) writes the markdown table
and the JSON of all runs.

Reference-side adaptations, all in this folder (the reference checkout is left untouched):
``shim/flash_attn.py`` (varlen attention as one SDPA call per segment) and ``shim/apex`` (the fused
RMS/layer norms as torch's own). In fp32 runs the reference's cast of q/k/v to bf16 before
attention is suspended for the forward (``Tensor.bfloat16`` is the identity inside it), so both
sides compute attention in fp32; in bf16 runs it is left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
REPO = HERE.parent.parent
DEFAULT_WORK = Path("/work/refbench/work")
DEFAULT_REF_REPO = Path("/work/refbench/SeedVR")
DEFAULT_REF_PYTHON = Path("/work/refbench/.venv/bin/python")
REFERENCE_COMMIT = "673b56374c2adb21b7628b90df3829d457a52bbb"

TXT_LEN = 58  # the released positive text embedding's length (ditsp's 3B preset default)
TIMESTEP = 1000.0  # SeedVR2's single step


# ----------------------------------------------------------------------------------------------
# cases


def _case(name, model, op, shape, dtype, reps, calls, sides):
    return {"name": name, "model": model, "op": op, "shape": list(shape), "dtype": dtype, "reps": reps,
            "calls": calls, "sides": sides}


def all_cases(include_optional: bool) -> list[dict]:
    two, three = ["ref", "ditsp"], ["ref", "ditsp", "ditsp-system"]
    cases = []
    for dtype in ("fp32", "bf16"):
        for shape, reps, calls in (((5, 32, 32), 3, 2), ((5, 64, 64), 2, 1)):
            sides = three if dtype == "bf16" else two
            cases.append(_case(f"dit {'x'.join(map(str, shape))} {dtype}", "dit", "forward", shape, dtype, reps,
                               calls, sides))
    for dtype in ("fp32", "bf16"):
        for shape, reps, calls in (((9, 128, 128), 3, 1), ((17, 128, 128), 2, 1)):
            for op in ("encode", "decode"):
                sides = three if (dtype == "bf16" or shape[0] == 9) else two
                cases.append(_case(f"vae {op} {'x'.join(map(str, shape))} {dtype}", "vae", op, shape, dtype, reps,
                                   calls, sides))
    if include_optional:
        for dtype in ("fp32", "bf16"):
            for op in ("encode", "decode"):
                cases.append(_case(f"vae {op} 17x256x256 {dtype}", "vae", op, (17, 256, 256), dtype, 2, 1, two))
    return cases


def _tag(shape) -> str:
    return "x".join(map(str, shape))


# ----------------------------------------------------------------------------------------------
# the reference side (imports nothing from ditsp)


def _reference_paths(ref_repo: Path) -> None:
    for p in (str(ref_repo), str(SHIM)):
        if p not in sys.path:
            sys.path.insert(0, p)


def reference_dit_kwargs(layers: int) -> dict:
    """The 3B constructor arguments of the reference's ``configs_3b/main.yaml`` with ``layers`` blocks."""
    dim = 2560
    return dict(
        vid_in_channels=33, vid_out_channels=16, vid_dim=dim, vid_out_norm="fusedrms", txt_in_dim=5120,
        txt_in_norm="fusedln", txt_dim=dim, emb_dim=6 * dim, heads=20, head_dim=128, expand_ratio=4,
        norm="fusedrms", norm_eps=1e-5, ada="single", qk_bias=False, qk_norm="fusedrms", patch_size=[1, 2, 2],
        num_layers=layers, mm_layers=10, mlp_type="swiglu", msa_type="None", block_type=["mmdit_sr"] * layers,
        window=[(4, 3, 3)] * layers,
        window_method=["720pwin_by_size_bysize", "720pswin_by_size_bysize"] * (layers // 2)
        + ["720pwin_by_size_bysize"] * (layers % 2),
        rope_type="mmrope3d", rope_dim=128,
    )


def reference_vae(ref_repo: Path):
    from omegaconf import OmegaConf

    from models.video_vae_v3.modules.attn_video_vae import VideoAutoencoderKLWrapper

    cfg = OmegaConf.to_container(OmegaConf.load(ref_repo / "models/video_vae_v3/s8_c16_t4_inflation_sd3.yaml"))
    cfg.pop("__object__")
    return VideoAutoencoderKLWrapper(**cfg, freeze_encoder=False)


def _init_single_process_group(work: Path) -> None:
    """The reference VAE's sliced causal convs ask torch.distributed for ranks: a one-rank gloo group."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="refbench-store-", dir=str(work))
        os.close(fd)
        os.unlink(store)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _seed_(module, seed: int, kind: str) -> None:
    """Seeded parameters, in registration order, from a private generator (buffers are left as built).

    DiT: ``0.05 randn``; RMSNorm weights and AdaSingle scales and gates ``1 + 0.05 randn``.
    VAE: conv kernels ``randn / sqrt(fan_in)``, linear weights ``randn / sqrt(in)`` (twice that for the
    attention's q and k), biases ``0.1 randn``, norm weights ``1 + 0.2 randn``.
    """
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if kind == "dit":
                unit = name.endswith(("_scale", "_gate")) or "norm" in name
                p.copy_(1.0 + 0.05 * r if unit else 0.05 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.dim() >= 3:
                p.copy_(r / math.sqrt(p[0].numel()))
            elif p.dim() == 2:
                gain = 2.0 if (".to_q." in name or ".to_k." in name) else 1.0
                p.copy_(r / math.sqrt(p.shape[1]) * gain)
            else:
                p.copy_(1.0 + 0.2 * r)


def prepare_reference(args) -> None:
    """In the reference's environment: build, seed and save the reference's DiT and VAE state dicts."""
    import torch

    _reference_paths(args.ref_repo)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    dit_path, vae_path = work / f"dit-3b-{args.layers}l.pth", work / "vae.pth"
    if not dit_path.exists():
        from models.dit_v2.nadit import NaDiT

        model = NaDiT(**reference_dit_kwargs(args.layers))
        _seed_(model, 0, "dit")
        torch.save(model.state_dict(), str(dit_path) + ".tmp")
        os.replace(str(dit_path) + ".tmp", dit_path)
        print(f"wrote {dit_path} ({len(model.state_dict())} tensors, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters)")
        del model
    if not vae_path.exists():
        vae = reference_vae(args.ref_repo)
        _seed_(vae, 1234, "vae")
        torch.save(vae.state_dict(), str(vae_path) + ".tmp")
        os.replace(str(vae_path) + ".tmp", vae_path)
        print(f"wrote {vae_path} ({len(vae.state_dict())} tensors, "
              f"{sum(p.numel() for p in vae.parameters()):,} parameters)")


@contextlib.contextmanager
def _attention_in_input_dtype(enabled: bool):
    """Inside the block ``Tensor.bfloat16()`` returns the tensor unchanged (the reference's only use of it
    in the DiT forward is the cast of q/k/v before attention)."""
    import torch

    if not enabled:
        yield
        return
    original = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


def build_reference(case: dict, args):
    import torch

    _reference_paths(args.ref_repo)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    if case["model"] == "dit":
        from models.dit_v2.nadit import NaDiT

        sd = torch.load(args.work / f"dit-3b-{args.layers}l.pth", map_location="cpu", mmap=True)
        model = NaDiT(**reference_dit_kwargs(args.layers))
        model.load_state_dict(sd, strict=True)
        model = model.to(dtype).eval().requires_grad_(False)
        # The released checkpoint is fp32 and the reference keeps its RoPE frequency buffers in fp32
        # (it runs bf16 through autocast, which leaves buffers alone): keep them fp32 here too.
        for name, m in model.named_modules():
            if name.endswith("rope.rope"):
                m.freqs = sd[name + ".freqs"].float().clone()
        inp = torch.load(args.work / f"dit-in-{_tag(case['shape'])}.pt")
        vid, txt = inp["vid"].to(dtype), inp["txt"].to(dtype)
        T, H, W, C = vid.shape
        vid_flat, vid_shape = vid.reshape(-1, C), torch.tensor([[T, H, W]])
        txt_shape = torch.tensor([[txt.shape[0]]])
        t = torch.tensor([TIMESTEP])
        fp32_attn = case["dtype"] == "fp32"

        def call():
            with torch.no_grad(), _attention_in_input_dtype(fp32_attn):
                out = model(vid_flat, txt, vid_shape, txt_shape, t).vid_sample
            return out.reshape(T, H, W, -1)

        return call
    _init_single_process_group(args.work)
    vae = reference_vae(args.ref_repo)
    vae.load_state_dict(torch.load(args.work / "vae.pth", map_location="cpu"), strict=True)
    vae = vae.to(dtype).eval().requires_grad_(False)
    # as the reference's 3B/7B inference sets it up (configs_*/main.yaml, vae: slicing, memory_limit)
    vae.set_causal_slicing(split_size=4, memory_device="same")
    vae.set_memory_limit(conv_max_mem=0.5, norm_max_mem=0.5)
    if case["op"] == "encode":
        x = torch.load(args.work / f"vae-clip-{_tag(case['shape'])}.pt").to(dtype)

        def call():
            with torch.no_grad():
                return vae.encode(x).posterior.mean
    else:
        z = torch.load(args.work / f"vae-latent-{_tag(case['shape'])}.pt").to(dtype)

        def call():
            with torch.no_grad():
                return vae.decode(z).sample
    return call


# ----------------------------------------------------------------------------------------------
# the ditsp side


def prepare_inputs(args) -> None:
    """In ditsp's environment: the DiT inputs (``random_inputs``), VAE clips and latents, for every case."""
    import torch

    from ditsp.models.seedvr2.nadit.config import get_config
    from ditsp.models.seedvr2.nadit.model import random_inputs

    cfg = get_config("seedvr2-3b", args.layers)
    for case in all_cases(True):
        tag = _tag(case["shape"])
        if case["model"] == "dit":
            path = args.work / f"dit-in-{tag}.pt"
            if not path.exists():
                T, H, W = case["shape"]
                grid = (T // cfg.patch_size[0], H // cfg.patch_size[1], W // cfg.patch_size[2])
                vid, txt = random_inputs(cfg, grid, seed=1)
                assert txt.shape[0] == TXT_LEN
                torch.save({"vid": vid, "txt": txt}, path)
        else:
            T, H, W = case["shape"]
            clip, latent = args.work / f"vae-clip-{tag}.pt", args.work / f"vae-latent-{tag}.pt"
            if not clip.exists():
                g = torch.Generator().manual_seed(0)
                torch.save(torch.rand(1, 3, T, H, W, generator=g) * 2 - 1, clip)
            if not latent.exists():
                g = torch.Generator().manual_seed(2)
                torch.save(torch.randn(1, 16, (T - 1) // 4 + 1, H // 8, W // 8, generator=g), latent)


def build_ditsp(case: dict, args):
    import torch

    from ditsp.fixed_shape import FAST, use

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    if case["model"] == "dit":
        from ditsp.models.seedvr2.nadit.model import build_model
        from ditsp.models.seedvr2.parallelize import single_runtime

        model = build_model("seedvr2-3b", args.layers, checkpoint=str(args.work / f"dit-3b-{args.layers}l.pth"),
                            dtype=dtype)
        inp = torch.load(args.work / f"dit-in-{_tag(case['shape'])}.pt")
        vid, txt = inp["vid"].to(dtype), inp["txt"].to(dtype)

        def call():
            with torch.no_grad(), use(FAST):
                return model(vid, txt, TIMESTEP, runtime=single_runtime(model.cfg, model.grid_of(vid.shape)))

        return call
    from ditsp.models.seedvr2.vae import RELEASED, VideoVAE, load_checkpoint
    from ditsp.models.seedvr2.vae.sharded import ParallelVAE

    with torch.device("meta"):
        vae = VideoVAE(RELEASED)
    load_checkpoint(vae, str(args.work / "vae.pth"), dtype=dtype)
    vae = vae.eval().requires_grad_(False)
    pv = ParallelVAE(vae, None)
    if case["op"] == "encode":
        x = torch.load(args.work / f"vae-clip-{_tag(case['shape'])}.pt").to(dtype)

        def call():
            with torch.no_grad(), use(FAST):
                return pv.encode(x, mode="chunked").posterior.mean
    else:
        z = torch.load(args.work / f"vae-latent-{_tag(case['shape'])}.pt").to(dtype)

        def call():
            with torch.no_grad(), use(FAST):
                return pv.decode(z, mode="chunked")
    return call


# ----------------------------------------------------------------------------------------------
# one measurement (a fresh process)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the calls' peak is read apart from the build's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    case = json.loads(args.case_json)
    t0 = time.perf_counter()
    call = (build_reference if args.side == "ref" else build_ditsp)(case, args)
    build_s = time.perf_counter() - t0
    rss_built = _peak_rss_mib()
    reset = _reset_peak_rss()
    w0, c0 = time.perf_counter(), _cpu_s()
    call()
    warm = [time.perf_counter() - w0, _cpu_s() - c0]
    calls = []
    out = None
    for _ in range(case["calls"]):
        w0, c0 = time.perf_counter(), _cpu_s()
        out = call()
        calls.append([time.perf_counter() - w0, _cpu_s() - c0])
    peak = _peak_rss_mib()
    peak_calls = _vm_hwm_mib() if reset else peak
    profile = None
    if args.profile:
        profile = _profile(call, args.top)
        profile["peak_gemm_gflops_per_s"] = round(peak_gemm_rate(case["dtype"]), 1)
    if args.save:
        torch.save(out.detach().float().contiguous(), args.save)
    print("RESULT " + json.dumps({"build_s": build_s, "warmup": warm, "calls": calls, "peak_rss_mib": peak,
                                  "peak_rss_calls_mib": peak_calls,
                                  "rss_after_build_mib": rss_built, "torch": torch.__version__,
                                  "threads": torch.get_num_threads(), "profile": profile}))


# The ops whose self time is a GEMM, convolution or attention kernel (oneDNN, MKL or torch's flash
# attention): the arithmetic both sides must do. Everything else is layout, norms, transforms and glue.
KERNEL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
              "aten::mkldnn_convolution", "aten::_scaled_dot_product_flash_attention_for_cpu")


def _gemm_flops(key: str, shapes: list) -> int:
    """Multiply-add FLOPs of one mm/addmm call from its recorded input shapes (0 for other ops)."""
    try:
        if key == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
        elif key == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
        else:
            return 0
    except (ValueError, IndexError, TypeError):
        return 0
    return 2 * m * k * n


def _profile(fn, top: int, calls: int = 2) -> dict:
    """``calls`` warm calls, each under torch.profiler; of the one with the least self CPU time: the top
    ops, the time in :data:`KERNEL_OPS` against the rest, and the plain GEMMs' (mm/addmm) rate from their
    recorded shapes. (A kernel's time includes the page faults of its output, which vary from call to call.)"""
    from torch.profiler import ProfilerActivity, profile

    best = None
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        summary = _summarise(prof, top)
        if best is None or summary["total_ms"] < best["total_ms"]:
            best = summary
    return best


def _summarise(prof, top: int) -> dict:
    """One profiled call: top ops, kernel and total self CPU ms, the plain GEMMs' rate."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: -e.self_cpu_time_total)
    kernel_us = sum(e.self_cpu_time_total for e in events if e.key in KERNEL_OPS)
    gemm_flops = gemm_us = 0
    for e in prof.key_averages(group_by_input_shape=True):
        flops = _gemm_flops(e.key, e.input_shapes)
        if flops:
            gemm_flops += flops * e.count
            gemm_us += e.self_cpu_time_total
    return {"top": [[e.key, e.count, round(e.self_cpu_time_total / 1e3, 2),
                     round(100 * e.self_cpu_time_total / total, 1)] for e in events[:top]],
            "total_ms": round(total / 1e3, 2), "kernel_ms": round(kernel_us / 1e3, 2),
            "gemm_gflops_per_s": round(gemm_flops / gemm_us / 1e3, 1) if gemm_us else None}


def peak_gemm_rate(dtype_name: str, seconds: float = 2.0) -> float:
    """GFLOP/s of one big GEMM (4096 x 2560 @ 2560 x 6912, the DiT's MLP shape) on this thread: what
    the core's kernels reach at best, to read the profiled rates against."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4096, 2560, generator=g).to(dtype)
    w = torch.randn(6912, 2560, generator=g).to(dtype)
    torch.nn.functional.linear(a, w)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096 * 2560 * 6912 / best / 1e9


# ----------------------------------------------------------------------------------------------
# the driver


def _ditsp_env(side: str) -> dict:
    """ditsp's process environment: its allocator policy's variables (``ditsp``) or none (``ditsp-system``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DITSP_CPU_MALLOC")}
    if side == "ditsp":
        from ditsp.cpu.malloc import rank_environment

        env.update(rank_environment(env))
    else:
        env["DITSP_CPU_MALLOC"] = "system"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _side_command(side: str, case: dict, args, save: Path | None, profile: bool) -> tuple[list, dict]:
    py = str(args.ref_python if side == "ref" else args.ditsp_python)
    cmd = ["taskset", "-c", str(args.core), py, str(Path(__file__).resolve()), "worker", "--side",
           "ref" if side == "ref" else "ditsp", "--case-json", json.dumps(case), "--work", str(args.work),
           "--ref-repo", str(args.ref_repo), "--layers", str(args.layers), "--top", str(args.top)]
    if save:
        cmd += ["--save", str(save)]
    if profile:
        cmd += ["--profile"]
    if side == "ref":
        env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PYTHONPATH", "DITSP_CPU_MALLOC")}
    else:
        env = _ditsp_env(side)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return cmd, env


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _wait_for_memory(need_gib: float, limit_s: float = 900) -> None:
    t0 = time.time()
    while _mem_available_gib() < need_gib and time.time() - t0 < limit_s:
        print(f"  waiting: {_mem_available_gib():.1f} GiB available, {need_gib:.1f} GiB wanted", flush=True)
        time.sleep(20)


def _need_gib(side: str, case: dict) -> float:
    # The reference's 3B RoPE keeps a (1024, 128, 128, 126) fp32 table per block (about 7.9 GiB each).
    if side == "ref" and case["model"] == "dit":
        return 8.0 * 2 + 3.0
    return 6.0


def run_one(side: str, case: dict, rep: int, args, profile: bool = False) -> dict:
    save = args.work / "outputs" / f"{case['name'].replace(' ', '_')}--{side}.pt" if rep == 0 else None
    if save:
        save.parent.mkdir(exist_ok=True)
    cmd, env = _side_command(side, case, args, save, profile)
    _wait_for_memory(_need_gib(side, case))
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.time() - t0
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{side} {case['name']} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    res = json.loads(line[len("RESULT "):])
    res.update(case=case["name"], side=side, rep=rep, process_s=elapsed, output=str(save) if save else None,
               glibc_tunables=env.get("GLIBC_TUNABLES", ""), started=t0, kind="profile" if profile else "timing")
    return res


def _load_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _prepare(args) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    common = ["--work", str(args.work), "--ref-repo", str(args.ref_repo), "--layers", str(args.layers)]
    if not (args.work / f"dit-3b-{args.layers}l.pth").exists() or not (args.work / "vae.pth").exists():
        subprocess.run([str(args.ref_python), str(Path(__file__).resolve()), "prepare-reference", *common],
                       check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([str(args.ditsp_python), str(Path(__file__).resolve()), "prepare-inputs", *common],
                   check=True, env=env)


def run(args) -> None:
    _prepare(args)
    log = args.work / "runs.jsonl"
    done = {(r["case"], r["side"], r["rep"], r.get("kind", "timing")) for r in _load_log(log)}
    if args.profiles_only:
        _profiles(args, log, done)
        report(args)
        return
    cases = [c for c in all_cases(args.optional) if not args.only or any(s in c["name"] for s in args.only)]
    t_start = time.time()
    max_reps = max(c["reps"] for c in cases)
    if args.max_reps:
        max_reps = min(max_reps, args.max_reps)
    for rep in range(max_reps):
        for case in cases:
            if rep >= case["reps"]:
                continue
            sides = case["sides"][rep % len(case["sides"]):] + case["sides"][:rep % len(case["sides"])]
            for side in sides:
                if (case["name"], side, rep, "timing") in done:
                    continue
                res = run_one(side, case, rep, args)
                if side != "ref":
                    res["ditsp_rev"] = _git_rev()  # the code this run measured (rows may mix revisions)
                with log.open("a") as f:
                    f.write(json.dumps(res) + "\n")
                best = min(c[1] for c in res["calls"])
                print(f"[{time.time() - t_start:7.0f}s] rep {rep} {case['name']:<28} {side:<13} "
                      f"cpu {best:8.2f}s  peak {res['peak_rss_mib']:8.0f} MiB  (process {res['process_s']:.0f}s)",
                      flush=True)
        if rep == min(1, max_reps - 1):
            _profiles(args, log, done)
    report(args)


def _profiles(args, log: Path, done: set) -> None:
    """Both sides of each ``--profile-case`` under torch.profiler (fresh processes; :func:`_profile`)."""
    known = {c["name"]: c for c in all_cases(True)}
    for name in args.profile_case or ():
        if name not in known:
            raise SystemExit(f"--profile-case {name!r}: no such case (one of: {', '.join(known)})")
        case = dict(known[name], calls=1)
        for side in ("ref", "ditsp"):
            if (case["name"], side, 0, "profile") in done:
                continue
            res = run_one(side, case, -1, args, profile=True)
            res["rep"] = 0
            with log.open("a") as f:
                f.write(json.dumps(res) + "\n")
            print(f"profiled {case['name']} {side}", flush=True)


# ----------------------------------------------------------------------------------------------
# the report


def _rel(a, b) -> float:
    import torch

    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max())


def _git_rev() -> str:
    try:
        # the last commit that changed the package (the harness's own commits do not change what is measured)
        rev = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h", "--abbrev=12", "--", "ditsp"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "ditsp"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def _cpu_capability() -> str:
    import torch

    for line in torch.__config__.show().splitlines():
        if "CPU capability usage" in line:
            return line.strip()
    return "CPU capability usage: unknown"


def report(args) -> None:
    import torch

    runs = _load_log(args.work / "runs.jsonl")
    timing = [r for r in runs if r.get("kind", "timing") == "timing"]
    cases = [c for c in all_cases(True) if any(r["case"] == c["name"] for r in timing)]
    rows, out_cases = [], []
    agreement = {}
    for case in cases:
        by = {}
        for r in timing:
            if r["case"] == case["name"]:
                by.setdefault(r["side"], {})[r["rep"]] = r
        if "ref" not in by or "ditsp" not in by:
            continue

        def best(r, i):
            return min(c[i] for c in r["calls"])

        row = {"case": case["name"], "reps": sorted(set(by["ref"]) & set(by["ditsp"]))}
        for side in ("ref", "ditsp", "ditsp-system"):
            if side not in by:
                continue
            reps = sorted(by[side])
            row[side] = {"cpu_s": statistics.median(best(by[side][k], 1) for k in reps),
                         "revs": sorted({by[side][k].get("ditsp_rev", "") for k in reps} - {""}),
                         "wall_s": statistics.median(best(by[side][k], 0) for k in reps),
                         "peak_rss_mib": max(by[side][k]["peak_rss_mib"] for k in reps),
                         "rss_after_build_mib": max(by[side][k]["rss_after_build_mib"] for k in reps),
                         "reps": len(reps)}
            if side != "ref":
                paired = sorted(set(reps) & set(by["ref"]))
                row[side]["cpu_ratio"] = statistics.median(best(by[side][k], 1) / best(by["ref"][k], 1)
                                                           for k in paired)
                row[side]["wall_ratio"] = statistics.median(best(by[side][k], 0) / best(by["ref"][k], 0)
                                                            for k in paired)
                row[side]["cpu_ratios"] = [best(by[side][k], 1) / best(by["ref"][k], 1) for k in paired]
        # agreement: rep-0 outputs
        outs = {s: by[s].get(0, {}).get("output") for s in by}
        if outs.get("ref") and outs.get("ditsp") and Path(outs["ref"]).exists() and Path(outs["ditsp"]).exists():
            ref = torch.load(outs["ref"])
            row["rel_diff"] = _rel(torch.load(outs["ditsp"]), ref)
            if outs.get("ditsp-system") and Path(outs["ditsp-system"]).exists():
                row["rel_diff_system_vs_ditsp"] = _rel(torch.load(outs["ditsp-system"]), torch.load(outs["ditsp"]))
            if case["dtype"] == "bf16":
                twin = case["name"].replace("bf16", "fp32")
                ref32 = args.work / "outputs" / f"{twin.replace(' ', '_')}--ref.pt"
                if ref32.exists():
                    r32 = torch.load(ref32)
                    row["ditsp_vs_ref_fp32"] = _rel(torch.load(outs["ditsp"]), r32)
                    row["ref_vs_ref_fp32"] = _rel(ref, r32)
            agreement[case["name"]] = row.get("rel_diff")
        rows.append(row)
        out_cases.append(case)
    profiles = [r for r in runs if r.get("kind") == "profile"]
    measured_s = sum(r["process_s"] for r in runs)
    revs = sorted({r.get("ditsp_rev", "") for r in runs} - {""})
    meta = {"cpu_capability": _cpu_capability(), "ditsp_revisions": revs, "torch": torch.__version__,
            "reference": f"ByteDance-Seed/SeedVR {REFERENCE_COMMIT}", "layers": args.layers,
            "total_process_wall_s": measured_s, "runs": len(runs), "pinned_core": args.core,
            "ditsp_environment": _ditsp_env("ditsp").get("GLIBC_TUNABLES", ""), "notes": args.note or []}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reference.json").write_text(json.dumps({"meta": meta, "cases": out_cases, "summary": rows,
                                                         "runs": runs}, indent=1) + "\n")
    (args.out / "reference.md").write_text("\n".join(format_markdown(meta, rows, profiles)) + "\n")
    print((args.out / "reference.md").read_text())


def _floor_table(rows: list[dict], profiles: list[dict]) -> list[str]:
    """Where each profiled case's time goes on both sides, and the ratio ditsp could reach at best
    without changing its kernels' arithmetic: its own time in GEMM/conv/attention kernels over the
    reference's whole time, both profiled."""
    by = {(p["case"], p["side"]): p["profile"] for p in profiles if isinstance(p.get("profile"), dict)}
    lines = []
    for r in rows:
        ref, ours = by.get((r["case"], "ref")), by.get((r["case"], "ditsp"))
        if ref is None or ours is None:
            continue
        if not lines:
            lines = ["", "Where the time goes (torch.profiler, self CPU time): the share in "
                     "GEMM, convolution and attention kernels (`" + "`, `".join(KERNEL_OPS) + "`), the plain "
                     "GEMMs' rate from their recorded shapes against one big GEMM's on the same core, and the "
                     "floor: ditsp's kernel time over the reference's whole time (both profiled; of two calls, the "
                     "one with less time), the ratio ditsp would reach if everything outside its kernels took no "
                     "time. The profiler's own cost per op weighs on ditsp's many small ops (its VAE's Winograd "
                     "transforms), so its time outside kernels reads high.", "",
                     "| case | ref in kernels | ref GEMM GF/s | ditsp in kernels | ditsp outside kernels ms | "
                     "ditsp GEMM GF/s | one big GEMM GF/s | floor | CPU ratio (timed) |",
                     "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

        def rate(p):  # the DiT's: the VAE's few plain GEMMs (its attention) say nothing of its convs
            return f"{p['gemm_gflops_per_s']:.0f}" if p.get("gemm_gflops_per_s") and r["case"].startswith("dit") else ""

        floor = ours["kernel_ms"] / ref["total_ms"]
        lines.append(f"| {r['case']} | {ref['kernel_ms']:.0f} ms ({100 * ref['kernel_ms'] / ref['total_ms']:.0f}%) | "
                     f"{rate(ref)} | {ours['kernel_ms']:.0f} ms ({100 * ours['kernel_ms'] / ours['total_ms']:.0f}%) | "
                     f"{ours['total_ms'] - ours['kernel_ms']:.0f} | {rate(ours)} | "
                     f"{ours.get('peak_gemm_gflops_per_s', 0):.0f} | **{floor:.2f}** | {r['ditsp']['cpu_ratio']:.2f} |")
    return lines


def _fmt_ratio(row, side) -> str:
    if side not in row:
        return ""
    s = row[side]
    return f"**{s['cpu_ratio']:.2f}** ({', '.join(f'{x:.2f}' for x in s['cpu_ratios'])})"


def format_markdown(meta: dict, rows: list[dict], profiles: list[dict]) -> list[str]:
    lines = [
        "# ditsp vs the SeedVR reference, side by side on CPU (`benchmarks/reference/side_by_side.py`)",
        "",
        f"{meta['cpu_capability']}; torch {meta['torch']}; one thread, pinned to core {meta['pinned_core']}; "
        f"ditsp revisions {', '.join(meta['ditsp_revisions']) or 'unknown'} (per row below); reference "
        f"{meta['reference']}.",
        "",
        f"DiT: 3B widths, {meta['layers']} blocks, text length {TXT_LEN}, t = {TIMESTEP:g}; latent T x H x W "
        "(pre-patch). VAE: released widths, one device, pixel T x H x W; ditsp `ParallelVAE(vae, None)` in "
        "`chunked` mode, the reference with its inference setup (causal slicing split 4, memory limits 0.5/0.5 GiB). "
        "Encode is timed to the posterior mean, decode from a seeded latent.",
        "",
        "One fresh process per measurement: build, one warm-up call, timed calls (best per process). "
        "CPU = process user + sys seconds. Ratio columns: the median over repetitions of the paired ratio "
        "ditsp / reference of CPU seconds (the per-repetition ratios in brackets); below 1 means ditsp is "
        "faster. `ditsp` runs under `FAST` with its allocator policy "
        f"(`GLIBC_TUNABLES={meta['ditsp_environment']}`); `ditsp, system malloc` is the same without it. "
        "Peak = the process's peak RSS over the warm-up and timed calls (weights included; the kernel's "
        "high-water mark is reset after the build, whose own peak is in the JSON as `rss_after_build_mib`). "
        "rel. diff = max |ditsp - ref| / max |ref| on the "
        "same dtype.",
        "",
        "| case | ditsp rev | reps | ref CPU s | ditsp CPU s | CPU ratio ditsp/ref | wall ratio | ditsp, system "
        "malloc: CPU ratio | ref peak MiB | ditsp peak MiB | ditsp system-malloc peak MiB | rel. diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        sys_ratio = _fmt_ratio(r, "ditsp-system")
        sys_peak = f"{r['ditsp-system']['peak_rss_mib']:.0f}" if "ditsp-system" in r else ""
        diff = ("0 (bit-identical)" if r["rel_diff"] == 0 else f"{r['rel_diff']:.1e}") if "rel_diff" in r else ""
        rev = ", ".join(r["ditsp"].get("revs", [])) or "?"
        lines.append(f"| {r['case']} | {rev} | {len(r['reps'])} | {r['ref']['cpu_s']:.2f} | {r['ditsp']['cpu_s']:.2f} | "
                     f"{_fmt_ratio(r, 'ditsp')} | {r['ditsp']['wall_ratio']:.2f} | {sys_ratio} | "
                     f"{r['ref']['peak_rss_mib']:.0f} | {r['ditsp']['peak_rss_mib']:.0f} | {sys_peak} | {diff} |")
    extra = [r for r in rows if "ditsp_vs_ref_fp32" in r]
    if extra:
        lines += ["", "bf16 against the fp32 reference (max |x - ref fp32| / max |ref fp32|):", "",
                  "| case | ditsp bf16 | reference bf16 |", "| --- | ---: | ---: |"]
        lines += [f"| {r['case']} | {r['ditsp_vs_ref_fp32']:.1e} | {r['ref_vs_ref_fp32']:.1e} |" for r in extra]
    lines += _floor_table(rows, profiles)
    for p in profiles:
        if not p.get("profile"):
            continue
        top = p["profile"]["top"] if isinstance(p["profile"], dict) else p["profile"]  # older logs: the list
        lines += ["", f"Profile, {p['case']}, {p['side']}: top ops by self CPU time "
                  "(the quicker of two profiled warm calls)", "",
                  "| op | calls | self CPU ms | share |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{name}` | {n} | {ms:.1f} | {pct:.1f}% |" for name, n, ms, pct in top]
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    lines += ["", f"{meta['runs']} processes, {meta['total_process_wall_s'] / 60:.1f} minutes of process wall time."]
    return lines


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(q):
        q.add_argument("--work", type=Path, default=DEFAULT_WORK, help="weights, inputs, outputs and runs.jsonl")
        q.add_argument("--ref-repo", type=Path, default=DEFAULT_REF_REPO, help="the SeedVR reference checkout")
        q.add_argument("--layers", type=int, default=2, help="DiT blocks (3B widths)")
        q.add_argument("--top", type=int, default=15, help="ops per profile table")
        return q

    q = common(sub.add_parser("run", help="measure every case (resumable), then report"))
    q.add_argument("--ref-python", type=Path, default=DEFAULT_REF_PYTHON)
    q.add_argument("--ditsp-python", type=Path, default=Path(sys.executable))
    q.add_argument("--core", type=int, default=1, help="the core the measured processes are pinned to")
    q.add_argument("--optional", action="store_true", help="add the VAE 17x256x256 cases (fp32 and bf16)")
    q.add_argument("--max-reps", type=int, default=None, help="stop after this many repetitions")
    q.add_argument("--only", nargs="*", help="only cases whose name contains one of these strings")
    q.add_argument("--profile-case", nargs="*", default=["dit 5x64x64 bf16"],
                   help="profile these cases on both sides (none given: no profiles)")
    q.add_argument("--profiles-only", action="store_true", help="run the profiles (and the report), no timings")
    q.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    q.add_argument("--note", action="append", help="a line for the report's notes (repeatable)")
    q = common(sub.add_parser("report", help="write the table and JSON from runs.jsonl"))
    q.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    q.add_argument("--note", action="append", help="a line for the report's notes (repeatable)")
    q.add_argument("--core", type=int, default=1)
    common(sub.add_parser("prepare-reference", help="(reference env) build, seed and save the reference's weights"))
    common(sub.add_parser("prepare-inputs", help="(ditsp env) write the inputs"))
    q = common(sub.add_parser("worker", help="one measurement (internal)"))
    q.add_argument("--side", choices=["ref", "ditsp"], required=True)
    q.add_argument("--case-json", required=True)
    q.add_argument("--save", default=None)
    q.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    {"run": run, "report": report, "prepare-reference": prepare_reference, "prepare-inputs": prepare_inputs,
     "worker": worker}[args.cmd](args)


if __name__ == "__main__":
    main()
