"""The VAE's activation layout (ditsp/models/seedvr2/vae/channels_last.py): contiguous vs channels-last 3-D.

One CPU thread, fast policy, seeded released-width VAE. Per conv shape: one direct oneDNN call
(`layers._conv_call`) from each layout, input and weight alike, min over ``--repeats`` interleaved calls. Then the whole VAE,
chunked as ditsp runs it, with the layout switched between interleaved calls (warm: the Winograd
filters are built before timing), process CPU seconds, min per side, and the largest difference of the
outputs relative to their scale. Run it natively and under another kernel set, e.g.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vae_layout.py --out benchmarks/results/vae-layout.json
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$PWD \\
        .venv/bin/python benchmarks/vae_layout.py --out benchmarks/results/vae-layout-avx2.json

Each run writes its JSON and a markdown table beside it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

SHAPES = ((128, 11, 130, 128), (256, 11, 66, 64), (512, 7, 34, 32))  # (channels, T, H, W) of the conv input


def _cpu(fn) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def _capability() -> str:
    return next((l.strip(" -") for l in torch.__config__.show().splitlines() if "CPU capability" in l), "unknown")


def per_conv(dtype: torch.dtype, repeats: int) -> list[dict]:
    from ditsp.models.seedvr2.vae.layers import _conv_call

    g = torch.Generator().manual_seed(0)
    rows = []
    for c, t, h, w in SHAPES:
        x = torch.randn(1, c, t, h, w, generator=g).to(dtype)
        weight = (torch.randn(c, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5).to(dtype)
        bias = torch.zeros(c, dtype=dtype)
        # each layout with its weight in the same layout, as the VAE calls them (WeightCache.channels_last)
        args = {k: (x.contiguous(memory_format=f), weight.contiguous(memory_format=f))
                for k, f in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last_3d))}
        best = {}
        for xx, ww in args.values():
            _conv_call(xx, ww, bias, (1, 1, 1), (0, 0, 1))
        for r in range(repeats):
            for k in (("contiguous", "channels_last") if r % 2 == 0 else ("channels_last", "contiguous")):
                xx, ww = args[k]
                best[k] = min(best.get(k, float("inf")), _cpu(lambda: _conv_call(xx, ww, bias, (1, 1, 1), (0, 0, 1)))[0])
        rows.append({"channels": c, "input": [t, h, w], "contiguous_ms": 1e3 * best["contiguous"],
                     "channels_last_ms": 1e3 * best["channels_last"],
                     "ratio": best["channels_last"] / best["contiguous"]})
    return rows


def whole(dtype: torch.dtype, clip, repeats: int) -> dict:
    from ditsp.fixed_shape import FAST, use
    from ditsp.cpu import settings as cpu_settings
    from ditsp.models.seedvr2.vae import RELEASED
    from ditsp.models.seedvr2.vae.fixtures import seeded_vae
    from ditsp.models.seedvr2.vae.sharded import ParallelVAE

    vae = seeded_vae(RELEASED).to(dtype).requires_grad_(False)
    pv = ParallelVAE(vae, None)
    x = (torch.rand((1, 3) + tuple(clip), generator=torch.Generator().manual_seed(1)) * 2 - 1).to(dtype)
    times = {k: {"encode": [], "decode": []} for k in ("contiguous", "channels_last")}
    outs = {}
    with torch.no_grad(), use(FAST):
        z = pv.encode(x, mode="chunked").posterior.mean
        pv.decode(z, mode="chunked")  # builds the Winograd filters that pay for themselves
        pv.decode(z, mode="chunked")
        for r in range(repeats):
            for k in (("contiguous", "channels_last") if r % 2 == 0 else ("channels_last", "contiguous")):
                with cpu_settings.use(vae_channels_last=k == "channels_last"):
                    te, zz = _cpu(lambda: pv.encode(x, mode="chunked").posterior.mean)
                    td, y = _cpu(lambda: pv.decode(z, mode="chunked"))
                times[k]["encode"].append(te)
                times[k]["decode"].append(td)
                outs[k] = (zz.float(), y.float())

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    res = {"clip": list(clip), "runs_s": times}
    for op in ("encode", "decode"):
        c, l = min(times["contiguous"][op]), min(times["channels_last"][op])
        res[op] = {"contiguous_s": c, "channels_last_s": l, "ratio": l / c}
    res["latent_rel_diff"] = rel(outs["channels_last"][0], outs["contiguous"][0])
    res["decoded_rel_diff"] = rel(outs["channels_last"][1], outs["contiguous"][1])
    return res


def markdown(res: dict) -> list[str]:
    out = [f"# VAE activations: contiguous vs channels-last 3-D (`benchmarks/vae_layout.py`)", "",
           f"{res['capability']}, torch {res['torch']}, one thread, fast policy; CPU seconds, min over "
           f"{res['repeats']} interleaved runs per side.", "",
           "One direct 3x3x3 conv (C -> C), per dtype:", "",
           "| dtype | C | input T x H x W | contiguous ms | channels-last ms | channels-last / contiguous |",
           "| --- | ---: | --- | ---: | ---: | ---: |"]
    for dt, rows in res["per_conv"].items():
        for r in rows:
            out.append(f"| {dt} | {r['channels']} | {'x'.join(map(str, r['input']))} | {r['contiguous_ms']:.0f} | "
                       f"{r['channels_last_ms']:.0f} | {r['ratio']:.2f} |")
    out += ["", "The released-width VAE, chunked, warm:", "",
            "| dtype | clip | op | contiguous CPU s | channels-last CPU s | channels-last / contiguous | "
            "max rel. diff |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for dt, w in res["whole"].items():
        for op, diff in (("encode", w["latent_rel_diff"]), ("decode", w["decoded_rel_diff"])):
            out.append(f"| {dt} | {'x'.join(map(str, w['clip']))} | {op} | {w[op]['contiguous_s']:.2f} | "
                       f"{w[op]['channels_last_s']:.2f} | {w[op]['ratio']:.2f} | {diff:.1e} |")
    return out


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clip", default="9,128,128", help="T,H,W of the whole-VAE clip")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vae-layout.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    clip = tuple(int(v) for v in args.clip.split(","))
    res = {"capability": _capability(), "torch": torch.__version__, "repeats": args.repeats,
           "per_conv": {}, "whole": {}}
    for name in args.dtypes.split(","):
        res["per_conv"][name] = per_conv(dtypes[name], args.repeats)
        res["whole"][name] = whole(dtypes[name], clip, args.repeats)
        print("\n".join(markdown(res)), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(args.out, json.dumps(res, indent=1) + "\n")
    _atomic_write(args.out.with_suffix(".md"), "\n".join(markdown(res)) + "\n")


if __name__ == "__main__":
    main()
