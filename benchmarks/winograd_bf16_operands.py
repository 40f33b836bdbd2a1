"""Would Winograd with bfloat16 GEMM operands make the bf16 VAE faster, and at what cost in error?

ditsp's Winograd (``ditsp/models/seedvr2/vae/winograd.py``) computes a bf16 conv's F(4x4, 3x3)
transforms and GEMMs in float32: a quarter of the direct conv's multiplies, at half the bf16 rate.
The route left to a faster bf16 VAE is to hand the GEMMs bf16 operands (the transformed input V and
filters U rounded to bf16, products accumulated in float32, as oneDNN's bf16 GEMM does), which
doubles their rate, with F(4x4, 3x3) or the smaller F(2x2, 3x3). This script measures both sides of
that trade on one conv per VAE width, on this machine:

- error against a float64 conv (max and RMS, relative to the output's scale), for the direct bf16
  conv, ditsp's float32 Winograd, and each bf16-operand variant (rounding emulated exactly: bf16
  values, float32 products and sums);
- time: the direct bf16 conv and ditsp's Winograd as they run, and for each bf16-operand variant
  its GEMMs alone (oneDNN bf16, weights packed), a lower bound on its time: transforms excluded.

On a kernel set without native bf16 (AVX2) ditsp computes bf16 convs in float32 (``layers._conv_call``)
and bf16 GEMMs are emulated, so there is nothing to gain: the script says so and stops.

Run: ``PYTHONPATH=. python benchmarks/winograd_bf16_operands.py`` (one thread; ~1 minute). Writes
``benchmarks/results/winograd-bf16-operands.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ditsp.models.seedvr2.vae import winograd

REPO = Path(__file__).resolve().parents[1]

# F(2x2, 3x3): B^T (input), G (filter), A^T (output); 16 products for a 2x2 output tile.
BT2 = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))
G2 = ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1))
AT2 = ((1, 1, 1, 0), (0, 1, -1, -1))
# F(4x4, 3x3), the points ditsp uses (0, 1, -1, 2, -2, infinity); 36 products for a 4x4 tile.
BT4 = ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
       (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1))
G4 = winograd._G
AT4 = ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))
VARIANTS = {"F(2x2,3x3)": (BT2, G2, AT2), "F(4x4,3x3)": (BT4, G4, AT4)}


def _mat(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def transformed(x: torch.Tensor, w: torch.Tensor, variant: str):
    """V (n*n, T_in * tiles, C_in) and U (n*n, 3, C_out, C_in) in float32 for a conv padded by one
    row and column: x (C_in, T_in, H, W) with H, W multiples of the tile, w (C_out, C_in, 3, 3, 3)."""
    bt, g, _ = (_mat(m) for m in VARIANTS[variant])
    n, m = bt.shape[0], bt.shape[0] - 2
    c, t, h, wd = x.shape
    xp = F.pad(x.double(), (1, 1, 1, 1))
    tiles = xp.unfold(2, n, m).unfold(3, n, m)  # (C, T, th, tw, n, n)
    v = torch.einsum("ai,ctxyij,bj->abtxyc", bt, tiles, bt).reshape(n * n, t * (h // m) * (wd // m), c)
    u = torch.einsum("ai,ockij,bj->abkoc", g, w.double(), g).reshape(n * n, 3, w.shape[0], c)
    return v.float(), u.float()


def winograd_conv(x: torch.Tensor, w: torch.Tensor, variant: str, bf16_operands: bool) -> torch.Tensor:
    """The conv (output frames T_in - 2, same H, W) by ``variant``; with ``bf16_operands`` V and U are
    rounded to bf16 before the GEMMs (float32 products and sums, as a bf16 GEMM computes them)."""
    _, _, at = (_mat(mm) for mm in VARIANTS[variant])
    c, t, h, wd = x.shape
    n, m = at.shape[1], at.shape[0]
    th, tw = h // m, wd // m
    v, u = transformed(x, w, variant)
    if bf16_operands:
        v, u = v.bfloat16().float(), u.bfloat16().float()
    per = th * tw
    rows = (t - 2) * per
    prod = torch.stack([sum(v[p, k * per:k * per + rows] @ u[p, k].t() for k in range(3)) for p in range(n * n)])
    prod = prod.view(n, n, t - 2, th, tw, -1)
    y = torch.einsum("ai,ijtxyo,bj->otxayb", at.float(), prod, at.float())
    return y.reshape(-1, t - 2, h, wd)


def gemm_seconds(variant: str, c_in: int, c_out: int, frames_out: int, h: int, w: int, reps: int) -> float:
    """Best time of the variant's GEMMs alone in bf16 (n*n positions x 3 temporal taps, oneDNN, packed)."""
    n = len(VARIANTS[variant][0])
    tiles = (h // (n - 2)) * (w // (n - 2))
    rows = frames_out * tiles
    a = torch.randn(rows + 2 * tiles, c_in).bfloat16()
    wt = torch.randn(c_out, c_in).bfloat16()
    op, packed = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight(wt, rows)

    def run():  # as ditsp's Winograd calls oneDNN: weights packed once, the taps as row offsets
        for _ in range(n * n):
            acc = op(a[:rows], packed, None, "none", [], "")
            acc += op(a[tiles:tiles + rows], packed, None, "none", [], "")
            acc += op(a[2 * tiles:2 * tiles + rows], packed, None, "none", [], "")

    return _best(run, reps)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = y.double() - ref
    return float(d.abs().max() / ref.abs().max()), float(d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def measure(c_in: int, c_out: int, frames_in: int, size: int, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(c_in)
    x = F.silu(torch.randn(1, c_in, frames_in, size, size, generator=g)).bfloat16()  # a post-norm activation
    w = (torch.randn(c_out, c_in, 3, 3, 3, generator=g) / (27 * c_in) ** 0.5).bfloat16()
    ref = F.conv3d(x.double(), w.double(), padding=(0, 1, 1))
    last = torch.channels_last_3d
    xl, wl = x.contiguous(memory_format=last), w.contiguous(memory_format=last)
    direct = F.conv3d(xl, wl, padding=(0, 1, 1))
    t_direct = _best(lambda: F.conv3d(xl, wl, padding=(0, 1, 1)), reps)
    cache = winograd.WeightCache()
    ours = winograd.conv3d(xl, w, None, (0, 1, 1), cache=cache)
    t_ours = _best(lambda: winograd.conv3d(xl, w, None, (0, 1, 1), cache=cache), reps)
    shape = f"{c_in}->{c_out}, {frames_in}x{size}x{size}"
    out = [{"conv": shape, "route": "direct conv (oneDNN)", "operands": "bf16", "multiplies": 1.0,
            "errors": _errors(direct, ref), "ms": 1e3 * t_direct, "timed": "the conv"},
           {"conv": shape, "route": "ditsp Winograd F(4x4,3x3)", "operands": "float32", "multiplies": 36 / 144,
            "errors": _errors(ours, ref), "ms": 1e3 * t_ours, "timed": "the conv"}]
    for variant, products, outputs in (("F(2x2,3x3)", 16, 4), ("F(4x4,3x3)", 36, 16)):
        y = winograd_conv(x[0].float(), w.float(), variant, bf16_operands=True)[None].bfloat16()
        out.append({"conv": shape, "route": f"Winograd {variant}", "operands": "bf16",
                    "multiplies": products / (9 * outputs), "errors": _errors(y, ref),
                    "ms": 1e3 * gemm_seconds(variant, c_in, c_out, frames_in - 2, size, size, reps),
                    "timed": "its GEMMs only (a lower bound)"})
    for r in out:
        r["vs_direct_time"] = r["ms"] / out[0]["ms"]
        r["vs_direct_rms_error"] = r["errors"][1] / out[0]["errors"][1]
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Winograd with bf16 GEMM operands: speed against error (`benchmarks/winograd_bf16_operands.py`)", "",
             f"{meta['cpu_capability']}; torch {meta['torch']}; one thread. One 3x3x3 conv per VAE width on a "
             "post-SiLU bf16 activation (zero row/column padding, no time padding), weights scaled to unit gain. "
             "Errors against a float64 conv of the same bf16 values, relative to the output's max (max) and RMS "
             "(RMS). Times: best of the repetitions; a bf16-operand variant is timed by its GEMMs alone, so its "
             "real time is longer (the transforms come on top).", "",
             "| conv | route | GEMM operands | multiplies vs direct | max error | RMS error | RMS error vs direct | "
             "ms | time vs direct | timed |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['conv']} | {r['route']} | {r['operands']} | {r['multiplies']:.2f} | {r['errors'][0]:.1e} | "
                     f"{r['errors'][1]:.1e} | {r['vs_direct_rms_error']:.1f}x | {r['ms']:.1f} | "
                     f"{r['vs_direct_time']:.2f} | {r['timed']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=32, help="frame height and width (a multiple of 4)")
    ap.add_argument("--frames", type=int, default=7, help="input frames (output frames: two fewer)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--widths", default="128,256,512")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("this CPU kernel set has no native bf16 (oneDNN needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): "
                         "ditsp computes bf16 convs in float32 here, so bf16 GEMM operands have nothing to gain")
    torch.set_num_threads(1)
    rows = []
    for c in (int(v) for v in args.widths.split(",")):
        rows += measure(c, c, args.frames, args.size, args.reps)
        print(f"measured {c} channels", flush=True)
    capability = next((line.strip() for line in torch.__config__.show().splitlines() if "CPU capability" in line), "")
    meta = {"cpu_capability": capability, "torch": torch.__version__, "size": args.size, "frames": args.frames}
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, meta)
    (args.out / "winograd-bf16-operands.md").write_text(text)
    (args.out / "winograd-bf16-operands.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
