"""`ditsp bench transport`: the all-to-all transport under two policies, same argv, side by side.

    ditsp bench transport [--sp 2] [--policies off,chunked] [--capacity-mib 8,2]
                          [--tokens 32768,131072,250000] [--heads 4] [--head-dim 16] [--dtype bf16]
                          [--window-grid 5,135,240] [--window-width 64] [--repeats 5]

Cases: a Ulysses transport (Q, K, V sequence -> head shards, one exchange
each, then the output head -> sequence shards; no attention compute) at each
``--tokens``, and one
window-SP transition (regular -> shifted SeedVR2 layout) of ``--window-grid``
(5 x 135 x 240 is five latent frames of a 4K video). Each policy runs on the
same ranks, interleaved repeat by repeat, on a fresh Comm so the first call
pays the agreement. Per case and policy it reports the host-to-completion
latency of the first call (agreement included) and the median of the rest,
the agreement's own time and its share of a call, bytes and calls per call,
the staging peak (the transport's counter) and the process RSS peak added by
one call (busiest rank). Writes markdown to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ..argtypes import positive_int, positive_int_list

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("transport", help="all-to-all transport policies side by side (latency, bytes, peak memory)")
    p.add_argument("--sp", type=positive_int, default=2)
    p.add_argument("--policies", default="off,chunked", help="two or more of off, auto, chunked")
    p.add_argument("--capacity-mib", default="8,2",
                   help="staging capacity per rank (MiB); several (comma-separated) run chunked/auto once each")
    p.add_argument("--tokens", type=positive_int_list, default=[32768, 131072, 250000])
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--window-grid", default="5,135,240", help="T,H,W post-patch grid of the window case ('' = none)")
    p.add_argument("--window-width", type=positive_int, default=64, help="channels per token row")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", default="benchmarks/results/transport.md")
    p.set_defaults(func=main)
    return p


def _variants(cfg: dict) -> list[tuple[str, str, int]]:
    """(label, policy, capacity) per column: off once, chunked/auto once per capacity."""
    out = []
    for policy in cfg["policies"]:
        caps = cfg["capacities"][:1] if policy == "off" else cfg["capacities"]
        for c in caps:
            label = policy if policy == "off" or len(caps) == 1 else f"{policy} {c / 2**20:g} MiB"
            out.append((label, policy, c))
    return out


def _barrier(comm):
    import torch

    comm.all_reduce(torch.zeros(1), kind="bench_barrier")


def _ulysses_case(ctx, tokens: int, heads: int, head_dim: int, dtype):
    import torch

    from ..attention.common import even_splits
    from ..attention.ulysses import head_plan, to_heads, to_seq

    lens = even_splits(tokens, ctx.world_size)
    g = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (torch.randn(1, lens[ctx.rank], heads, head_dim, generator=g).to(dtype) for _ in range(3))
    plan = head_plan(heads, heads, ctx.world_size)

    def call(link):
        hq, hk, hv = to_heads(link, plan, lens, q, k, v)
        return to_seq(link, plan, lens, hq)

    return call


def _window_case(ctx, grid, width: int, dtype):
    import torch

    from ..models.seedvr2.nadit.config import PRESETS
    from ..windows.exchange import exchange
    from ..windows.schedule import plan_schedule

    cfg = next(c for c in PRESETS.values() if c.name.startswith("seedvr2") and "7b" not in c.name)
    methods = list(dict.fromkeys(cfg.window_methods))[:2]
    sched = plan_schedule(grid, methods, ctx.world_size, "lpt", cfg.num_windows)
    t = sched.transition_between(methods[0], methods[1])
    rows = int(t.counts[ctx.rank].sum())
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(ctx.rank)).to(dtype)
    return lambda link: exchange(x, t, link)


def rank_bench(ctx, cfg: dict) -> list[dict]:
    import torch

    from ..distributed import transport as tp
    from ..distributed.comm import Comm
    from ..memory import PeakMemory

    torch.set_num_threads(cfg["threads"])
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    cases = [(f"ulysses {n // 1024 if n % 1024 == 0 else n / 1000:g}k tokens", n, _ulysses_case(ctx, n, cfg["heads"], cfg["head_dim"], dtype))
             for n in cfg["tokens"]]
    if cfg["window_grid"]:
        grid = tuple(cfg["window_grid"])
        cases.append((f"window {grid[0]}x{grid[1]}x{grid[2]}", grid[0] * grid[1] * grid[2],
                      _window_case(ctx, grid, cfg["window_width"], dtype)))
    rows = []
    peak_mem = PeakMemory(ctx.device)
    for name, tokens, call in cases:
        links = {label: tp.Transport(Comm(ctx.group), tp.TransportSettings(policy=policy, capacity_bytes=capacity))
                 for label, policy, capacity in _variants(cfg)}
        res = {p: {"times": [], "rss": []} for p in links}
        for i in range(cfg["repeats"] + 1):  # call 0 pays the agreement
            for policy, link in links.items():
                comm = link.comm
                comm.stats.reset()
                comm.staging_peak(reset=True)
                link.used.clear()
                _barrier(comm)
                peak_mem.start()
                t0 = time.perf_counter()
                out = call(link)
                dt = time.perf_counter() - t0
                r = res[policy]
                r["rss"].append(peak_mem.peak_added())
                del out
                if i == 0:
                    r["first"] = dt
                else:
                    r["times"].append(dt)
                st = comm.stats.as_dict()
                r["sent"] = sum(v["bytes_sent"] for k, v in st.items() if k.startswith(("ulysses", "window")))
                r["calls"] = sum(v["calls"] for k, v in st.items() if k.startswith(("ulysses", "window")))
                r["staging"] = comm.staging_peak()
                r["report"] = link.report()
                r["used"] = "+".join(f"{p}x{n}" for p, n in sorted(link.used.items()))
        # The agreement alone: the same small all-gather the transport issues on a new key.
        c = next(iter(links.values())).comm
        n_ints = len(tp._FIXED) + 2 * ctx.world_size  # the transport's agreement vector
        c.all_gather_ints([0] * n_ints)
        _barrier(c)
        t0 = time.perf_counter()
        for _ in range(20):
            c.all_gather_ints([0] * n_ints)
        agree_s = (time.perf_counter() - t0) / 20
        for policy in links:
            r = res[policy]
            rows.append({"case": name, "tokens": tokens, "policy": policy, "first": r["first"],
                         "median": statistics.median(r["times"]), "min": min(r["times"]), "agree": agree_s,
                         "sent": r["sent"], "calls": r["calls"], "staging": r["staging"],
                         "rss": max(r["rss"][1:] or r["rss"]), "chunks": r["report"].get("chunks", 1),
                         "used": r["used"], "times": r["times"]})
    return rows


def run_bench(cfg: dict, cluster=None) -> list[dict]:
    from ..distributed.dispatch import dispatch

    res = dispatch(rank_bench, cfg, sp=cfg["sp"], threads=cfg["threads"], cluster=cluster)
    merged = []
    for j, row in enumerate(res[0]):  # the busiest rank per figure
        m = dict(row)
        for key in ("first", "agree", "sent", "calls", "staging", "rss"):
            m[key] = max(r[j][key] for r in res)
        # a call ends with its slowest rank: per repeat the slowest rank, then median / min over repeats
        m["times"] = [max(r[j]["times"][i] for r in res) for i in range(len(row["times"]))]
        m["median"], m["min"] = statistics.median(m["times"]), min(m["times"])
        merged.append(m)
    return merged


def paired_ratio(times, base_times) -> float:
    """Median over repeats of time / baseline time of the same repeat (the two ran back to back)."""
    return statistics.median(t / b for t, b in zip(times, base_times))


def format_table(rows: list[dict], cfg: dict) -> str:
    mib = 2**20
    first = _variants(cfg)[0][0]
    base = {r["case"]: r for r in rows if r["policy"] == first}
    lines = [
        f"`ditsp bench transport --sp {cfg['sp']} --policies {','.join(cfg['policies'])} "
        f"--capacity-mib {','.join(f'{c / mib:g}' for c in cfg['capacities'])} --tokens {','.join(map(str, cfg['tokens']))} "
        f"--heads {cfg['heads']} --head-dim {cfg['head_dim']} --dtype {cfg['dtype']} "
        f"--window-grid {','.join(map(str, cfg['window_grid'])) if cfg['window_grid'] else ''} "
        f"--window-width {cfg['window_width']} --repeats {cfg['repeats']}`",
        "",
        "| case | policy (used x transport calls) | first call ms (incl. agreement) | median ms | min ms | vs "
        f"{first} (median of paired ratios) | agreement ms (% of median) | MiB sent | calls | staging peak MiB | RSS peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        b = base[r["case"]]
        lines.append(
            f"| {r['case']} | {r['policy']} ({r['used']}) | {r['first'] * 1e3:.1f} | "
            f"{r['median'] * 1e3:.1f} | {r['min'] * 1e3:.1f} | {paired_ratio(r['times'], b['times']):.3f} | {r['agree'] * 1e3:.2f} "
            f"({100 * r['agree'] / r['median']:.2f}%) | {r['sent'] / mib:.1f} | {r['calls']} | "
            f"{r['staging'] / mib:.1f} | {r['rss'] / mib:.0f} |")
    lines += ["", "Busiest rank per column (latency: the slowest rank of each repeat; ratio: the median over repeats of "
              "the policy's time over the first column's in the same repeat, run back to back). Latency: host to "
              "completion of one call (Ulysses: Q/K/V in and the "
              "output back); the first call includes the agreement (one small all-gather per new key), later "
              "calls reuse it. Staging peak: the transport's own buffers, which hold crossing rows only (a rank's "
              "own rows are copied into place): a send stage where rows must be packed (two when chunks are "
              "pipelined) and a receive stage where they must be scattered; none where rows lie contiguous. "
              "RSS peak: what one call added to the process (outputs included)."]
    return "\n".join(lines)


def main(args, parser=None) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("off", "auto", "chunked")]
    if bad or len(policies) < 2:
        msg = f"--policies needs two or more of off, auto, chunked, got {args.policies!r}"
        if parser is not None:
            parser.error(msg)
        raise SystemExit(msg)
    grid = [int(v) for v in args.window_grid.split(",")] if args.window_grid.strip() else []
    try:
        capacities = [int(float(v) * 2**20) for v in str(args.capacity_mib).split(",") if v.strip()]
    except ValueError:
        capacities = []
    if not capacities or min(capacities) < 1:
        msg = f"--capacity-mib needs positive numbers (MiB), got {args.capacity_mib!r}"
        if parser is not None:
            parser.error(msg)
        raise SystemExit(msg)
    cfg = {"sp": args.sp, "policies": policies, "capacities": capacities, "tokens": args.tokens,
           "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "window_grid": grid,
           "window_width": args.window_width, "repeats": args.repeats, "threads": args.threads}
    table = format_table(run_bench(cfg), cfg)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("# All-to-all transport: policies side by side\n\n" + table + "\n")
    print(f"-> {args.out}")
    return 0
