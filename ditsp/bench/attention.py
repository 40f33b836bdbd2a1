"""`ditsp bench attention`: Ulysses, Ring, USP and AllGather-KV side by side in one process group.

Every strategy runs on the same spawned ranks and the same local shards;
iterations interleave the strategies (round robin) so machine drift hits all
alike. A call's time is the slowest rank's (ranks start together after a
barrier); the table shows the median over the timed iterations. Bytes and
calls are one call's counted collectives on the busiest rank (lengths passed
in, so no length gather). Peak MiB is the most memory one call added on any
rank (:class:`ditsp.memory.PeakMemory`: CUDA peak, else the RSS high-water
mark; ``main`` sets ``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave RSS).

Baselines run in the same rounds (``--baselines``):

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
from torch.utils._python_dispatch import TorchDispatchMode

from ..attention.common import even_splits
from ..attention.usp import AllGatherKV, Ring, SPAttention, Ulysses
from ..config import ParallelConfig
from ..distributed.groups import build_sp_groups
from ..distributed.comm import Comm, CommStats
from ..argtypes import choice_list, nonneg_int, positive_int
from ..engine import DTYPES
from ..memory import PeakMemory



def strategies_for(sp: int) -> list[tuple[str, int, int]]:
    """(name, ulysses degree, ring degree) for every strategy that fits ``sp`` ranks."""
    out = [("ulysses", sp, 1), ("ring", 1, sp), ("allgather", 1, sp)]
    square = [d for d in range(2, sp) if sp % d == 0 and d * d <= sp]  # the most balanced 2D mesh
    if square:
        u = square[-1]
        out += [("usp-ring", u, sp // u), ("usp-allgather", u, sp // u)]
    return out


BASELINES = ("a2a-sdpa", "sdpa-1dev", "yunchang-ulysses", "torch-cp-ring")
PEERS = ("yunchang-ulysses", "torch-cp-ring")  # real peer libraries (optional, never dependencies)
TORCH_CP_NO_BACKWARD = ("torch-cp-ring runs forward only on CPU: aten._scaled_dot_product_flash_attention_for_cpu"
                        "_backward has no DTensor sharding strategy (NotImplementedError in backward)")


class _A2A(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (its own inverse, so the backward is the same exchange)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        n = comm.world_size
        return comm.all_to_all_single(x.contiguous(), [x.shape[0] // n] * n, [x.shape[0] // n] * n, kind="a2a_sdpa")

    @staticmethod
    def backward(ctx, g):
        n = ctx.comm.world_size
        return ctx.comm.all_to_all_single(g.contiguous(), [g.shape[0] // n] * n, [g.shape[0] // n] * n,
                                          kind="a2a_sdpa_bwd"), None


class A2ASDPA:
    """Baseline: all-to-all Q, K, V separately to head shards, one SDPA, all-to-all back (even shapes only)."""

    def __init__(self, group):
        self.comm = Comm(group)
        self.stats = self.comm.stats

    def _to_heads(self, x):  # [B, s, H, D] -> [B, H/P, P*s, D]
        n, (b, s, h, d) = self.comm.world_size, x.shape
        y = _A2A.apply(x.reshape(b, s, n, h // n, d).permute(2, 0, 3, 1, 4), self.comm)  # [P, B, H/P, s, D]
        return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def __call__(self, q, k, v, text_len=0, seq_lens=None):
        n, (b, s, h, d) = self.comm.world_size, q.shape
        o = F.scaled_dot_product_attention(*(self._to_heads(x) for x in (q, k, v)), enable_gqa=True)
        o = o.reshape(b, h // n, n, s, d).permute(2, 0, 3, 1, 4)  # [P, B, s, H/P, D]
        return _A2A.apply(o, self.comm).permute(1, 2, 0, 3, 4).reshape(b, s, h, d)


class SDPAOneDevice:
    """Baseline: rank 0 attends the whole sequence alone (inputs built once, outside the timing).

    ``full``: the ranks' Q, K, V shards gathered ([B, S, H, D]), so it attends the
    same inputs as the others; else random (with text, whose rows differ per rank).
    """

    def __init__(self, ctx, cfg, dt, full=None, rows=0):
        self.stats, self.rank, self.rows = Comm.single().stats, ctx.rank, rows
        if ctx.rank == 0:
            g = cfg["backward"]
            if full is not None:
                self.qkv = [t.transpose(1, 2).contiguous().requires_grad_(g) for t in full]
            else:
                S, B, H, Hk, D = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
                self.qkv = [torch.randn(B, h, S + cfg["text"], D, dtype=dt, requires_grad=g) for h in (H, Hk, Hk)]

    def __call__(self, *args, **kw):
        if self.rank:
            return None
        return F.scaled_dot_product_attention(*self.qkv, enable_gqa=True)

    def to_local(self, t):
        """Rank 0's own rows of a [B, H, S, D] result, as [B, s, H, D] (what the check compares)."""
        return t[:, :, : self.rows].transpose(1, 2)


def peer_missing(name: str) -> str | None:
    """Why the peer library behind baseline ``name`` cannot run here (None when it can)."""
    if name == "yunchang-ulysses":
        import importlib.util

        if importlib.util.find_spec("yunchang") is None:
            return "yunchang not installed (optional peer: pip install yunchang)"
        try:
            import yunchang  # noqa: F401
            from yunchang.kernels import AttnType  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import-time failure means: skip the peer
            return f"yunchang does not import: {type(e).__name__}: {e}"
    if name == "torch-cp-ring":
        try:
            from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
            from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"torch {torch.__version__} has no context_parallel: {type(e).__name__}: {e}"
    return None


def _sdpa_bshd(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
    """flash_attn_func's signature and [B, S, H, D] layout over torch SDPA (yunchang's ``attn_fn``)."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                       is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return o.transpose(1, 2)


class YunchangUlysses:
    """Peer: yunchang's UlyssesAttention on the SP group, torch SDPA as its local attention."""

    backend = "sdpa"
    counted = True  # its collectives are counted by _PeerTraffic during the check call

    def __init__(self, group):
        from yunchang import UlyssesAttention
        from yunchang.kernels import AttnType

        self.stats = CommStats()
        self.layer = UlyssesAttention(group, attn_type=AttnType.TORCH_FLASH)
        # Every torch AttnType resolves to ring_pytorch_attn_func (no CPU kernel, no backward, WORLD ring):
        # the layer keeps its exchanges and layout, the local kernel is SDPA.
        self.layer.attn_fn = _sdpa_bshd

    def __call__(self, q, k, v, text_len=0, seq_lens=None):
        return self.layer(q, k, v)


class TorchCPRing:
    """Peer: torch's context_parallel over a DeviceMesh of the gloo group; SDPA on [B, H, s, D] shards."""

    backend = "sdpa"
    counted = True

    def __init__(self, group):
        from torch.distributed.device_mesh import DeviceMesh

        self.stats = CommStats()
        self.n = dist.get_world_size(group)
        self.mesh = DeviceMesh.from_group(group, "cpu")

    def __call__(self, q, k, v, text_len=0, seq_lens=None):
        from torch.distributed.tensor.experimental import context_parallel

        # Our inputs already are the ranks' contiguous shards: a fresh placeholder (one element per rank) is
        # the only buffer context_parallel shards; it patches F.scaled_dot_product_attention while open.
        ph = torch.zeros(self.n)
        with context_parallel(self.mesh, buffers=[ph], buffer_seq_dims=[0], no_restore_buffers={ph}):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               enable_gqa=k.shape[2] != q.shape[2])
            if o.shape[1] != q.shape[2]:
                # DTensor may pick a head-sharded strategy for the CPU op (the whole sequence, H/n heads):
                # torch's own redistribution brings the output back to sequence shards.
                from torch.distributed.tensor import DTensor, Shard

                o = DTensor.from_local(o, self.mesh, [Shard(1)]).redistribute(self.mesh, [Shard(2)]).to_local()
        return o.transpose(1, 2)


class _PeerTraffic(TorchDispatchMode):
    """Counts a peer library's collectives (c10d and functional ops) into ``stats``, by Comm's conventions."""

    NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")

    def __init__(self, stats: CommStats, rank: int, world: int):
        super().__init__()
        self.stats, self.rank, self.n = stats, rank, world

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode does)
        out = func(*args, **(kwargs or {}))
        ns, name = getattr(func, "namespace", ""), func._overloadpacket.__name__
        if ns in self.NAMESPACES and not name.startswith(("wait", "_wrap", "barrier", "monitored_barrier")):
            self.stats.add(f"{ns}.{name}", *self._bytes(name, args, out))
        return out

    def _bytes(self, name, args, out) -> tuple[int, int]:
        n, r = self.n, self.rank

        def a2a(inp, res, osplits, isplits):
            if not isplits:  # equal splits
                return inp.nbytes * (n - 1) // n, res.nbytes * (n - 1) // n
            row = inp.nbytes // max(1, inp.shape[0])
            return (sum(isplits) - isplits[r]) * row, (sum(osplits) - osplits[r]) * row

        if name == "alltoall_base_":
            return a2a(args[1], args[0], list(args[3]), list(args[4]))
        if name == "all_to_all_single":
            return a2a(args[0], out, list(args[1]), list(args[2]))
        if name in ("_allgather_base_", "all_gather_into_tensor"):
            t = args[1] if name.startswith("_") else args[0]
            return t.nbytes * (n - 1), t.nbytes * (n - 1)
        if name == "allgather_into_tensor_coalesced_":
            b = sum(t.nbytes for t in args[1])
            return b * (n - 1), b * (n - 1)
        if name == "send":
            return sum(t.nbytes for t in args[0]), 0
        if name == "recv_":
            return 0, sum(t.nbytes for t in args[0])
        if name in ("allreduce_", "all_reduce"):
            b = sum(t.nbytes for t in args[0]) if name == "allreduce_" else args[0].nbytes
            return b, b
        return 0, 0  # another collective: counted as a call


def baseline_fits(name: str, cfg: dict) -> str | None:
    """Why a baseline cannot run this configuration (None when it can)."""
    n = cfg["sp"]
    if name in ("a2a-sdpa", "yunchang-ulysses"):
        if cfg["text"] or cfg["seq"] % n or cfg["heads"] % n or cfg["kv_heads"] % n:
            return f"{name} needs no text and sequence, heads and K/V heads divisible by --sp"
    if name == "torch-cp-ring":
        if cfg["text"] or cfg["seq"] % n:
            return "torch-cp-ring needs no text and the sequence divisible by --sp (equal DTensor shards)"
        if cfg.get("backward"):
            return TORCH_CP_NO_BACKWARD
    if name in PEERS:
        return peer_missing(name)
    return None


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


def _yunchang_version() -> str:
    try:
        import yunchang

        return getattr(yunchang, "__version__", "?")
    except Exception:  # noqa: BLE001
        return "?"


PEER_NOTES = {
    "yunchang-ulysses": lambda: (f"yunchang {_yunchang_version()} UlyssesAttention (Q, K, V, out: one all-to-all "
                                 "each), torch SDPA as its attn_fn (its own torch attention has no CPU kernel)"),
    "torch-cp-ring": lambda: (f"torch {torch.__version__} context_parallel; on CPU not a ring: DTensor all-gathers "
                              "K and V, one SDPA per rank (the CP ring handler covers the CUDA SDPA ops only); "
                              "forward only"),
}

# The check's loose bounds (max abs error of the output, of dQ/dK/dV); past them the bench warns.
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
