"""VAE benchmark: encode/decode time and per-rank peak memory, one device vs SP ranks, side by side.

Runs a reduced-width VAE of the released structure on local gloo CPU ranks at a 720p-like frame
(the frame is scaled down with the widths so the default run takes a few minutes on 2 cores),
checks the memory model against measured peaks, compares tiled (approximate) with exact output
and draws a seam picture. Results: ``benchmarks/results/vae.md`` and ``vae-seams.png``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from ..distributed.comm import Comm
from ..distributed.launcher import LocalCluster
from ..fixed_shape import current
from ..memory import PeakMemory
from ..models.seedvr2.vae import RELEASED
from ..models.seedvr2.vae.fixtures import seeded_vae
from ..models.seedvr2.vae.memory import backend_of, estimate
from ..models.seedvr2.vae.sharded import ParallelVAE
from . import declare


def _exact_rss() -> None:
    """Make every allocation above 64 KiB its own mapping (glibc), so freed memory leaves RSS and
    VmHWM measures what a region really holds at once, not what the allocator kept from before."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except Exception:  # noqa: BLE001 - not glibc: measure as is
        pass


def _cfg(widths):
    return RELEASED.with_widths(widths, groups=8)


def _clip(T, H, W):
    g = torch.Generator().manual_seed(0)
    return torch.rand(1, 3, T, H, W, generator=g) * 2 - 1


def rank_bench(ctx, widths, T, H, W, mode, chunk, repeats):
    """Time and peak of encode and decode on this rank; the output of rank 0 for the parity check."""
    torch.set_num_threads(1)
    _exact_rss()
    vae = seeded_vae(_cfg(widths))
    comm = Comm(ctx.group) if ctx.world_size > 1 else None
    pv = ParallelVAE(vae, comm, chunk=chunk)
    x = _clip(T, H, W)
    out = {}
    z = None
    for op in ("encode", "decode"):
        times, cpus, peak = [], [], PeakMemory(torch.device("cpu"))
        for i in range(repeats + 1):
            if i == 1:
                peak.start()
            t0, c0 = time.perf_counter(), time.thread_time()
            if op == "encode":
                z = pv.encode(x, mode=mode).posterior.mean
                res = z
            else:
                res = pv.decode(z, mode=mode)
            if i >= 1:
                times.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
        out[op] = (min(times), peak.peak_added(), res if ctx.rank == 0 else None, min(cpus))
    return out


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--widths", default="16,32,32,32", help="reduced widths (released 128,256,512,512)")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--height", type=int, default=144, help="720p-like frame, scaled (16:9)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sp", default="2,4")
    p.add_argument("--out", default="benchmarks/results")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    """``ditsp bench vae``."""
    return declare(sub, "vae", "VAE encode/decode time and per-rank peak memory: one device vs SP modes", __doc__,
                   _arguments, main)


def main(args=None, parser=None) -> int:
    """Run the benchmark; ``args`` is the parsed namespace (CLI) or an argv list (``None``: sys.argv)."""
    a = args if isinstance(args, argparse.Namespace) else \
        _arguments(argparse.ArgumentParser(prog="ditsp bench vae", description=__doc__)).parse_args(args)
    widths = tuple(int(v) for v in a.widths.split(","))
    T, H, W = a.frames, a.height, a.width
    sps = [int(s) for s in a.sp.split(",")]
    rows = []
    runs = [(1, "replicated", None), (1, "chunked", 1)]
    for n in sps:
        runs += [(n, "time", None), (n, "height", None), (n, "height+chunks", 1)]
    ref = None
    for n, mode, chunk in runs:
        if n == 1:
            res = [rank_bench(type("C", (), {"rank": 0, "world_size": 1, "group": None})(), widths, T, H, W, mode,
                              chunk or 1, a.repeats)]
        else:
            with LocalCluster(n, timeout_s=600, threads=1) as c:
                res = c.run(rank_bench, widths, T, H, W, mode, chunk or 1, a.repeats)
        r0 = res[0]
        if ref is None:
            ref = r0
        errs = {op: ((r0[op][2] - ref[op][2]).abs().max() / ref[op][2].abs().max()).item() for op in ("encode", "decode")}
        for op in ("encode", "decode"):
            model = estimate(_cfg(widths), op, (T, H, W), n, mode, torch.float32, chunk or 1, gather=True,
                             backend=backend_of("cpu", current().deterministic))
            model_bytes = model.total - model.weights  # the weights are resident before the measured region
            peak = max(r[op][1] for r in res)
            cpu = max(r[op][3] for r in res)
            rows.append((op, mode, n, r0[op][0], ref[op][0] / r0[op][0], cpu, cpu / ref[op][3], peak, model_bytes,
                         peak / max(model_bytes, 1) - 1, errs[op]))
        print(rows[-2], rows[-1], flush=True)
    # tiled vs exact on one device
    vae = seeded_vae(_cfg(widths))
    x = _clip(1, H, W)
    exact_m = ParallelVAE(vae).encode(x, mode="replicated").posterior.mean
    exact_d = ParallelVAE(vae).decode(exact_m, mode="replicated")
    tile_rows = []
    for tile, ov in ((8, 2), (8, 4), (12, 4)):
        pv = ParallelVAE(vae, tile=tile, overlap=ov)
        tm = pv.encode(x, mode="tiled").posterior.mean
        td = pv.decode(exact_m, mode="tiled")
        tile_rows.append((tile, ov, ((tm - exact_m).abs().max() / exact_m.abs().max()).item(),
                          ((td - exact_d).abs().max() / exact_d.abs().max()).item(), td))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# VAE benchmark (CPU, gloo, 1 thread per rank)", "",
             f"Reduced-width VAE of the released structure, widths {widths}, 8 groups, fp32; clip {T}x{H}x{W} "
             f"(720p-like 16:9 frame scaled down); best of {a.repeats} after a warm-up. Load average when the run "
             f"started: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared machine makes SP ranks wait for "
             "each other's time slices: compare the CPU columns, which count only this rank's own work).", "",
             "| op | mode | SP | time s | speed-up vs 1 device | CPU s per rank (max) | CPU vs 1 device | peak per rank MiB (measured) "
             "| model MiB | model error | max rel diff vs 1 device |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for op, mode, n, t, sp, cpu, cpu_ratio, peak, mb, me, err in rows:
        lines.append(f"| {op} | {mode} | {n} | {t:.2f} | {sp:.2f} | {cpu:.2f} | {cpu_ratio:.2f} | {peak / 2**20:.1f} "
                     f"| {mb / 2**20:.1f} | {me:+.0%} | {err:.1e} |")
    lines += ["", "Model error = measured / modelled - 1 (activations, carried tails, clip tensors; weights excluded "
              "because they are resident before the measured region).", "",
              "## Tiled (APPROXIMATE) vs exact, one image", "",
              "| tile (latent) | overlap | encode max rel err | decode max rel err |", "| --- | --- | --- | --- |"]
    for tile, ov, e1, e2, _ in tile_rows:
        lines.append(f"| {tile} | {ov} | {e1:.3f} | {e2:.3f} |")
    lines += ["", "## Memory model, released widths, bf16, decode of 81 frames (GiB per rank, output kept as slabs)", "",
              "| resolution | SP | replicated | chunked | time | height | height+chunks | tiled |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, shape in (("720p", (81, 720, 1280)), ("1080p", (81, 1072, 1920)), ("4K", (81, 2160, 3840))):
        for n in (1, 2, 4, 8):
            cells = []
            for mode in ("replicated", "chunked", "time", "height", "height+chunks", "tiled"):
                if n == 1 and mode in ("time", "height", "height+chunks"):
                    cells.append("-")
                    continue
                cells.append(f"{estimate(RELEASED, 'decode', shape, n, mode, gather=False).total / 2**30:.1f}")
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "4K 81-frame decode at SP=8, height+chunks:", "",
              "    " + estimate(RELEASED, "decode", (81, 2160, 3840), 8, "height+chunks", gather=False).row()]
    (out / "vae.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        td = tile_rows[0][4]
        fig, ax = plt.subplots(1, 3, figsize=(12, 3))
        ax[0].imshow((exact_d[0, :, 0].permute(1, 2, 0).clamp(-1, 1) + 1) / 2)
        ax[0].set_title("exact decode")
        ax[1].imshow((td[0, :, 0].permute(1, 2, 0).clamp(-1, 1) + 1) / 2)
        ax[1].set_title(f"tiled (tile {tile_rows[0][0]}, overlap {tile_rows[0][1]})")
        im = ax[2].imshow((td - exact_d)[0, :, 0].abs().amax(0), cmap="magma")
        ax[2].set_title("|tiled - exact|: seams")
        fig.colorbar(im, ax=ax[2])
        for a_ in ax:
            a_.axis("off")
        fig.tight_layout()
        fig.savefig(out / "vae-seams.png", dpi=90)
    except Exception as e:  # noqa: BLE001 - the picture is optional
        print("no picture:", e)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
