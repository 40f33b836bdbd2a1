"""Per-rank speed: where the time goes (per-op profile), eager vs ``--compile``, one device vs SP, side by side.

Two cases at the released widths: the 3B DiT with ``--layers`` blocks on a ``--latent`` T,H,W latent,
and the VAE encode + decode of a ``--clip`` T,H,W clip. For each SP degree one group of ranks
builds the model once, compiles a second entry to the same weights (``ditsp.models.seedvr2.compiled``;
the first compiled call is the warm-up compile, timed on its own) and then runs three modes in turn,
``--repeats`` rounds in rotated order so all see the same machine: eager with float32 linears on the
BLAS (PyTorch's own route, which the SeedVR reference takes), eager on oneDNN (ditsp's default,
:mod:`ditsp.cpu.gemm`) and compiled. Times are process CPU
seconds (steadier than wall time on a shared machine; one thread per rank) and wall seconds, the
minimum over repeats, the slowest rank. The profile (``torch.profiler``, top ops by self CPU time)
is rank 0's at the first SP degree, eager and compiled. Both run under the fast kernel policy
(compile refuses fixed-shape calls). Results: ``benchmarks/results/speed.md`` and ``speed.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..argtypes import positive_int, positive_int_list
from . import declare
from ..dtypes import DTYPES


def _cpu_capability() -> str:
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


def _profile(fn, top: int) -> list[list]:
    """Top ``top`` ops of one call of ``fn`` by self CPU time: [name, self CPU ms, share %]."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [[e.key, round(e.self_cpu_time_total / 1e3, 2), round(100 * e.self_cpu_time_total / total, 1)]
            for e in events[:top]]


def _measure(fn) -> tuple[float, float, torch.Tensor]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def rank_speed(ctx, case: str, args: dict) -> dict:
    """One rank: build ``case``, compile it, run BLAS-eager, eager and compiled calls in turn; rank 0 keeps outputs."""
    from ..config import ParallelConfig
    from ..cpu.gemm import use_route
    from ..distributed.comm import Comm
    from ..fixed_shape import FAST, use
    from ..models.seedvr2.compiled import compile_dit, compile_vae, describe, stance

    torch.set_num_threads(1)
    group = ctx.group if ctx.world_size > 1 else None
    dtype = DTYPES[args["dtype"]]
    if case == "dit":
        from ..models.seedvr2.nadit.model import build_model, random_inputs
        from ..models.seedvr2.parallelize import parallelize

        model = build_model("seedvr2-3b", args["layers"], dtype=dtype)
        grid = model.grid_of(args["latent"])
        vid, txt = random_inputs(model.cfg, grid, seed=1)
        pc = ParallelConfig.window(ctx.world_size, window_planner="lpt", window_path="window", deterministic=False)
        rt = parallelize(model.cfg, pc, grid, group)

        def call():
            with torch.no_grad():
                return model(vid, txt, 1000.0, runtime=rt)

        compile_fn, module = compile_dit, model
    else:
        from ..models.seedvr2.vae import RELEASED
        from ..models.seedvr2.vae.fixtures import seeded_vae
        from ..models.seedvr2.vae.sharded import ParallelVAE

        module = seeded_vae(RELEASED).to(dtype)
        pv = ParallelVAE(module, Comm(group) if group is not None else None)
        T, H, W = args["clip"]
        x = (torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dtype)

        def call():
            with torch.no_grad():
                z = pv.encode(x).posterior.mean
                return pv.decode(z)

        compile_fn = compile_vae
    modes = ("blas", "eager", "compiled")
    times = {m: [] for m in modes}
    with use(FAST):
        with stance(False):
            call()  # warm: plans, caches, first-touch allocations
        compile_fn(module)
        with stance(True):
            warm_wall, warm_cpu, _ = _measure(call)
        outs = {}
        for r in range(args["repeats"]):
            for mode in modes[r % 3:] + modes[:r % 3]:
                with stance(mode == "compiled"), use_route("blas" if mode == "blas" else "onednn"):
                    wall, cpu, outs[mode] = _measure(call)
                times[mode].append((wall, cpu))
        prof = None
        if args["profile"] and ctx.rank == 0:
            prof = {}
            for mode in ("eager", "compiled"):
                with stance(mode == "compiled"):
                    prof[mode] = _profile(call, args["top"])
    with stance(True):
        state = describe(module)
    keep = ctx.rank == 0
    return {"times": times, "warmup": (warm_wall, warm_cpu), "profile": prof, "compile": state,
            **{m: outs[m].float() if keep else None for m in modes}}


def _run(case: str, sp: int, args: dict) -> dict:
    from ..distributed.dispatch import dispatch

    results = dispatch(rank_speed, case, args, sp=sp, threads=1, timeout_s=3600)
    # per mode, the slowest rank's best (wall, cpu)
    best = {m: [max(min(t[i] for t in r["times"][m]) for r in results) for i in (0, 1)]
            for m in ("blas", "eager", "compiled")}
    b, e, c = results[0]["blas"], results[0]["eager"], results[0]["compiled"]
    err = float((e - c).abs().max() / e.abs().max().clamp_min(1e-30))
    err_route = float((e - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return {"case": case, "sp": sp, "blas_wall_s": best["blas"][0], "blas_cpu_s": best["blas"][1],
            "route_rel_err": err_route, "eager_wall_s": best["eager"][0], "eager_cpu_s": best["eager"][1],
            "compiled_wall_s": best["compiled"][0], "compiled_cpu_s": best["compiled"][1],
            "warmup_compile_s": max(r["warmup"][0] for r in results), "max_rel_err": err,
            "compile": results[0]["compile"], "profile": results[0]["profile"]}


def format_table(rows: list[dict]) -> list[str]:
    base = {(r["case"]): r for r in rows if r["sp"] == 1}
    lines = ["| case | SP | eager, BLAS GEMMs CPU s | eager CPU s | compiled CPU s | eager / BLAS | compiled / eager | "
             "eager wall s | compiled wall s | CPU vs SP=1 eager (max rank) | warm-up compile s | "
             "max rel. error: eager vs BLAS / compiled vs eager |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        one = base.get(r["case"])
        vs = f"{r['eager_cpu_s'] / one['eager_cpu_s']:.2f} / {r['compiled_cpu_s'] / one['eager_cpu_s']:.2f}" if one else ""
        lines.append(f"| {r['label']} | {r['sp']} | {r['blas_cpu_s']:.2f} | {r['eager_cpu_s']:.2f} | "
                     f"{r['compiled_cpu_s']:.2f} | {r['eager_cpu_s'] / r['blas_cpu_s']:.2f} | "
                     f"{r['compiled_cpu_s'] / r['eager_cpu_s']:.2f} | {r['eager_wall_s']:.2f} | "
                     f"{r['compiled_wall_s']:.2f} | {vs} | {r['warmup_compile_s']:.1f} | "
                     f"{r['route_rel_err']:.1e} / {r['max_rel_err']:.1e} |")
    return lines


def format_profiles(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if not r["profile"]:
            continue
        for mode, ops in r["profile"].items():
            lines += ["", f"{r['label']}, SP={r['sp']}, {mode}: top ops by self CPU time (rank 0)", "",
                      "| op | self CPU ms | share |", "| --- | ---: | ---: |"]
            lines += [f"| `{name}` | {ms:.1f} | {pct:.1f}% |" for name, ms, pct in ops]
    return lines


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--cases", default="dit,vae", help="dit, vae or both")
    p.add_argument("--sp", type=positive_int_list, default=[1, 2], help="SP degrees, side by side")
    p.add_argument("--layers", type=positive_int, default=2, help="DiT blocks (released 3B widths)")
    p.add_argument("--latent", type=positive_int_list, default=[5, 32, 32], help="DiT latent T,H,W")
    p.add_argument("--clip", type=positive_int_list, default=[5, 64, 64], help="VAE clip T,H,W (encode + decode)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="rounds of the three modes (BLAS eager, eager, compiled) per case, order rotated")
    p.add_argument("--top", type=positive_int, default=8, help="ops per profile table")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "speed", "per-op profile; eager vs --compile; one device vs SP (DiT and VAE)",
                   __doc__, _arguments, main)


def main(args=None, parser=None) -> int:
    if args is None:
        args = _arguments(argparse.ArgumentParser()).parse_args()
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in ("dit", "vae"):
            (parser or argparse.ArgumentParser()).error(f"--cases: unknown case {c!r}; choose from dit, vae")
    labels = {"dit": f"DiT 3B widths, {args.layers} layers, latent {'x'.join(map(str, args.latent))}",
              "vae": f"VAE released widths, encode+decode {'x'.join(map(str, args.clip))}"}
    rows = []
    for case in cases:
        for i, sp in enumerate(args.sp):
            conf = {"layers": args.layers, "latent": tuple(args.latent), "clip": tuple(args.clip),
                    "dtype": args.dtype, "repeats": args.repeats, "profile": i == 0, "top": args.top}
            r = _run(case, sp, conf)
            r["label"] = f"{labels[case]}, {args.dtype}"
            rows.append(r)
            print(f"{r['label']} SP={sp}: eager {r['eager_cpu_s']:.2f} s CPU (BLAS GEMMs {r['blas_cpu_s']:.2f} s), "
                  f"compiled {r['compiled_cpu_s']:.2f} s "
                  f"({r['compile']})", flush=True)
    cap = _cpu_capability()
    head = [f"CPU capability usage: {cap}; torch {torch.__version__}; one thread per rank; "
            f"min over {args.repeats} repeats, slowest rank; error: max |a - b| / max |b|; "
            f"float32 linears on oneDNN unless 'BLAS'", ""]
    table = format_table(rows)
    print("\n".join(head + table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Per-rank speed: eager vs --compile, one device vs SP (`ditsp bench speed`)", "", *head, *table,
          *format_profiles(rows)]
    (out / "speed.md").write_text("\n".join(md) + "\n")
    (out / "speed.json").write_text(json.dumps({"cpu_capability": cap, "torch": torch.__version__, "rows": rows},
                                               indent=1) + "\n")
    print(f"wrote {out / 'speed.md'} and speed.json")
    return 0
