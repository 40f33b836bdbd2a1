"""Does the fixed-shape premise hold on this machine's kernels, at a model's shapes, and at what cost?

:mod:`ditsp.fixed_shape` rests on one premise: inside a kernel call of one fixed shape, a row's
(or a batch item's, or a pixel's) result depends on its own inputs only, not on its position or on
what else shares the call. :func:`probe` checks it at a model's real widths with this process's
thread count and kernels, for every kind of call ditsp tiles (token-row GEMMs, window attention
pairs, VAE convolutions), and shows for contrast whether *plain* calls depend on their row count
here (the reason for the tiles). ``ditsp doctor`` prints the result.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .cpu import malloc as cpu_malloc
from .fixed_shape import DEFAULT_DETERMINISTIC, DETERMINISTIC, FAST, SERVE_DETERMINISTIC, linear_rows, use

from .dtypes import DTYPES
from .attention.window import segment_attention
from .models.seedvr2.vae.layers import conv3d
from .models.seedvr2.nadit.config import get_config
from .models.seedvr2.vae import RELEASED, TINY
ROW_COUNTS = list(range(1, 33)) + [47, 63, 64, 65, 127, 191, 193, 255, 257]


def cpu_capability() -> str:
    lines = [line.strip(" -") for line in torch.__config__.show().splitlines() if "CPU capability" in line]
    return lines[0] if lines else "CPU capability usage: unknown"


def _median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def _gemm(k: int, n: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(600, k, generator=g).to(dtype)
    with use(FAST):
        ref = linear_rows(x, w, b)
        plain_bad = [m for m in ROW_COUNTS if m + 5 <= 600 and not torch.equal(linear_rows(x[5:5 + m], w, b), ref[5:5 + m])]
    with use(DETERMINISTIC):
        tiled = linear_rows(x, w, b)
        tiled_bad = [(a, m) for a in (0, 5, 37) for m in ROW_COUNTS
                     if a + m <= 600 and not torch.equal(linear_rows(x[a:a + m], w, b), tiled[a:a + m])]
    big = torch.randn(2048, k, generator=g).to(dtype)
    with use(FAST):
        fast_s = _median_time(lambda: linear_rows(big, w, b))
    with use(DETERMINISTIC):
        det_s = _median_time(lambda: linear_rows(big, w, b))
    return {"shape": f"{k}->{n}", "plain_row_counts_differ": plain_bad, "tiled_rows_differ": len(tiled_bad),
            "holds": not tiled_bad, "cost": det_s / max(fast_s, 1e-12)}


def _attention(heads: int, head_dim: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    bad = 0
    for lq, lk in ((12, 12), (70, 81)):
        q, k, v = (torch.randn(6, n, heads, head_dim, generator=g).to(dtype) for n in (lq, lk, lk))
        with use(DETERMINISTIC):
            full = segment_attention(q, k, v)
            bad += sum(not torch.equal(segment_attention(q[a:a + m], k[a:a + m], v[a:a + m]), full[a:a + m])
                       for a, m in ((0, 1), (2, 1), (1, 3), (3, 3)))
    return {"shape": f"{heads}x{head_dim} heads", "pairs_differ": bad, "holds": bad == 0}


def _conv(channels: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    w = (torch.randn(channels, channels, 3, 3, 3, generator=g) * (27 * channels) ** -0.5).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype)
    x = torch.randn(1, channels, 5, 40, 24, generator=g).to(dtype)
    with use(DETERMINISTIC):
        full = conv3d(x, w, b, padding=(0, 1, 1))
        # a height slab with its halo rows and a later run of frames: the same output pixels
        slab = conv3d(x[:, :, :, 12:31], w, b, padding=(0, 0, 1))
        frames = conv3d(x[:, :, 1:], w, b, padding=(0, 1, 1))
    bad = int(not torch.equal(slab, full[:, :, :, 13:30])) + int(not torch.equal(frames, full[:, :, 1:]))
    big = torch.randn(1, channels, 3, 64, 64, generator=g).to(dtype)
    with use(FAST):
        fast_s = _median_time(lambda: conv3d(big, w, b, padding=(0, 1, 1)))
    with use(DETERMINISTIC):
        det_s = _median_time(lambda: conv3d(big, w, b, padding=(0, 1, 1)))
    return {"shape": f"3x3x3 conv, {channels} channels", "pieces_differ": bad, "holds": bad == 0,
            "cost": det_s / max(fast_s, 1e-12)}


@torch.no_grad()
def probe(model: str = "seedvr2-3b", dtypes=("fp32", "bf16"), say=None) -> dict:
    """Every check at ``model``'s widths, for each dtype; ``holds`` is the verdict. ``say(text)``, when
    given, is told each check before it runs (a check at the released widths takes a minute or more)."""

    cfg = get_config(model)
    vae_width = (RELEASED if model.startswith("seedvr2") else TINY).widths[0]
    inner = cfg.heads * cfg.head_dim
    g = torch.Generator().manual_seed(0)
    out = {"model": model, "cpu": cpu_capability(), "threads": torch.get_num_threads(),
           "cpu_malloc": cpu_malloc.describe(), "checks": []}
    say = say or (lambda text: None)
    total, done = 4 * len(dtypes), 0
    for name in dtypes:
        dtype = DTYPES[name]
        checks = [("gemm", lambda k=k, n=n: _gemm(k, n, dtype, g))
                  for k, n in ((cfg.vid_dim, 3 * inner), (cfg.mlp_hidden, cfg.vid_dim))]
        checks.append(("attention", lambda: _attention(cfg.heads, cfg.head_dim, dtype, g)))
        checks.append(("conv", lambda: _conv(vae_width, dtype, g)))
        for kind, run in checks:
            done += 1
            say(f"check {done} of {total}: {kind}, {name}")
            out["checks"].append({"kind": kind, "dtype": name, **run()})
    out["holds"] = all(c["holds"] for c in out["checks"])
    return out


# Where --deterministic is on without being asked for, from the one home of the defaults (ditsp.fixed_shape).
_POLICY = "the default" if DEFAULT_DETERMINISTIC else (
    "opt-in; the default of `ditsp serve` only" if SERVE_DETERMINISTIC else "opt-in")


def format_probe(r: dict) -> str:
    lines = [f"ditsp doctor: {r['model']} shapes, {r['cpu']}, {r['threads']} thread(s)", "",
             f"{'call':<10} {'dtype':<5} {'shape':<26} {'fixed-shape calls':<18} {'cost':>6}  plain calls"]
    for c in r["checks"]:
        verdict = "same bits" if c["holds"] else "DIFFER"
        cost = f"{c['cost']:.2f}x" if "cost" in c else "-"
        plain = ""
        if c["kind"] == "gemm":
            bad = c["plain_row_counts_differ"]
            plain = (f"rows depend on the row count at {len(bad)} of {len(ROW_COUNTS)} counts "
                     f"({', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''})" if bad
                     else "rows did not depend on the row count here")
        lines.append(f"{c['kind']:<10} {c['dtype']:<5} {c['shape']:<26} {verdict:<18} {cost:>6}  {plain}")
    lines += ["", (f"the guarantee holds here: SP output = one device, bit for bit, with --deterministic ({_POLICY})"
                   if r["holds"] else "the guarantee does NOT hold on these kernels: compare SP outputs within "
                   "tolerance (docs/determinism.md)"),
              "cost = deterministic / plain CPU time of that call alone (2048 rows; a 64x64 conv); "
              "end-to-end figures: ditsp bench determinism",
              f"CPU allocator ({cpu_malloc.ENV}): {r['cpu_malloc']}"]
    return "\n".join(lines)
