"""`ditsp bench determinism`: the cost of fixed-shape kernel calls against plain ones, one device.

    ditsp bench determinism [--cases dit-3b,dit-7b,vae,vae-128] [--dtypes fp32,bf16] [--repeats 3]

For each case (released widths; the DiTs with 2 layers) and dtype, both kernel-shape policies
(:mod:`ditsp.fixed_shape`) run on the same model and input in one process, interleaved repeat by
repeat in alternating order after one warm-up each. Reported per arm: the median process CPU
time (steadier than wall time on a shared machine), the peak memory the call adds (RSS high-water
mark, with large allocations served by mmap so it follows the tensors), and the median of the
per-repeat paired ratios deterministic / fast; plus the max abs difference between the arms.
One compute thread. Writes ``determinism.md`` (and ``.json``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..argtypes import positive_int
from ..fixed_shape import DETERMINISTIC, FAST, KernelShapes, use
from ..memory import PeakMemory, exact_cpu_peaks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# case -> (what, input size): latent (T, H, W) for the DiTs, clip (T, H, W) for the VAE.
CASES = {
    "dit-3b": ("SeedVR2 3B NaDiT, 2 layers, latent 5x64x64 (5120 tokens)", (5, 64, 64)),
    "dit-7b": ("SeedVR2 7B NaDiT, 2 layers, latent 5x64x64 (5120 tokens)", (5, 64, 64)),
    "vae": ("SeedVR2 VAE (released widths), encode + decode of a 5x64x64 clip", (5, 64, 64)),
    "vae-128": ("SeedVR2 VAE (released widths), encode + decode of a 5x128x128 clip", (5, 128, 128)),
}


def _dit(case: str, dtype: torch.dtype):
    from ..models.seedvr2.nadit.model import build_model, random_inputs
    from ..models.seedvr2.parallelize import single_runtime

    model = build_model("seedvr2-3b" if case == "dit-3b" else "seedvr2-7b", num_layers=2, dtype=dtype)
    vid, txt = random_inputs(model.cfg, model.grid_of(CASES[case][1]), txt_len=64)
    rts = {}

    def call(shapes: KernelShapes):
        if shapes not in rts:
            rts[shapes] = single_runtime(model.cfg, model.grid_of(vid.shape))
            rts[shapes].kernel_shapes = shapes
        return model(vid, txt, 1000.0, runtime=rts[shapes])

    return call


def _vae(case: str, dtype: torch.dtype):
    from ..models.seedvr2.vae import RELEASED
    from ..models.seedvr2.vae.fixtures import seeded_vae
    from ..models.seedvr2.vae.sharded import ParallelVAE

    pv = ParallelVAE(seeded_vae(RELEASED).to(dtype))
    T, H, W = CASES[case][1]
    x = (torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dtype)

    def call(shapes: KernelShapes):
        with use(shapes):
            return pv.decode(pv.encode(x, mode="replicated").posterior.mean, mode="replicated")

    return call


@torch.no_grad()
def measure(case: str, dtype: str, repeats: int) -> dict:
    call = _vae(case, DTYPES[dtype]) if case.startswith("vae") else _dit(case, DTYPES[dtype])
    arms = {"fast": FAST, "deterministic": DETERMINISTIC}
    times = {a: [] for a in arms}
    peaks = {a: 0 for a in arms}
    outs = {}
    meter = PeakMemory(torch.device("cpu"))
    for i in range(repeats + 1):
        order = list(arms) if i % 2 else list(reversed(arms))
        for arm in order:
            meter.start()
            t0 = time.process_time()
            outs[arm] = call(arms[arm]).float()
            dt = time.process_time() - t0
            peaks[arm] = max(peaks[arm], meter.peak_added())
            if i:  # the first round warms up
                times[arm].append(dt)
    ratios = [d / f for d, f in zip(times["deterministic"], times["fast"])]
    return {"case": case, "dtype": dtype, "what": CASES[case][0],
            "fast_s": statistics.median(times["fast"]), "deterministic_s": statistics.median(times["deterministic"]),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "fast_peak": peaks["fast"], "deterministic_peak": peaks["deterministic"],
            "max_abs_diff": (outs["deterministic"] - outs["fast"]).abs().max().item(),
            "scale": outs["fast"].abs().max().item()}


def format_md(rows: list[dict], repeats: int) -> str:
    cap = [line.strip() for line in torch.__config__.show().splitlines() if "CPU capability" in line]
    lines = ["# Determinism: fixed-shape kernel calls vs plain calls (one device)", "",
             f"`ditsp bench determinism`: one thread, {repeats} interleaved repeats after a warm-up; "
             f"time = median process CPU time; ratio = median of per-repeat deterministic/fast; "
             f"peak = RSS growth during the call. {cap[0] if cap else ''}", "",
             "| case | dtype | fast s | deterministic s | ratio | fast peak MiB | deterministic peak MiB "
             "| max abs diff (rel) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['dtype']} | {r['fast_s']:.2f} | {r['deterministic_s']:.2f} | {r['ratio']:.3f} "
                     f"| {r['fast_peak'] / 2**20:.0f} | {r['deterministic_peak'] / 2**20:.0f} "
                     f"| {r['max_abs_diff']:.2g} ({r['max_abs_diff'] / max(r['scale'], 1e-30):.1g}) |")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("determinism", help="cost of fixed-shape (deterministic) kernel calls vs plain calls")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--out", default="benchmarks/results", help="folder for determinism.md/.json")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, parser=None) -> int:
    cases, dtypes = args.cases.split(","), args.dtypes.split(",")
    for name, valid in ((cases, CASES), (dtypes, DTYPES)):
        bad = [c for c in name if c not in valid]
        if bad:
            raise SystemExit(f"ditsp bench determinism: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    torch.set_num_threads(1)
    exact_cpu_peaks()
    rows = []
    for case in cases:
        for dtype in dtypes:
            rows.append(measure(case, dtype, args.repeats))
            print(format_md(rows[-1:], args.repeats).splitlines()[-1], flush=True)
    text = format_md(rows, args.repeats)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "determinism.md").write_text(text)
    (out / "determinism.json").write_text(json.dumps(rows, indent=1))
    return 0
