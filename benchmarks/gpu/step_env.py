"""Step 1: what the run ran on (versions) and its two ceilings, measured here: the bf16 matmul rate and
the device-to-device copy bandwidth (bytes read plus bytes written). Later steps compare against them."""

from __future__ import annotations

import importlib.util
import platform
import subprocess

import torch

from .measure import timed

TITLE = "environment and ceilings"
OPTIONAL = ("av", "gguf", "fastapi", "diffusers", "flash_attn", "triton")


def _present(name: str) -> str:
    try:
        return "present" if importlib.util.find_spec(name) is not None else "absent"
    except (ImportError, ValueError):
        return "absent"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _quiet(fn):
    """``fn()``, or what it raised as text: a version that cannot be read is no reason to stop the run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def run(ctx) -> None:
    dev = ctx.device
    v = {"python": platform.python_version(), "torch": torch.__version__, "cpu_cores": __import__("os").cpu_count()}
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(dev)
        nccl = _quiet(torch.cuda.nccl.version)
        v.update(gpu=prop.name, capability=f"{prop.major}.{prop.minor}", sms=prop.multi_processor_count,
                 memory_gib=round(prop.total_memory / 2**30, 1), driver=_driver(), cuda=torch.version.cuda,
                 cudnn=_quiet(torch.backends.cudnn.version),
                 nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    ctx.report.run(versions=v, packages={n: _present(n) for n in OPTIONAL})
    n, nbytes = ctx.profile.matmul_n, ctx.profile.copy_mib << 20
    g = torch.Generator(dev).manual_seed(0)
    t = _matmul_s(n, dev, g)
    tflops = 2 * n**3 / t / 1e12
    ctx.row("bf16 matmul", shape=f"{n}x{n}x{n}", ms=round(t * 1e3, 3), tflops=round(tflops, 1))
    t = _copy_s(nbytes, dev, g)
    gbps = 2 * nbytes / t / 1e9
    ctx.row("device copy", bytes=nbytes, ms=round(t * 1e3, 3), gbps=round(gbps, 1))
    ctx.report.run(ceilings={"bf16_matmul_tflops": round(tflops, 1), "copy_gbps": round(gbps, 1)})


def _matmul_s(n: int, dev, g) -> float:
    """One (n, n) @ (n, n) bf16 product: random operands (zeros run faster), the median of 10 after 3."""
    a = torch.randn(n, n, device=dev, generator=g, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, generator=g, dtype=torch.bfloat16)
    return timed(lambda: a @ b, dev, reps=10, warmup=3)[0]


def _copy_s(nbytes: int, dev, g) -> float:
    """One device-to-device copy of ``nbytes`` (random bf16), the median of 10 after 3."""
    x = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16).normal_(generator=g)
    y = torch.empty_like(x)
    return timed(lambda: y.copy_(x), dev, reps=10, warmup=3)[0]
