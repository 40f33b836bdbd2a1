"""`ditsp bench attention`: Ulysses, Ring, USP and AllGather-KV side by side in one process group.

Every strategy runs on the same spawned ranks and the same local shards;
iterations interleave the strategies (round robin) so machine drift hits all
alike. A call's time is the slowest rank's (ranks start together after a
barrier); the table shows the median over the timed iterations. Bytes and
calls are one call's counted collectives on the busiest rank (lengths passed
in, so no length gather). Peak MiB is the most memory one call added on any
rank (:class:`ditsp.memory.PeakMemory`: CUDA peak, else the RSS high-water
mark; ``main`` sets ``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave RSS).

Baselines run in the same rounds (``--baselines``; they live in :mod:`.attention_baselines`):

- ``a2a-sdpa``: the minimal Ulysses a peer library implements: Q, K and V
  each sent by its own equal-split all-to-all to head shards, one plain
  ``F.scaled_dot_product_attention`` (enable_gqa), one all-to-all back; no
  joint text, no uneven shards (skipped when the shape needs them).
- ``sdpa-1dev``: the whole sequence on rank 0 alone, one SDPA call (the
  other ranks idle): the single-device reference point (the ranks' shards
  gathered: the same inputs).
- ``yunchang-ulysses`` (peer library, run when ``yunchang`` imports; never a
  dependency): yunchang's ``UlyssesAttention`` on the SP group (its
  ``SeqAllToAll4D``: Q, K, V and the output each in their own all-to-all).
  Its local attention is torch SDPA set as the layer's ``attn_fn``: every
  yunchang torch ``AttnType`` (0.6.4) goes through ``ring_pytorch_attn_func``,
  which calls ``aten._scaled_dot_product_flash_attention`` (no CPU kernel),
  ignores the attention type, is called by ``UlyssesAttention`` without a
  group (so it would ring over WORLD) and has no backward
  (``pytorch_attn_backward`` raises); its other types need CUDA/NPU kernels
  (flash_attn, flashinfer, sageattention). No
  ``yunchang-ring`` for the same reason: none of its ring kernels runs on CPU.
- ``torch-cp-ring``: torch's ``context_parallel`` (a ``DeviceMesh`` over the
  gloo group; the ranks' shards enter as they are, a placeholder buffer keeps
  ``context_parallel`` from re-sharding anything). On CPU the CP ring handler
  is not reached (it is registered for the CUDA flash/efficient/cudnn SDPA
  ops only): DTensor picks a sharding for the CPU flash op from its
  strategies, whatever ``set_rotate_method`` says: at small sizes it
  all-gathers K and V and runs one SDPA per rank; at seq 4096+ it moves Q, K
  and V to head shards (gloo has no all-to-all for it: all-gather + chunk,
  twice the bytes) and returns a head-sharded output, which the wrapper
  brings back to sequence shards with DTensor's own redistribution. Forward only: the CPU backward op
  (``_scaled_dot_product_flash_attention_for_cpu_backward``) has no DTensor
  sharding strategy (NotImplementedError), so ``--backward`` skips it. Its
  first call per shape and dtype takes seconds (DTensor traces that
  decomposition), paid in the untimed check below.

Peers take the same local shards as ditsp. Their bytes and calls are counted
by a dispatch mode over the c10d and functional collectives during one
untimed call (the correctness check), by ditsp's conventions (a rank's own
segment is not traffic). Every strategy and baseline is checked once, before
timing, against SDPA in fp32 on the gathered inputs (text 0 only): ``err``
is the max abs error of the output, and with ``--backward`` of dQ, dK, dV
(``ones`` upstream gradient); a warning names rows past a loose tolerance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..argtypes import choice_list, nonneg_int, positive_int
from ..attention.common import even_splits
from ..attention.usp import AllGatherKV, Ring, SPAttention, Ulysses
from ..config import ParallelConfig
from ..distributed.comm import Comm
from ..distributed.groups import build_sp_groups
from ..dtypes import DTYPES
from ..memory import PeakMemory
from .attention_baselines import (A2ASDPA, BASELINES, PEER_NOTES, SDPAOneDevice, TorchCPRing, YunchangUlysses,
                                  _PeerTraffic, baseline_fits)


def strategies_for(sp: int) -> list[tuple[str, int, int]]:
    """(name, ulysses degree, ring degree) for every strategy that fits ``sp`` ranks."""
    out = [("ulysses", sp, 1), ("ring", 1, sp), ("allgather", 1, sp)]
    square = [d for d in range(2, sp) if sp % d == 0 and d * d <= sp]  # the most balanced 2D mesh
    if square:
        u = square[-1]
        out += [("usp-ring", u, sp // u), ("usp-allgather", u, sp // u)]
    return out


def _build(ctx, name, u, r, cfg=None, dt=None, full=None, rows=0):
    if name == "a2a-sdpa":
        return A2ASDPA(ctx.group)
    if name == "sdpa-1dev":
        return SDPAOneDevice(ctx, cfg, dt, full=full, rows=rows)
    if name == "yunchang-ulysses":
        return YunchangUlysses(ctx.group)
    if name == "torch-cp-ring":
        return TorchCPRing(ctx.group)
    if name == "ulysses":
        return Ulysses(ctx.group)
    if name == "ring":
        return Ring(ctx.group)
    if name == "allgather":
        return AllGatherKV(ctx.group)
    cfg = ParallelConfig(ulysses_degree=u, ring_degree=r, use_allgather=name.endswith("allgather"), advanced_uaa=True)
    return SPAttention.from_config(cfg, build_sp_groups(cfg, ctx.group))


def _gather_full(ctx, lens, tensors):
    """The ranks' [B, s, H, D] shards joined along the sequence (uncounted; for the check and sdpa-1dev)."""
    comm = Comm(ctx.group)
    out = []
    for t in tensors:
        parts = comm.all_gather_rows(t.detach().transpose(0, 1).contiguous(), lens)
        out.append(torch.cat(parts).transpose(0, 1))
    return out


def _reference(ctx, cfg, lens, q, full):
    """This rank's rows of SDPA in fp32 on the gathered inputs: out and, with backward, dQ, dK, dV ([B, s, H, D])."""
    off, s = sum(lens[: ctx.rank]), lens[ctx.rank]
    qf = q.detach().float().transpose(1, 2).contiguous().requires_grad_(cfg["backward"])
    kf, vf = (t.float().transpose(1, 2).contiguous().requires_grad_(cfg["backward"]) for t in full[1:])
    with torch.enable_grad():
        o = F.scaled_dot_product_attention(qf, kf, vf, enable_gqa=True)
    ref = [o.detach().transpose(1, 2)]
    if cfg["backward"]:
        dq, dk, dv = torch.autograd.grad(o, (qf, kf, vf), torch.ones_like(o))
        for t in (dk, dv):  # this rank's queries' share of dK, dV: the sum over ranks is the whole
            dist.all_reduce(t, group=ctx.group)
        ref += [dq.transpose(1, 2)] + [t[:, :, off:off + s].transpose(1, 2) for t in (dk, dv)]
    return ref


def _check_call(a, q, k, v, T, lens, cfg, ref):
    """One untimed call: (max abs error of the output, of dQ/dK/dV) against ``ref`` (None where not checked)."""
    out = a(q, k, v, text_len=T, seq_lens=lens)
    if out is None:
        return None, None
    local = getattr(a, "to_local", lambda t: t)
    got = [out]
    if cfg["backward"]:
        ins = getattr(a, "qkv", None) or (q, k, v)
        got += list(torch.autograd.grad(out, ins, torch.ones_like(out)))
    if ref is None:
        return None, None
    errs = [(local(g).detach().float() - r).abs().max().item() for g, r in zip(got, ref)]
    return errs[0], (max(errs[1:]) if len(errs) > 1 else None)


def rank_bench(ctx, cfg: dict) -> dict:
    torch.manual_seed(ctx.rank)
    lens = even_splits(cfg["seq"], ctx.world_size)
    n, T, dt = lens[ctx.rank] + cfg["text"], cfg["text"], DTYPES[cfg["dtype"]]
    shape = (cfg["batch"], n, cfg["heads"], cfg["head_dim"])
    kv_shape = shape[:2] + (cfg["kv_heads"], cfg["head_dim"])
    q, k, v = (torch.randn(s, dtype=dt, requires_grad=cfg["backward"]) for s in (shape, kv_shape, kv_shape))
    sync = Comm(ctx.group)  # barrier only; not reported
    names = [tuple(s) for s in cfg["strategies"]]
    # Without text every rank's rows are its share of one sequence: gather it for the check (and sdpa-1dev).
    full = _gather_full(ctx, lens, (q, k, v)) if not T else None
    ref = _reference(ctx, cfg, lens, q, full) if full is not None else None
    attns = {s[0]: _build(ctx, *s, cfg=cfg, dt=dt, full=full if ctx.rank == 0 else None, rows=lens[0])
             for s in names}
    del full
    times = {s[0]: [] for s in names}
    peaks = {s[0]: 0 for s in names}
    stats, backends, errors = {}, {}, {}
    mem = PeakMemory(q.device)

    for name, a in attns.items():  # the check: one untimed call each; peers' traffic counted here
        sync.all_reduce(torch.zeros(1))
        a.stats.reset()
        if getattr(a, "counted", False):
            with _PeerTraffic(a.stats, ctx.rank, ctx.world_size):
                errors[name] = _check_call(a, q, k, v, T, lens, cfg, ref)
        else:
            errors[name] = _check_call(a, q, k, v, T, lens, cfg, ref)
        stats[name] = (a.stats.bytes_sent, a.stats.bytes_recv, a.stats.calls)
    del ref

    def call(a):
        out = a(q, k, v, text_len=T, seq_lens=lens)
        if out is not None and cfg["backward"]:
            ins = getattr(a, "qkv", None) or (q, k, v)
            torch.autograd.grad(out, ins, torch.ones_like(out))
        del out

    for it in range(cfg["warmup"] + cfg["iters"]):
        for name, a in attns.items():
            sync.all_reduce(torch.zeros(1))
            counted = getattr(a, "counted", False)  # peers keep the check call's counts
            if not counted:
                a.stats.reset()
            mem.start()
            t0 = time.perf_counter()
            call(a)
            dt_s = time.perf_counter() - t0
            if it >= cfg["warmup"]:
                times[name].append(dt_s)
                peaks[name] = max(peaks[name], mem.peak_added())
            if not counted:
                stats[name] = (a.stats.bytes_sent, a.stats.bytes_recv, a.stats.calls)
            backends[name] = getattr(a, "backend", None) or "sdpa"
    return {"times": times, "stats": stats, "peaks": peaks, "backends": backends, "errors": errors}


def run_bench(cfg: dict, timeout_s: float = 1800.0, cluster=None) -> list[dict]:
    """Rows of the table; ``cluster``: an existing LocalCluster of ``cfg['sp']`` ranks (else one is spawned)."""
    from ..distributed.launcher import LocalCluster

    if cluster is not None:
        res = cluster.run(rank_bench, cfg, timeout_s=timeout_s)
    else:
        with LocalCluster(cfg["sp"], timeout_s=timeout_s, threads=cfg["threads"]) as c:
            res = c.run(rank_bench, cfg)
    rows = []
    for name, u, r in cfg["strategies"]:
        per_iter = [max(rk["times"][name][i] for rk in res) for i in range(cfg["iters"])]
        sent, recv, calls = (max(rk["stats"][name][j] for rk in res) for j in range(3))
        errs = [rk["errors"][name] for rk in res if rk["errors"][name][0] is not None]
        rows.append({"strategy": name, "mesh": f"{u}x{r}", "ms": 1e3 * statistics.median(per_iter),
                     "sent_mib": sent / 2**20, "recv_mib": recv / 2**20, "calls": calls,
                     "peak_mib": max(rk["peaks"][name] for rk in res) / 2**20, "backend": res[0]["backends"][name],
                     "err": max((e[0] for e in errs), default=None),
                     "grad_err": max((e[1] for e in errs if e[1] is not None), default=None)})
    base = next((row["ms"] for row in rows if row["strategy"] == "ulysses"), rows[0]["ms"])
    for row in rows:
        row["ratio"] = row["ms"] / base
    return rows


def format_table(rows: list[dict], cfg: dict) -> str:
    what = "forward+backward" if cfg["backward"] else "forward"
    head = (f"attention {what}: sp={cfg['sp']} seq={cfg['seq']} text={cfg['text']} batch={cfg['batch']} "
            f"heads={cfg['heads']} kv_heads={cfg['kv_heads']} head_dim={cfg['head_dim']} {cfg['dtype']}, "
            f"median of {cfg['iters']} after {cfg['warmup']} warm-up, {cfg['threads']} thread(s)/rank")
    lines = [head, "", "| strategy | UxR | kernel | ms/call | vs ulysses | peak MiB/rank | MiB sent | MiB recv | calls "
             "| err out | err dQKV |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def e(x):
        return "-" if x is None else f"{x:.1e}"

    for r in rows:
        lines.append(f"| {r['strategy']} | {r['mesh']} | {r['backend']} | {r['ms']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['peak_mib']:.0f} | {r['sent_mib']:.2f} | {r['recv_mib']:.2f} | {r['calls']} | "
                     f"{e(r.get('err'))} | {e(r.get('grad_err'))} |")
    lines.append("")
    lines.append("bytes and calls: one call, per rank (the busiest rank); peak: the most one call added on any rank; "
                 "err: max abs error vs fp32 SDPA on the same (gathered) inputs, output and dQ/dK/dV (- : not checked)")
    names = {r["strategy"] for r in rows}
    for name, note in PEER_NOTES.items():
        if name in names:
            lines.append(f"{name}: {note()}")
    return "\n".join(lines)


TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 3e-1)}


def check_warnings(rows: list[dict], cfg: dict) -> list[str]:
    """Rows whose error against SDPA is past the loose bound of ``cfg['dtype']``."""
    out = []
    for r in rows:
        for what, x, tol in zip(("output", "dQ/dK/dV"), (r.get("err"), r.get("grad_err")), TOLERANCE[cfg["dtype"]]):
            if x is not None and x > tol:
                out.append(f"WARNING: {r['strategy']}: {what} differs from SDPA by {x:.2e} "
                           f"(bound {tol:.0e} for {cfg['dtype']})")
    return out


STRATEGY_NAMES = ("ulysses", "ring", "allgather", "usp-ring", "usp-allgather")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    def fail(msg: str):
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    if args.sp < 1 or args.seq < 1 or args.heads < 1:
        fail("--sp, --seq and --heads must be >= 1")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        fail(f"--kv-heads {kv} must divide --heads {args.heads}")
    strategies = strategies_for(args.sp)
    if args.strategies:
        wanted = args.strategies if isinstance(args.strategies, list) else args.strategies.split(",")
        unknown = [w for w in wanted if w not in STRATEGY_NAMES]
        if unknown:
            fail(f"--strategies: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(STRATEGY_NAMES)}")
        fits = [s[0] for s in strategies]
        misfit = [w for w in wanted if w not in fits]
        if misfit:
            fail(f"--strategies: {', '.join(misfit)} need(s) a 2D mesh that --sp {args.sp} does not have; "
                 f"at --sp {args.sp}: {', '.join(fits)}")
        strategies = [s for s in strategies if s[0] in wanted]
    baselines = getattr(args, "baselines", None) or []
    baselines = baselines.split(",") if isinstance(baselines, str) else baselines
    for b in baselines:
        if b not in BASELINES + ("none",):
            fail(f"--baselines: unknown {b!r}; choose from {', '.join(BASELINES)}, none")
        if b != "none":
            strategies.append((b, args.sp if b in ("a2a-sdpa", "yunchang-ulysses") else 1,
                               args.sp if b == "torch-cp-ring" else 1))
    cfg = {"sp": args.sp, "seq": args.seq, "heads": args.heads, "kv_heads": kv, "head_dim": args.head_dim,
           "batch": args.batch, "text": args.text, "dtype": args.dtype, "backward": args.backward,
           "warmup": args.warmup, "iters": args.iters, "threads": args.threads, "strategies": strategies}
    skipped = []
    for name, _, _ in list(strategies):
        why = baseline_fits(name, cfg) if name in BASELINES else None
        if why:
            skipped.append(f"skipped {name}: {why}")
            print(skipped[-1])
            strategies.remove(next(s for s in strategies if s[0] == name))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # freed tensors leave RSS: honest peaks
    rows = run_bench(cfg)
    print(format_table(rows, cfg))
    for line in skipped + check_warnings(rows, cfg):
        print(line)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("attention", help="global-attention SP strategies side by side (time, bytes, calls)")
    p.add_argument("--sp", type=positive_int, required=True, help="ranks (local gloo processes)")
    p.add_argument("--seq", type=positive_int, required=True, help="video tokens (whole sequence)")
    p.add_argument("--heads", type=positive_int, required=True)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--kv-heads", type=positive_int, help="K/V heads (GQA); default: --heads")
    p.add_argument("--text", type=nonneg_int, default=0, help="replicated joint text tokens")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per rank")
    p.add_argument("--strategies", type=choice_list(STRATEGY_NAMES),
                   help="comma-separated subset (ulysses,ring,allgather,usp-ring,usp-allgather)")
    p.add_argument("--baselines", type=choice_list(BASELINES + ("none",)), default=list(BASELINES),
                   help="comma-separated reference points run alongside: a2a-sdpa, sdpa-1dev and the optional "
                        "peer libraries yunchang-ulysses (when yunchang imports) and torch-cp-ring (torch "
                        "context_parallel; forward only on CPU); default all, those that cannot run are skipped "
                        "with the reason; or none")
    p.set_defaults(func=main)
    return p
