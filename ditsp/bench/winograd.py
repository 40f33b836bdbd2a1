"""The VAE's Winograd convs (:mod:`ditsp.models.seedvr2.vae.winograd`) against direct oneDNN convs, one CPU thread.

The released-width VAE (seeded weights) encodes then decodes a ``--clip`` T,H,W float32 clip under the
fast kernel policy, with the ``vae_winograd`` setting off and on alternating in one process (``--repeats``
rounds after warm-up runs): process CPU seconds, the minimum per side, their ratio, and the largest
difference of the latent mean and of the decoded clip relative to the direct run's scale. The warm-up
Winograd runs are timed apart from the steady state: they transform and pack the filters, each conv
once its calls pay for it (:data:`~ditsp.models.seedvr2.vae.winograd.BUILD_PIXELS`), and run until
every conv that qualifies has them. Then every conv shape the steady-state run sent to Winograd, on
random inputs in the layout the VAE runs them in (channels-last under the fast policy on CPU): direct
vs Winograd interleaved (minimum over ``--repeats``; a shape run more than once
per clip counts each time in the totals), and each one's error against a float64 conv next to the
direct conv's own. Results: ``benchmarks/results/vae-winograd.md`` and ``vae-winograd.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from ..argtypes import positive_int, positive_int_list
from . import declare
from ..models.seedvr2.vae.modes import AUTO, CHOICES


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _cpu(fn) -> tuple[float, object]:
    c0 = time.process_time()
    out = fn()
    return time.process_time() - c0, out


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(clip, repeats: int, widths=None, shapes: bool = True, max_warm: int = 20, dtype: str = "fp32",
            vae_mode: str = "auto") -> dict:
    """Whole-VAE and per-shape timings (see the module docstring); ``widths``: other than the released ones."""
    import torch.nn.functional as F

    from ..cpu import settings as cpu_settings
    from ..fixed_shape import FAST, use
    from ..models.seedvr2.vae import RELEASED, channels_last, winograd
    from ..models.seedvr2.vae.fixtures import seeded_vae
    from ..models.seedvr2.vae.layers import conv3d
    from ..models.seedvr2.vae.sharded import ParallelVAE

    torch.set_num_threads(1)
    cfg = RELEASED if widths is None else RELEASED.with_widths(widths)
    dt = DTYPES[dtype]
    vae = seeded_vae(cfg).to(dt)
    pv = ParallelVAE(vae, None)
    T, H, W = clip
    x = (torch.rand(1, 3, T, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dt)
    seen: Counter = Counter()
    real = winograd.conv3d

    def spy(xx, weight, bias, padding, cache=None, **kw):
        seen[(tuple(xx.shape), tuple(weight.shape), tuple(padding))] += 1
        return real(xx, weight, bias, padding, cache, **kw)

    modes = set()

    def run(flag: str):
        with cpu_settings.use(vae_winograd=flag == "1"), use(FAST), torch.no_grad():
            enc = pv.encode(x, vae_mode)
            modes.add(enc.mode)
            return enc.posterior.mean, pv.decode(enc.posterior.mean, vae_mode)

    caches = [m.winograd for m in vae.modules() if isinstance(getattr(m, "winograd", None), winograd.WeightCache)]

    def built() -> list:
        return [m for m in vae.modules() if getattr(getattr(m, "winograd", None), "filters", None) is not None]

    def pending() -> bool:  # a conv still running direct until its calls pay for its filters
        return any(c.seen is not None and (c.filters is None or c.key != c.seen) for c in caches)

    direct_first, _ = _cpu(lambda: run("0"))
    winograd.conv3d = spy
    warm = []
    try:  # Winograd runs until every conv that qualifies has built its filters (once its calls paid for it)
        while len(warm) < max_warm and (not warm or pending()):
            seen.clear()
            warm.append(_cpu(lambda: run("1"))[0])
    finally:
        winograd.conv3d = real
    calls = dict(seen)
    times = {"0": [], "1": []}
    outs = {}
    for r in range(repeats):
        for flag in (("0", "1") if r % 2 == 0 else ("1", "0")):
            t, outs[flag] = _cpu(lambda: run(flag))
            times[flag].append(t)
    direct, wino = min(times["0"]), min(times["1"])
    cache_bytes = sum(16 * m.weight.numel() for m in built())  # 36 float32 positions per 9 taps of each filter
    whole = {"clip": list(clip), "widths": list(cfg.widths), "dtype": dtype, "vae_mode": "/".join(sorted(modes)),
             "direct_cpu_s": direct, "winograd_cpu_s": wino,
             "ratio": wino / direct, "speedup": direct / wino, "direct_runs_s": times["0"],
             "winograd_runs_s": times["1"], "first_direct_cpu_s": direct_first,
             "warmup_winograd_runs_s": warm, "filter_cache_gib": cache_bytes / 2 ** 30,
             "latent_rel_diff": _rel(outs["1"][0], outs["0"][0]), "decoded_rel_diff": _rel(outs["1"][1], outs["0"][1])}
    rows = []
    if shapes:
        g = torch.Generator().manual_seed(1)
        for (xs, ws, pad), n in sorted(calls.items(), key=lambda kv: (kv[0][1][1], kv[0][0][3:])):
            xx = torch.randn(xs, generator=g).to(dt)
            with use(FAST):  # the layout the VAE's executor runs this conv in
                xx = xx.contiguous(memory_format=torch.channels_last_3d if channels_last.wanted(xx) else
                                   torch.contiguous_format)
            weight = (torch.randn(ws, generator=g) / (ws[1] * 27) ** 0.5).to(dt)
            bias = (torch.randn(ws[0], generator=g) * 0.1).to(dt)
            cache = winograd.WeightCache()
            fns = {"direct": lambda: conv3d(xx, weight, bias, padding=pad),  # no filter cache: direct
                   "winograd": lambda: winograd.conv3d(xx, weight, bias, pad, cache)}
            best = {}
            with use(FAST), torch.no_grad():
                for f in fns.values():
                    f()
                for _ in range(repeats):
                    for k, f in fns.items():
                        best[k] = min(best.get(k, float("inf")), _cpu(f)[0])
                direct_out, wino_out = fns["direct"](), fns["winograd"]()
            ref = F.conv3d(xx.double(), weight.double(), bias.double(), padding=pad)
            rows.append({"c_in": ws[1], "c_out": ws[0], "input": list(xs[2:]), "padding": list(pad), "calls": n,
                         "direct_ms": 1e3 * best["direct"], "winograd_ms": 1e3 * best["winograd"],
                         "speedup": best["direct"] / best["winograd"],
                         "direct_rel_err": _rel(direct_out, ref), "winograd_rel_err": _rel(wino_out, ref)})
    return {"whole": whole, "shapes": rows}


def format_report(res: dict) -> list[str]:
    w = res["whole"]
    clip = "x".join(map(str, w["clip"]))
    lines = [f"VAE widths {'/'.join(map(str, w['widths']))}, encode + decode of a {clip} "
             f"{ {'fp32': 'float32', 'bf16': 'bfloat16'}[w.get('dtype', 'fp32')]} clip, VAE mode "
             f"{w.get('vae_mode', 'height')}, fast policy, "
             "one thread; process CPU seconds, min over the interleaved runs.", "",
             "| direct CPU s | Winograd CPU s | Winograd / direct | speedup | latent max rel. diff | "
             "decoded max rel. diff | first run: direct / Winograd CPU s | Winograd runs until every filter is "
             "built: CPU s each | filter cache GiB |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| {w['direct_cpu_s']:.2f} | {w['winograd_cpu_s']:.2f} | {w['ratio']:.3f} | {w['speedup']:.2f}x | "
             f"{w['latent_rel_diff']:.1e} | {w['decoded_rel_diff']:.1e} | {w['first_direct_cpu_s']:.2f} / "
             f"{w['warmup_winograd_runs_s'][0]:.2f} | {' '.join(f'{t:.2f}' for t in w['warmup_winograd_runs_s'])} | "
             f"{w['filter_cache_gib']:.2f} |"]
    if res["shapes"]:
        lines += ["", "Every conv shape the run sent to Winograd (random inputs; errors vs a float64 conv, relative "
                  "to its max):", "",
                  "| C_in | C_out | input T x H x W | calls per clip | direct ms | Winograd ms | speedup | "
                  "error direct | error Winograd |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in res["shapes"]:
            lines.append(f"| {r['c_in']} | {r['c_out']} | {'x'.join(map(str, r['input']))} | {r['calls']} | "
                         f"{r['direct_ms']:.1f} | {r['winograd_ms']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['direct_rel_err']:.1e} | {r['winograd_rel_err']:.1e} |")
        by_cin: dict = {}
        for r in res["shapes"]:
            d, wi = by_cin.get(r["c_in"], (0.0, 0.0))
            by_cin[r["c_in"]] = (d + r["calls"] * r["direct_ms"], wi + r["calls"] * r["winograd_ms"])
        lines += ["", "| C_in | direct ms per clip | Winograd ms per clip | speedup |", "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {c} | {d:.0f} | {wi:.0f} | {d / wi:.2f}x |" for c, (d, wi) in sorted(by_cin.items())]
    return lines


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--clip", type=positive_int_list, default=[5, 64, 64], help="clip T,H,W (encode + decode)")
    p.add_argument("--widths", type=positive_int_list, default=None, help="VAE widths (default: the released ones)")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per side (and per shape)")
    p.add_argument("--no-shapes", action="store_true", help="the whole VAE only")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="the VAE's dtype (bf16 convs are computed in float32 by Winograd)")
    p.add_argument("--vae-mode", choices=CHOICES, default=AUTO, help="the VAE's mode (auto: what one device runs)")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    return declare(sub, "winograd", "the VAE's Winograd convs vs direct: whole VAE and per conv shape",
                   __doc__, _arguments, main)


def main(args=None, parser=None) -> int:
    if args is None:
        args = _arguments(argparse.ArgumentParser()).parse_args()
    if len(args.clip) != 3:
        (parser or argparse.ArgumentParser()).error("--clip: expected T,H,W")
    res = measure(tuple(args.clip), args.repeats, args.widths, shapes=not args.no_shapes, dtype=args.dtype,
                  vae_mode=args.vae_mode)
    lines = format_report(res)
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "vae-winograd" if args.dtype == "fp32" else f"vae-winograd-{args.dtype}"
    (out / f"{stem}.md").write_text("# VAE: Winograd F(4x4, 3x3) vs direct convs (`ditsp bench winograd`)\n\n"
                                         + "\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0
