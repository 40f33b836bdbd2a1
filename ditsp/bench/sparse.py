"""`ditsp bench sparse`: adaptive sparse attention under Ulysses (imbalance, speed, quality).

Inputs that look like video attention (:func:`video_qkv`): per head, queries
and keys are random Fourier features of the token's grid position, so that
``q_i . k_j * scale ~= c_h * kernel(pos_i, pos_j)``:

- ``spatial`` heads: a Gaussian kernel over (h, w) inside a frame (frames far
  apart): local neighbourhoods;
- ``temporal`` heads: a kernel over time with (h, w) far apart: the same
  place in other frames;
- ``global`` heads: weak position dependence plus a shared sink direction that
  every query and the text keys carry: flat rows, many blocks to reach Top-p.

``c_h`` (concentration) and the kernel width vary per head, drawn from a
seeded generator; head types are drawn with probabilities (0.5, 0.3, 0.2).
Values are random. The same generator with the same seed gives the same
tensors on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.sparse import SparseConfig, SparseUlysses, block_layout, plan_migrations
from ..attention.sparse.block_sparse import block_sparse_attention
from ..attention.sparse.routing import route
from ..attention.ulysses import head_plan

TYPES = ("spatial", "temporal", "global")


def head_types(heads: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """(type, concentration, kernel width) per head."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(heads):
        t = TYPES[int(rng.choice(3, p=[0.5, 0.3, 0.2]))]
        out.append((t, float(rng.uniform(10.0, 60.0)), float(rng.uniform(1.5, 4.0))))
    return out


def video_qkv(grid, heads: int, head_dim: int, text_len: int = 0, batch: int = 1, seed: int = 0, noise: float = 0.3):
    """``q, k, v`` ``[B, text_len + T*H*W, heads, head_dim]`` (text first, video canonical) with head-varying structure."""
    T, H, W = grid
    g = torch.Generator().manual_seed(seed)
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    pos = torch.stack([t, h, w], -1).reshape(-1, 3).float()
    L, half = pos.shape[0], head_dim // 2
    qs, ks = [], []
    for typ, conc, width in head_types(heads, seed):
        if typ == "spatial":
            coords = pos * torch.tensor([30.0, 1.0, 1.0]) / width
        elif typ == "temporal":
            coords = pos * torch.tensor([1.0, 30.0, 30.0]) / width
        else:
            coords = pos / (8.0 * width)
        Wf = torch.randn(3, half, generator=g)
        bf = torch.rand(half, generator=g) * 2 * math.pi
        z = coords @ Wf + bf
        phi = torch.cat([z.cos(), z.sin()], -1) / math.sqrt(half)  # phi . phi ~= kernel, phi . phi(x) = 1
        phi_t = torch.randn(text_len, head_dim, generator=g) / math.sqrt(head_dim)
        if typ == "global":
            sink = torch.randn(head_dim, generator=g)
            sink = sink / sink.norm()
            phi = 0.5 * phi + 0.6 * sink
            phi_t = phi_t + 0.9 * sink
        base = torch.cat([phi_t, phi])
        qn = torch.randn(batch, base.shape[0], head_dim, generator=g) * noise / math.sqrt(head_dim)
        kn = torch.randn(batch, base.shape[0], head_dim, generator=g) * noise / math.sqrt(head_dim)
        qs.append(conc * math.sqrt(head_dim) * (base + qn))
        ks.append(base + kn)
    q, k = torch.stack(qs, 2), torch.stack(ks, 2)
    v = torch.randn(batch, text_len + L, heads, head_dim, generator=g)
    return q, k, v


def _rel_err(o, ref):
    o, ref = o.double(), ref.double()
    return float((o - ref).norm() / ref.norm()), float(F.cosine_similarity(o.flatten(), ref.flatten(), dim=0))


def _routing(q, k, grid, text_len, cfg):
    lay = block_layout(grid, cfg.cube, text_len)
    qb, kb = (lay.to_blocks(x.transpose(1, 2)) for x in (q, k))
    return lay, route(qb, kb, lay, cfg, q.shape[-1] ** -0.5)


def imbalance_rows(q, k, grid, text_len, top_ps, degrees, source):
    """Contiguous Ulysses head shards vs after migration (planning is pure: any degree on one process)."""
    rows = []
    H = q.shape[2]
    for tp in top_ps:
        cfg = SparseConfig(top_p=tp)
        lay, r = _routing(q, k, grid, text_len, cfg)
        rc = r.row_cost.transpose(0, 1).reshape(H, -1).numpy()  # [H, B*nb]
        density = float(rc.sum() / (q.shape[0] * H * lay.tokens ** 2))
        for P in degrees:
            p = plan_migrations(rc, head_plan(H, H, P).q, cfg)
            rows.append({"source": source, "top_p": tp, "density": density, "sp": P,
                         "naive": p.imbalance_before, "balanced": p.imbalance_after, "moves": len(p.moves),
                         "heads": len({m.head for m in p.moves}),
                         "moved_work": sum(m.cost for m in p.moves) / max(sum(p.loads_before), 1e-9)})
    return rows


def speed_quality_rows(q, k, v, grid, text_len, top_ps, iters):
    """One rank: dense SDPA vs block-sparse (both impls), interleaved; quality vs dense."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5
    rows, times = [], {"dense": []}
    with torch.no_grad():
        dense = F.scaled_dot_product_attention(qh, kh, vh)
        setups = {}
        for tp in top_ps:
            cfg = SparseConfig(top_p=tp)
            lay, r = _routing(q, k, grid, text_len, cfg)
            qb, kb, vb = (lay.to_blocks(x) for x in (qh, kh, vh))
            setups[tp] = (lay, r, qb, kb, vb)
            for impl in ("sdpa", "online"):
                times[(tp, impl)] = []
        for it in range(iters + 1):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(qh, kh, vh)
            if it:
                times["dense"].append(time.perf_counter() - t0)
            for tp, (lay, r, qb, kb, vb) in setups.items():
                for impl in ("sdpa", "online"):
                    t0 = time.perf_counter()
                    block_sparse_attention(qb, kb, vb, r.mask, lay.valid, scale, 32, 16, impl)
                    if it:
                        times[(tp, impl)].append(time.perf_counter() - t0)
        td = statistics.median(times["dense"])
        for tp, (lay, r, qb, kb, vb) in setups.items():
            t0 = time.perf_counter()
            out = lay.from_blocks(block_sparse_attention(qb, kb, vb, r.mask, lay.valid, scale))
            err, cos = _rel_err(out, dense)
            density = float(r.cost.sum() / (q.shape[0] * q.shape[2] * lay.tokens ** 2))
            rows.append({"top_p": tp, "density": density, "dense_s": td,
                         "sdpa_ratio": statistics.median(times[(tp, "sdpa")]) / td,
                         "online_ratio": statistics.median(times[(tp, "online")]) / td,
                         "rel_l2": err, "cos": cos})
    return rows


def rank_step(ctx, cfg: dict) -> dict:
    """SP step (sparse Ulysses attention) with and without balancing / slack, interleaved; outputs returned."""
    torch.set_num_threads(1)
    from ..attention.common import even_splits
    from ..distributed.comm import Comm

    q, k, v = video_qkv(cfg["grid"], cfg["heads"], cfg["head_dim"], cfg["text"], seed=cfg["seed"])
    T, P, r = cfg["text"], ctx.world_size, ctx.rank
    lens = even_splits(q.shape[1] - T, P)
    lo = T + sum(lens[:r])
    qs, ks, vs = (torch.cat([x[:, :T], x[:, lo : lo + lens[r]]], 1) for x in (q, k, v))
    variants = {
        "no balance": SparseConfig(top_p=cfg["top_p"], balance=False, slack=False),
        "slack only": SparseConfig(top_p=cfg["top_p"], balance=False, slack=True),
        "balance": SparseConfig(top_p=cfg["top_p"], balance=True, slack=False),
        "balance + slack": SparseConfig(top_p=cfg["top_p"], balance=True, slack=True),
    }
    attns = {n: SparseUlysses(ctx.group, cfg["grid"], c) for n, c in variants.items()}
    sync = Comm(ctx.group)
    times = {n: [] for n in attns}
    outs, reps = {}, {}
    with torch.no_grad():
        for it in range(cfg["iters"] + 1):
            for n, a in attns.items():
                sync.all_reduce(torch.zeros(1))
                t0 = time.perf_counter()
                outs[n] = a(qs, ks, vs, text_len=T, seq_lens=lens)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                slowest = max(float(x) for x in sync.all_gather_rows(dt, [1] * P, kind="timing"))
                if it:
                    times[n].append(slowest)
                reps[n] = a.reports[-1]
    return {"times": times, "outs": {n: o[:, T:] for n, o in outs.items()}, "text": {n: o[:, :T] for n, o in outs.items()},
            "reports": reps}


def global_dit_rows(grid, text_len, top_ps, dim=256, heads=8, seed=0):
    """The small global DiT's own attention at a video grid: routing imbalance and block output vs dense."""
    from ..models.global_dit import GlobalDiTBlock

    torch.manual_seed(seed)
    block = GlobalDiTBlock(dim, heads)
    L = math.prod(grid)
    t, h, w = torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij")
    # Smooth video-like tokens: low-frequency patterns of position plus noise.
    freqs = torch.randn(3, dim // 2) * 0.3
    z = torch.stack([t, h, w], -1).reshape(L, 3) @ freqs
    video = torch.cat([z.sin(), z.cos()], -1) + 0.1 * torch.randn(L, dim)
    x = torch.cat([torch.randn(text_len, dim), video])[None]
    rows, qk = [], {}

    def capture(q, k, v, **kw):
        qk["q"], qk["k"] = q, k
        from ..models.global_dit import sdpa_attention
        return sdpa_attention(q, k, v)

    with torch.no_grad():
        dense = block(x, attn=capture, text_len=text_len)
        for tp in top_ps:
            a = SparseUlysses(None, grid, SparseConfig(top_p=tp))
            y = block(x, attn=a, text_len=text_len)
            err, cos = _rel_err(y - x, dense - x)
            rows.append({"top_p": tp, "density": a.reports[-1]["density"], "rel_l2": err, "cos": cos})
    return rows, qk["q"], qk["k"]


def _md(rows, cols, fmt):
    head = "| " + " | ".join(c for c, _ in cols) + " |\n| " + " | ".join("---" if i == 0 else "---:" for i in range(len(cols))) + " |\n"
    return head + "".join("| " + " | ".join(fmt.get(key, "{}").format(r[key]) for _, key in cols) + " |\n" for r in rows)


def run(args) -> str:
    torch.set_num_threads(1)
    grid, H, D, T = tuple(args.grid), args.heads, args.head_dim, args.text
    q, k, v = video_qkv(grid, H, D, T, seed=args.seed)
    top_ps = args.top_p
    imb = imbalance_rows(q, k, grid, T, top_ps, (2, 4, 8), "generator")
    dit_rows, dq, dk = global_dit_rows(grid, T, top_ps)
    imb += imbalance_rows(dq, dk, grid, T, top_ps, (2, 4, 8), "global DiT")
    spq = speed_quality_rows(q, k, v, grid, T, top_ps, args.iters)

    from ..distributed.launcher import LocalCluster

    cfg = {"grid": list(grid), "heads": H, "head_dim": D, "text": T, "seed": args.seed, "top_p": args.sp_top_p,
           "iters": max(args.iters, 5)}
    with LocalCluster(2, timeout_s=1800, threads=1) as cl:
        res = cl.run(rank_step, cfg)
    with torch.no_grad():
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        dense = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)[:, T:]
    step = []
    base = statistics.median(res[0]["times"]["no balance"])
    for n in res[0]["times"]:
        out = torch.cat([r["outs"][n] for r in res], 1)
        err, cos = _rel_err(out, dense)
        reps = [r["reports"][n] for r in res]
        t = statistics.median(res[0]["times"][n])
        step.append({"variant": n, "time_s": t, "ratio": t / base, "imb_before": reps[0]["imbalance_before"],
                     "imb_after": reps[0]["imbalance_after"], "moves": reps[0]["moves"],
                     "mib": sum(x["bytes_moved"] for x in reps) / 2 / 2**20,
                     "filled": sum(x["slack_filled"] for x in reps) / max(sum(reps[0]["loads_after"]), 1e-9),
                     "rel_l2": err, "cos": cos})

    f3, f2 = "{:.3f}", "{:.2f}"
    md = [f"# `ditsp bench sparse`\n\nGenerated by `ditsp bench sparse` (see `ditsp/bench/sparse.py` for the input generator).\n"
          f"Video grid {grid} ({math.prod(grid)} tokens) + {T} text tokens, {H} heads x {D}, fp32, cube 4x4x4 "
          f"(64-token blocks), k_min 4, one compute thread per rank. Times are medians of {args.iters} interleaved "
          "iterations on a shared 2-core machine: read the ratios, not the seconds.\n",
          "## Load imbalance (max / mean selected work per rank), contiguous head shards vs after migration\n",
          _md(imb, [("inputs", "source"), ("top_p", "top_p"), ("density", "density"), ("SP", "sp"), ("naive", "naive"),
                    ("after migration", "balanced"), ("moves", "moves"), ("heads touched", "heads"),
                    ("work moved", "moved_work")],
              {"density": f3, "naive": f3, "balanced": f3, "moved_work": "{:.1%}", "top_p": f2}),
          "\n## One rank: block-sparse vs dense SDPA (time ratio, lower is faster) and quality vs dense\n",
          _md(spq, [("top_p", "top_p"), ("density", "density"), ("dense s", "dense_s"), ("sparse/dense (sdpa gather)", "sdpa_ratio"),
                    ("sparse/dense (online softmax)", "online_ratio"), ("rel L2", "rel_l2"), ("cosine", "cos")],
              {"density": f3, "dense_s": f3, "sdpa_ratio": f3, "online_ratio": f3, "rel_l2": "{:.4f}", "cos": "{:.5f}", "top_p": f2}),
          f"\n## SP=2 step (sparse Ulysses attention, top_p {args.sp_top_p}): balancing and slack filling\n\n"
          "Step time = the slowest rank's, median. Slack filling adds blocks only below the critical path, "
          "so it should not lengthen the step; with balancing on, little slack is left.\n",
          _md(step, [("variant", "variant"), ("step s", "time_s"), ("vs no balance", "ratio"), ("imbalance before", "imb_before"),
                     ("after", "imb_after"), ("moves", "moves"), ("MiB moved P2P", "mib"), ("slack filled (of work)", "filled"),
                     ("rel L2 vs dense", "rel_l2"), ("cosine", "cos")],
              {"time_s": f3, "ratio": f3, "imb_before": f3, "imb_after": f3, "mib": f2, "filled": "{:.1%}",
               "rel_l2": "{:.4f}", "cos": "{:.5f}"}),
          "\n## The small global DiT block (random weights, smooth video-like tokens): output vs dense\n",
          _md(dit_rows, [("top_p", "top_p"), ("density", "density"), ("rel L2 of the attention branch + MLP", "rel_l2"),
                         ("cosine", "cos")], {"density": f3, "rel_l2": "{:.4f}", "cos": "{:.5f}", "top_p": f2})]
    text = "\n".join(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"imbalance": imb, "speed_quality": spq, "step": step,
                                                    "global_dit": dit_rows}, indent=1))
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sparse", help="adaptive sparse attention: imbalance, migration, speed and quality")
    p.add_argument("--grid", type=int, nargs=3, default=[8, 24, 24], metavar=("T", "H", "W"))
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--top-p", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    p.add_argument("--sp-top-p", type=float, default=0.7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sparse.md")
    p.set_defaults(func=main)
    return p


def main(args, parser=None) -> int:
    print(run(args))
    return 0
