"""The baselines `ditsp bench attention` times ditsp's strategies against: torch's own primitives
(``a2a-sdpa``, ``sdpa-1dev``) and peer libraries when they import (``yunchang-ulysses``,
``torch-cp-ring``; never dependencies), each taking the same local shards as ditsp, and the
dispatch mode that counts a peer's collectives by ditsp's conventions. Being baselines, they call
``torch.distributed`` directly (the named exception of the layers test).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed.comm import Comm, CommStats


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
