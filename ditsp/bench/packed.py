"""`ditsp bench packed`: packed multi-request sequences under SP, side by side on local ranks.

Global attention: one packed stream (many short documents and one long one,
causal and bidirectional mixed) at one SP degree, every strategy on the same
ranks with iterations interleaved (round robin): the document-unaware ring
(``ditsp.attention.ring``: contiguous shards, whole shards around the ring,
attention across documents), the document-aware ring without skipping
(contiguous shards, whole shards moved, blocks masked per document), the
document-aware ring with area-weighted or zigzag dispatch (only shared
document ranges move and compute), and packed Ulysses. Time is the slowest
rank's, median over iterations; bytes are the busiest rank's for one call;
imbalance is max/mean per-rank attention area.

Window SP: N small SeedVR2 requests run as one packed forward vs one by one
(each with its own window-SP runtime) at the same SP degree, interleaved.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from ..argtypes import nonneg_int, positive_int

RESULTS = os.path.join("benchmarks", "results", "packed.md")


def doc_mix(short: int, long: int, seed: int = 0):
    """``short`` documents of 16-128 tokens (every third causal) and one causal document of ``long`` tokens."""
    from ..attention.packed import PackedDocs

    g = torch.Generator().manual_seed(seed)
    lens = [int(v) for v in torch.randint(16, 129, (short,), generator=g)]
    causal = [i % 3 == 0 for i in range(short)]
    mid = short // 2
    return PackedDocs.from_lengths(lens[:mid] + [long] + lens[mid:], causal[:mid] + [True] + causal[mid:])


STRATS = ("ring-unaware", "ring-doc-noskip", "ring-area", "ring-zigzag", "ulysses-packed")


def rank_attention(ctx, cfg: dict) -> dict:
    from ..attention.packed import dispatch, packed_ring_attention, packed_ulysses_attention
    from ..attention.ring import ring_attention
    from ..distributed.comm import Comm

    docs = doc_mix(cfg["short"], cfg["long"])
    P, H, D = ctx.world_size, cfg["heads"], cfg["head_dim"]
    torch.manual_seed(ctx.rank)
    mode = {"ring-unaware": "contiguous", "ring-doc-noskip": "contiguous", "ring-area": "area",
            "ring-zigzag": "zigzag", "ulysses-packed": "contiguous"}
    inputs = {}
    for s in STRATS:
        n = dispatch(docs, P, mode[s]).rank_lens[ctx.rank]
        inputs[s] = [torch.randn(n, H, D, requires_grad=cfg["backward"]) for _ in range(3)]
    comms = {s: Comm.of(ctx.group) for s in STRATS}
    sync = Comm.of(ctx.group)
    lens = dispatch(docs, P, "contiguous").rank_lens
    scale = 1.0 / math.sqrt(D)

    def call(s):
        q, k, v = inputs[s]
        c = comms[s]
        if s == "ring-unaware":
            t = [x.transpose(0, 1)[None] for x in (q, k, v)]
            out = ring_attention(c, *t, lens, scale)
        elif s == "ulysses-packed":
            out = packed_ulysses_attention(c, q, k, v, docs)
        else:
            out = packed_ring_attention(c, q, k, v, docs, mode[s], skip=s != "ring-doc-noskip")
        if cfg["backward"]:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    times = {s: [] for s in STRATS}
    stats = {}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for s in STRATS:
            sync.all_reduce(torch.zeros(1))
            comms[s].stats.reset()
            t0 = time.perf_counter()
            call(s)
            if it >= cfg["warmup"]:
                times[s].append(time.perf_counter() - t0)
            st = comms[s].stats
            stats[s] = (st.bytes_sent, st.bytes_recv, st.calls)
    return {"times": times, "stats": stats}


def attention_table(cfg: dict) -> str:
    from ..attention.packed import dispatch, ring_schedule
    from ..distributed.launcher import launch

    res = launch(rank_attention, cfg["sp"], cfg, timeout_s=1800.0)
    docs = doc_mix(cfg["short"], cfg["long"])
    P = cfg["sp"]
    imb = {"ring-unaware": None,  # computes every query-key pair: balanced, but across documents
           "ring-doc-noskip": dispatch(docs, P, "contiguous").imbalance,
           "ring-area": dispatch(docs, P, "area").imbalance, "ring-zigzag": dispatch(docs, P, "zigzag").imbalance,
           "ulysses-packed": 1.0}
    skipped = {"ring-doc-noskip": ring_schedule(docs, P, "contiguous", False).pairs_skipped(),
               "ring-area": ring_schedule(docs, P, "area").pairs_skipped(),
               "ring-zigzag": ring_schedule(docs, P, "zigzag").pairs_skipped()}
    rows = []
    for s in STRATS:
        per_iter = [max(r["times"][s][i] for r in res) for i in range(cfg["iters"])]
        sent, recv, calls = (max(r["stats"][s][j] for r in res) for j in range(3))
        rows.append((s, 1e3 * statistics.median(per_iter), sent / 2**20, recv / 2**20, calls))
    base = rows[0][1]
    what = "forward+backward" if cfg["backward"] else "forward"
    lines = [f"packed attention {what}: sp={P}, {docs.num_docs} documents ({cfg['short']} of 16-128 tokens, "
             f"every third causal, + one causal of {cfg['long']}), {docs.total} tokens, heads={cfg['heads']} "
             f"head_dim={cfg['head_dim']} fp32, median of {cfg['iters']} after {cfg['warmup']} warm-up, 1 thread/rank",
             "",
             "| strategy | ms/call | vs unaware ring | MiB sent | MiB recv | calls | pairs skipped | imbalance (area) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s, ms, se, rc, calls in rows:
        sk = skipped.get(s, "-")
        lines.append(f"| {s} | {ms:.1f} | {ms / base:.2f}x | {se:.2f} | {rc:.2f} | {calls} | {sk} | {'-' if imb[s] is None else f'{imb[s]:.3f}'} |")
    lines.append("")
    lines.append("ring-unaware attends across documents (the cost of ignoring the packing, wrong output); "
                 "every other row is exact per document. Bytes: one call, busiest rank.")
    return "\n".join(lines)


# -- window SP ------------------------------------------------------------------

WINDOW_GRIDS = [(2, 8, 12), (1, 10, 14), (3, 6, 8), (1, 6, 10), (2, 10, 10), (1, 8, 8)]


def rank_window(ctx, cfg: dict) -> dict:
    from ..distributed.comm import Comm
    from ..models.seedvr2.nadit.model import build_model, random_inputs
    from ..models.seedvr2.packed import packed_forward, packed_runtime
    from ..models.seedvr2.parallelize import parallelize
    from ..config import ParallelConfig

    model = build_model(cfg["model"])
    grids = WINDOW_GRIDS[: cfg["requests"]]
    reqs = []
    for i, g in enumerate(grids):
        vid, txt = random_inputs(model.cfg, g, seed=i)
        reqs.append((vid, txt, 500.0))
    pc = ParallelConfig.window(ctx.world_size, window_planner=cfg["planner"], window_path="window")
    sync = Comm.of(ctx.group)
    times = {"packed": [], "one-by-one": []}
    imb = {}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for name in times:
            sync.all_reduce(torch.zeros(1))
            t0 = time.perf_counter()
            if name == "packed":
                rt = packed_runtime(model, grids, [t.shape[0] for _, t, _ in reqs], Comm.of(ctx.group), cfg["planner"])
                packed_forward(model, reqs, rt)
                imb["packed"] = max(rt.imbalance().values())
            else:
                worst = 0.0
                for (vid, txt, ts), g in zip(reqs, grids):
                    rt1 = parallelize(model.cfg, pc, g, ctx.group)
                    with torch.no_grad():
                        model(vid, txt, ts, rt1)
                    worst = max(worst, max(p.imbalance for p in rt1.schedule.plans.values()))
                imb["one-by-one"] = worst
            if it >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "imbalance": imb}


def window_table(cfg: dict) -> str:
    from ..distributed.launcher import launch

    res = launch(rank_window, cfg["sp"], cfg, timeout_s=1800.0)
    ms = {n: 1e3 * statistics.median([max(r["times"][n][i] for r in res) for i in range(cfg["iters"])])
          for n in ("packed", "one-by-one")}
    imb = res[0]["imbalance"]
    grids = WINDOW_GRIDS[: cfg["requests"]]
    lines = [f"packed window SP: {cfg['requests']} SeedVR2 requests ({cfg['model']}, grids "
             f"{', '.join('x'.join(map(str, g)) for g in grids)}) at sp={cfg['sp']}, planner {cfg['planner']}, "
             f"median of {cfg['iters']} after {cfg['warmup']} warm-up, 1 thread/rank",
             "",
             "| path | ms for all requests | requests/s | speed-up | plan imbalance (tokens, worst layout) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for n in ("one-by-one", "packed"):
        lines.append(f"| {n} | {ms[n]:.1f} | {1e3 * cfg['requests'] / ms[n]:.2f} | "
                     f"{ms['one-by-one'] / ms[n]:.2f}x | {imb[n]:.3f} |")
    lines.append("")
    lines.append("one-by-one: the worst imbalance over the requests' own plans; packed: one plan for all requests.")
    return "\n".join(lines)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    cfg = {"sp": args.sp, "short": args.short, "long": args.long, "heads": args.heads, "head_dim": args.head_dim,
           "backward": args.backward, "warmup": args.warmup, "iters": args.iters, "requests": args.requests,
           "model": args.model, "planner": args.planner}
    if not 1 <= args.requests <= len(WINDOW_GRIDS):
        (parser.error if parser else ValueError)(f"--requests must be 1..{len(WINDOW_GRIDS)}")
    parts = []
    if args.part in ("all", "attention"):
        parts.append(attention_table(cfg))
    if args.part in ("all", "window"):
        parts.append(window_table({**cfg, "sp": args.window_sp}))
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("# Packed multi-request sequences under SP\n\nWritten by `ditsp bench packed`.\n\n" + text + "\n")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("packed", help="packed documents / requests under SP vs document-unaware and one by one")
    p.add_argument("--part", choices=("all", "attention", "window"), default="all")
    p.add_argument("--sp", type=positive_int, default=4, help="ranks for the global-attention part")
    p.add_argument("--window-sp", type=positive_int, default=2, help="ranks for the window-SP part")
    p.add_argument("--short", type=positive_int, default=24, help="short documents")
    p.add_argument("--long", type=positive_int, default=2048, help="tokens of the long document")
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=32)
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--requests", type=positive_int, default=6, help="window-SP requests packed")
    p.add_argument("--model", default="tiny", help="SeedVR2 preset for the window part")
    p.add_argument("--planner", default="lpt", choices=("lpt", "locality"))
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--out", default=RESULTS, help=f"markdown file to write (default {RESULTS}; '' to skip)")
    p.set_defaults(func=main)
    return p
