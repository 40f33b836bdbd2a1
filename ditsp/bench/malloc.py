"""The CPU allocator policies (:mod:`ditsp.cpu.malloc`) side by side: one fresh process per policy and case.

glibc reads its tunables when a process starts, so each (case, policy) runs in a process of its own,
started under that policy; the rounds rotate the policies' order so all see the same machine. Cases:
the released-width VAE's encode + decode of a ``--clip`` T,H,W clip and the 3B DiT's forward with
``--layers`` blocks on a ``--latent`` T,H,W latent, each in ``--dtype`` (float32 and bfloat16 by
default), one thread, the fast kernel policy. A process runs one warm-up call, then ``--calls`` calls,
each measured by ``getrusage``: user and system CPU seconds, minor page faults, wall seconds; a row is
the call with the least CPU time over all rounds, and the process's peak resident memory (max over
rounds). Every policy's output must have the same bits as the system allocator's: an allocator moves
memory, never values. Results: ``benchmarks/results/malloc.md`` and ``malloc.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ..cpu import malloc as cpu_malloc
from ..argtypes import positive_int, positive_int_list
from ..dtypes import DTYPES
from . import declare

CASES = ("vae", "dit")


def child(spec: dict) -> dict:
    """In the fresh process: build the case, warm up, measure each call; the output's sha256."""
    import hashlib
    import resource
    import time

    import torch

    from ..fixed_shape import FAST, use

    torch.set_num_threads(1)
    dtype = DTYPES[spec["dtype"]]
    if spec["case"] == "vae":
        from ..models.seedvr2.vae import RELEASED
        from ..models.seedvr2.vae.fixtures import seeded_vae
        from ..models.seedvr2.vae.sharded import ParallelVAE

        pv = ParallelVAE(seeded_vae(RELEASED).to(dtype), None)
        T, H, W = spec["clip"]
        x = (torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dtype)

        def call():
            return pv.decode(pv.encode(x).posterior.mean)
    else:
        from ..config import ParallelConfig
        from ..models.seedvr2.nadit.model import build_model, random_inputs
        from ..models.seedvr2.parallelize import parallelize

        model = build_model("seedvr2-3b", spec["layers"], dtype=dtype)
        grid = model.grid_of(spec["latent"])
        vid, txt = random_inputs(model.cfg, grid, seed=1)
        rt = parallelize(model.cfg, ParallelConfig.window(1, window_path="window", deterministic=False), grid, None)

        def call():
            return model(vid, txt, 1000.0, runtime=rt)

    calls = []
    with use(FAST), torch.no_grad():
        out = call()  # warm-up: plans, caches, the heap's first growth
        for _ in range(spec["calls"]):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out = call()
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            calls.append({"user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
                          "faults": r1.ru_minflt - r0.ru_minflt, "wall_s": t1 - t0})
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest = hashlib.sha256(out.float().contiguous().numpy().tobytes()).hexdigest()
    return {"calls": calls, "peak_gib": peak_kib / 2 ** 20, "sha256": digest,
            "in_effect": cpu_malloc.in_effect(), "tunables": os.environ.get("GLIBC_TUNABLES", "")}


def _environment(policy: str) -> dict[str, str]:
    """This process's environment with the allocator tunables of ``policy`` only (none for ``system``)."""
    env = dict(os.environ)
    keys = {e.split("=", 1)[0] for name in cpu_malloc.POLICIES for e in cpu_malloc.tunables(name)}
    kept = [e for e in env.get("GLIBC_TUNABLES", "").split(":") if e and e.split("=", 1)[0] not in keys]
    env["GLIBC_TUNABLES"] = ":".join(kept)
    if not env["GLIBC_TUNABLES"]:
        del env["GLIBC_TUNABLES"]
    env.pop(cpu_malloc.APPLIED, None)
    env[cpu_malloc.ENV] = policy
    env.update(cpu_malloc.rank_environment(env))
    return env


def _run_child(spec: dict, policy: str, timeout_s: float) -> dict:
    code = f"import json, sys; from ditsp.bench.malloc import child; print(json.dumps(child({spec!r})))"
    r = subprocess.run([sys.executable, "-c", code], env=_environment(policy), capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench malloc: the {spec['case']} {spec['dtype']} process under {policy} failed: {tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(cases, dtypes, policies, rounds: int, calls: int, clip, latent, layers: int,
            timeout_s: float = 3600.0, progress=None) -> list[dict]:
    """One row per (case, dtype, policy); see the module docstring."""
    rows = []
    for case in cases:
        for dtype in dtypes:
            spec = {"case": case, "dtype": dtype, "calls": calls, "clip": list(clip), "latent": list(latent),
                    "layers": layers}
            runs: dict[str, list[dict]] = {p: [] for p in policies}
            for r in range(rounds):
                for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                    runs[policy].append(_run_child(spec, policy, timeout_s))
                    if progress is not None:
                        progress.update(1)
            digests = {p: {run["sha256"] for run in runs[p]} for p in policies}
            for policy in policies:
                best = min((c for run in runs[policy] for c in run["calls"]), key=lambda c: c["user_s"] + c["sys_s"])
                rows.append({"case": case, "dtype": dtype, "policy": policy, **best,
                             "cpu_s": best["user_s"] + best["sys_s"],
                             "peak_gib": max(run["peak_gib"] for run in runs[policy]),
                             "in_effect": all(run["in_effect"] for run in runs[policy]),
                             "tunables": runs[policy][0]["tunables"],
                             "same_bits": digests[policy] == digests[policies[0]] and len(digests[policy]) == 1})
    return rows


def format_report(rows: list[dict], meta: dict) -> list[str]:
    lines = [f"{meta['cpu']}; glibc {meta['glibc']}; transparent huge pages: {meta['thp']}. "
             f"VAE encode + decode of a {'x'.join(map(str, meta['clip']))} clip (released widths); DiT 3B, "
             f"{meta['layers']} layers, latent {'x'.join(map(str, meta['latent']))}; one thread, fast kernel policy. "
             f"The call with the least CPU time of {meta['rounds']} fresh processes x {meta['calls']} calls per "
             "policy; peak = the process's maximum resident memory.", "",
             "| case | dtype | policy | user s | system s | CPU s | CPU vs system | page faults | wall s | "
             "peak GiB | same bits as system |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    base = {(r["case"], r["dtype"]): r for r in rows if r["policy"] == "system"}
    for r in rows:
        ref = base.get((r["case"], r["dtype"]))
        vs = f"{r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "-"
        policy = r["policy"] + (" (no effect here)" if r["policy"] != "system" and not r["tunables"] else "")
        lines.append(f"| {r['case']} | {r['dtype']} | {policy} | {r['user_s']:.2f} | {r['sys_s']:.2f} | "
                     f"{r['cpu_s']:.2f} | {vs} | {r['faults']} | {r['wall_s']:.2f} | {r['peak_gib']:.2f} | "
                     f"{'yes' if r['same_bits'] else 'NO'} |")
    return lines


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--case", default="vae,dit", help="comma-separated: vae, dit")
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--policy", default=",".join(("system", "hugepages", "reuse")),
                   help=f"comma-separated, the first is the reference: {', '.join(cpu_malloc.POLICIES)}")
    p.add_argument("--clip", type=positive_int_list, default=[9, 128, 128], help="VAE clip T,H,W")
    p.add_argument("--latent", type=positive_int_list, default=[5, 64, 64], help="DiT latent T,H,W")
    p.add_argument("--layers", type=positive_int, default=2, help="DiT blocks")
    p.add_argument("--rounds", type=positive_int, default=2, help="fresh processes per policy and case")
    p.add_argument("--calls", type=positive_int, default=2, help="measured calls per process, after one warm-up")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "malloc", "CPU allocator policies (DITSP_CPU_MALLOC) side by side, a process each",
                   __doc__, _arguments, main)


def _choices(parser, flag: str, value: str, allowed) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        parser.error(f"{flag} {value}: choose from {', '.join(allowed)}")
    return items


def main(args=None, parser=None) -> int:
    from tqdm import tqdm

    from ..io.write import atomic_path
    from .speed import _cpu_capability

    parser = parser or argparse.ArgumentParser()
    if args is None:
        args = _arguments(parser).parse_args()
    cases = _choices(parser, "--case", args.case, CASES)
    dtypes = _choices(parser, "--dtype", args.dtype, tuple(DTYPES))
    policies = _choices(parser, "--policy", args.policy, cpu_malloc.POLICIES)
    if len(args.clip) != 3 or len(args.latent) != 3:
        parser.error("--clip and --latent: expected T,H,W")
    glibc = cpu_malloc.glibc_version()
    meta = {"cpu": f"CPU capability {_cpu_capability()}", "glibc": ".".join(map(str, glibc)) if glibc else "none",
            "thp": cpu_malloc.transparent_hugepages() or "unknown", "clip": args.clip, "latent": args.latent,
            "layers": args.layers, "rounds": args.rounds, "calls": args.calls}
    total = len(cases) * len(dtypes) * len(policies) * args.rounds
    with tqdm(total=total, desc="bench malloc: processes", unit="proc", disable=None) as bar:
        rows = measure(cases, dtypes, policies, args.rounds, args.calls, args.clip, args.latent, args.layers,
                       progress=bar)
    lines = format_report(rows, meta)
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("malloc.md", "# CPU allocator policies (`ditsp bench malloc`)\n\n" + "\n".join(lines) + "\n"),
                       ("malloc.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")):
        with atomic_path(out / name, (Path(name).suffix,), overwrite=True) as tmp:
            tmp.write_text(text)
    return 0 if all(r["same_bits"] for r in rows) else 1
