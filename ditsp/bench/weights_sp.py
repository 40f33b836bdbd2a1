"""`ditsp bench weights-sp`: an SP group loading one 7B-shaped DiT file, every rank reading it vs one reader.

The file is the one ``ditsp bench weights`` generates (the 7B's names and shapes, ``--layers``
blocks, seeded values), in each of ``--formats``. For SP 1/2/4 (``--sp``) and both reads of
``ditsp/weights/shared.py`` (every rank from its own memory map; one reader sending the others
each tensor as stored over gloo), a fresh group of local ranks loads it into a meta-built DiT.
Per rank: the load's seconds (from a barrier to the end of its load; the group's time is the
slowest rank's), the peak of its own (anonymous) memory, sampled every millisecond, and its RSS
high-water mark, which also counts the file pages its maps touched (page cache, shared by the
host). ``--cache cold`` evicts the file's pages first (``posix_fadvise(DONTNEED)``), ``warm``
reads it once first. A table goes to benchmarks/results/weights_sp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from .weights import GiB

RESULTS = os.path.join("benchmarks", "results", "weights_sp.md")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("weights-sp", help="an SP group loading a 7B-shaped DiT: every rank reads vs one reader")
    p.add_argument("--model", default="seedvr2-7b")
    p.add_argument("--layers", type=int, default=2, help="blocks of the model to generate (the 7B has 36)")
    p.add_argument("--formats", default="bf16,Q8_0")
    p.add_argument("--sp", default="1,2,4")
    p.add_argument("--cache", default="warm,cold", help="page cache state before each load: warm, cold or both")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder, removed)")
    p.add_argument("--out", default=RESULTS)
    p.set_defaults(func=main)
    return p


def rank_load(ctx, path: str, model: str, layers: int, read: str) -> dict:
    """One rank's load of ``path`` with ``read``; its time and memory (see the module doc)."""
    import torch

    from ..distributed.comm import Comm, CommStats
    from ..memory import exact_cpu_peaks
    from ..models.seedvr2.nadit.checkpoint import load_checkpoint
    from ..models.seedvr2.nadit.config import get_config
    from ..models.seedvr2.nadit.model import NaDiT
    from ..weights import held_bytes
    from .weights import LoadPeaks

    exact_cpu_peaks()
    torch.set_num_threads(1)
    with torch.device("meta"):
        net = NaDiT(get_config(model, layers))
    stats = CommStats()
    comm = Comm.of(ctx.group if ctx.world_size > 1 else None, stats)
    with LoadPeaks() as mem:
        comm.barrier()
        t0 = time.perf_counter()
        load_checkpoint(net, path, dtype=torch.bfloat16, comm=comm, read=read)
        secs = time.perf_counter() - t0
    wire = stats.kinds["weights"] if "weights" in stats.kinds else None
    return {"rank": ctx.rank, "seconds": secs, "peak_anon": mem.peak_anon, "peak_rss": mem.peak_rss,
            "file_pages": mem.file_pages,
            "kept": held_bytes(net), "wire_sent": wire.bytes_sent if wire else 0,
            "wire_recv": wire.bytes_recv if wire else 0, "calls": stats.calls}


def _cache(path: str, state: str) -> None:
    with open(path, "rb") as f:
        if state == "cold":
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while f.read(1 << 24):
                pass


def main(args: argparse.Namespace, parser=None) -> int:
    import torch

    from ..distributed.launcher import launch
    from ..weights.shared import DEFAULT_READ, READS
    from .weights import write_file

    formats = [f for f in args.formats.split(",") if f]
    degrees = [int(s) for s in args.sp.split(",") if s]
    caches = [c for c in args.cache.split(",") if c]
    tmp = None
    folder = args.dir
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="ditsp-bench-weights-sp-")
        folder = tmp.name
    os.makedirs(folder, exist_ok=True)
    rows = []
    load_before = os.getloadavg()[0]
    try:
        for fmt in formats:
            path = write_file(fmt, folder, args.model, args.layers)
            for cache in caches:
                for sp in degrees:
                    for read in (READS if sp > 1 else READS[:1]):
                        _cache(path, cache)
                        ranks = launch(rank_load, sp, path, args.model, args.layers, read, timeout_s=1800)
                        r = {"fmt": fmt, "cache": cache, "sp": sp, "read": read, "file": os.path.getsize(path),
                             "ranks": ranks}
                        rows.append(r)
                        print(json.dumps({k: v for k, v in r.items() if k != "ranks"}
                                         | {"seconds": [round(x["seconds"], 2) for x in ranks],
                                            "peak_anon_gib": [round(x["peak_anon"] / GiB, 2) for x in ranks],
                                            "peak_rss_gib": [round(x["peak_rss"] / GiB, 2) for x in ranks]}),
                              flush=True)
            os.remove(path)
    finally:
        if tmp is not None:
            tmp.cleanup()
    cap = torch.__config__.show().split("CPU capability usage:")[-1].splitlines()[0].strip()
    lines = [
        "# An SP group loading a 7B-shaped DiT: every rank reads vs one reader (`ditsp bench weights-sp`)",
        "",
        f"{args.model} tensor names and shapes, {args.layers} of 36 blocks (width 3072), seeded values, bf16 "
        f"compute; a fresh group of local gloo ranks per row (one thread each, {os.cpu_count()} cores on this "
        f"machine, CPU capability {cap}); *every-rank*: each rank copies the tensors out of its own memory map; "
        f"*one-reader*: rank 0 reads, the others receive each tensor as stored (`ditsp/weights/shared.py`). "
        f"*load s*: the slowest rank, from a barrier to its load's end; *peak anon*: a rank's own memory "
        f"(sampled every ms, every large allocation its own mapping); *peak RSS*: its high-water mark, which "
        f"also counts the file pages its maps touched (page cache, shared by the host); max over ranks, and "
        f"rank 0 / the others where they differ. *cold*: the file's pages evicted before the load "
        f"(`posix_fadvise(DONTNEED)`); *warm*: read once before. Default read: `{DEFAULT_READ}`. Load "
        f"average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end: other jobs "
        f"shared the cores, so compare rows of one run, and SP 4 on fewer cores is oversubscribed.",
        "",
        "| format | cache | SP | read | file GiB | kept GiB | load s | peak anon GiB (rank 0 / others) "
        "| peak RSS GiB (rank 0 / others) | received GiB (all ranks) |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def pair(ranks, key):
        first = ranks[0][key] / GiB
        others = [x[key] / GiB for x in ranks[1:]]
        return f"{first:.2f}" + (f" / {max(others):.2f}" if others else "")

    for r in rows:
        ranks = r["ranks"]
        lines.append(f"| {r['fmt']} | {r['cache']} | {r['sp']} | {r['read']} | {r['file'] / GiB:.2f} "
                     f"| {ranks[0]['kept'] / GiB:.2f} | {max(x['seconds'] for x in ranks):.1f} "
                     f"| {pair(ranks, 'peak_anon')} | {pair(ranks, 'peak_rss')} "
                     f"| {sum(x['wire_recv'] for x in ranks) / GiB:.2f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    text = "\n".join(lines) + "\n"
    with open(args.out + ".tmp", "w") as f:
        f.write(text)
    os.replace(args.out + ".tmp", args.out)
    print(text)
    return 0
