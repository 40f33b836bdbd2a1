"""All-to-all transport: packed buffers moved by split sizes, whole or in bounded chunks.

One entry point, :meth:`Transport.all_to_all`, moves a packed send buffer (rows per
peer, like ``all_to_all_single``) for the Ulysses codec
(:mod:`ditsp.attention.ulysses`), the window exchange
(:mod:`ditsp.windows.exchange`) and every other all-to-all of ditsp. A
:class:`Transport` is one group's transport as one user holds it: the
:class:`~ditsp.distributed.comm.Comm`, the settings (the policy of every
all-to-all it moves), the agreed plans and what the last call used. The
runtime or attention object that moves rows owns its Transport; nothing is
kept per Comm or per process, so two objects built from the same config
behave alike whatever built them. Policies (``docs/transport.md``):

- ``off``: one ``all_to_all_single`` of the rows that cross ranks;
- ``chunked``: every crossing peer segment is cut into the same number of
  chunks K so that the staging buffers of a rank (two send and two receive
  stages) never exceed the capacity; one all-to-all per chunk, the next chunk
  packed straight from the source and the previous one unpacked while the
  current one is in flight;
- ``auto``: ``chunked`` where the crossing rows would not fit the capacity on
  some rank, else ``off``; grad-tracked operands above the per-plane threshold
  keep ``off`` unless the long-training opt-in is ``chunked``.

Under every policy a rank's own segment never enters the collective: it is
copied once, from the source straight to its place in the output, while the
first chunk is in flight. Sources pack on demand (:class:`Rows`, or a codec's
own, like the Ulysses wire layout), so no whole packed buffer is built unless
the rows must go in one piece; received rows go to the output in peer order
or to the positions of a :class:`Placement`.

Agreement: before a call, every rank contributes one fixed-size int vector
(settings, capability, dtype, row shape, grad flag, its split sizes) to one
small all-gather, and every rank derives the same decision from the same
gathered matrix: geometry or dtype that disagree raise :class:`TransportError`
on every rank; settings or capability that disagree make every rank take
``off`` (said once) and are not cached, so a later agreeing call is tuned again.
An agreed decision is cached per ``(key, local signature)`` when the caller
passes a ``key`` that determines the global exchange on every rank (a count
matrix digest, the codec's shapes); without a key every call agrees.

Outputs are freshly allocated (never a view of a staging buffer); chunked and
off give the same bits. Under autograd the backward runs the transposed
exchange with the plan its forward saved.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from .comm import Comm
import numpy as np

POLICIES = ("off", "auto", "chunked")
LONG_TRAINING = ("auto", "chunked")
AGREE = ("key", "every")
DEFAULT_CAPACITY = 1 << 30
DEFAULT_GRAD_THRESHOLD = 512 << 20
IN_FLIGHT = 2  # chunks in flight at once: each has its own send and receive stage
ENV_POLICY = "DITSP_A2A_POLICY"
ENV_LONG = "DITSP_A2A_LONG_TRAINING"
ENV_CAPACITY = "DITSP_A2A_CAPACITY_BYTES"
ENV_AGREE = "DITSP_A2A_AGREE"
_VERSION = 1
_CACHE_MAX = 1024

log = logging.getLogger("ditsp.transport")


class TransportError(RuntimeError):
    """Raised on every rank alike: ranks disagree on geometry/dtype, or no policy can honour the settings."""


# -- settings ---------------------------------------------------------------------


@dataclass(frozen=True)
class TransportSettings:
    """What one rank asks of the transport; ``sources`` says where each value came from."""

    policy: str = "auto"
    long_training: str = "auto"
    capacity_bytes: int = DEFAULT_CAPACITY
    grad_threshold_bytes: int = DEFAULT_GRAD_THRESHOLD
    agree: str = "key"  # "key": once per caller key (cached); "every": before every call
    sources: tuple = field(default=(), compare=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"transport policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.long_training not in LONG_TRAINING:
            raise ValueError(f"long-training policy must be one of {', '.join(LONG_TRAINING)}, "
                             f"got {self.long_training!r}")
        if self.agree not in AGREE:
            raise ValueError(f"agreement mode must be one of {', '.join(AGREE)}, got {self.agree!r}")
        for name in ("capacity_bytes", "grad_threshold_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @classmethod
    def resolve(cls, config=None, env=None, **overrides) -> "TransportSettings":
        """Config fields (when not None) over environment variables over defaults; ``overrides`` over all."""
        env = os.environ if env is None else env
        values, sources = {}, []

        def pick(name, attr, var, parse, default):
            cv = getattr(config, attr, None) if config is not None else None
            if cv is not None:
                values[name], src = cv, "config"
            elif env.get(var, "").strip():
                raw = env[var].strip()
                try:
                    values[name] = parse(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not a valid value") from None
                src = "env"
            else:
                values[name], src = default, "default"
            sources.append((name, src))

        pick("policy", "a2a_policy", ENV_POLICY, str.lower, "auto")
        pick("long_training", "a2a_long_training", ENV_LONG, str.lower, "auto")
        pick("capacity_bytes", "a2a_capacity_bytes", ENV_CAPACITY, int, DEFAULT_CAPACITY)
        pick("agree", "a2a_agree", ENV_AGREE, str.lower, "key")
        for k, v in overrides.items():
            values[k] = v
            sources.append((k, "override"))
        try:
            return cls(**values, sources=tuple(sources))
        except ValueError as e:
            where = ", ".join(f"{n} from {s}" for n, s in sources)
            raise ValueError(f"{e} ({where})") from None


# -- sources: the packed send buffer, without building it -------------------------


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows on dim 0) seen as rows of the widest integer type its row bytes divide.

    Row gathers and scatters are plain copies, so moving 8-byte words instead of 2-byte
    elements gives the same bits in fewer, wider loads (about 2x faster for bf16 rows on CPU).
    """
    if t.dim() == 0 or not t.is_contiguous() or t.dtype.is_complex or t.dtype == torch.bool or t.shape[0] == 0:
        return t
    row = t[0].numel() * t.element_size()
    for word, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row % word == 0 and row >= word and t.element_size() <= word:
            return t.view(t.shape[0], -1).view(dt)
    return t


class Rows:
    """Packed row j is ``x[index[j]]`` (``x[j]`` without an index)."""

    def __init__(self, x: torch.Tensor, index: torch.Tensor | None = None):
        self.x, self.index = x, index
        self.rows = int(index.numel()) if index is not None else int(x.shape[0])
        self.row_shape, self.dtype, self.device = tuple(x.shape[1:]), x.dtype, x.device
        self.planes = 1

    @property
    def requires_grad(self) -> bool:
        return self.x.requires_grad

    def materialize(self) -> torch.Tensor:
        """The whole packed buffer (a copy when rows are picked by an index)."""
        return self.x.index_select(0, self.index) if self.index is not None else self.x

    def view_rows(self, a: int, b: int) -> torch.Tensor | None:
        """Packed rows ``[a, b)`` without a copy, when they lie contiguous in ``x``; else None."""
        if self.index is None and self.x.is_contiguous():
            return self.x[a:b]
        return None

    def copy_rows(self, a: int, b: int, dst: torch.Tensor) -> None:
        if self.index is not None:
            torch.index_select(as_words(self.x), 0, self.index[a:b], out=as_words(dst))
        else:
            dst.copy_(self.x[a:b])


class Placement:
    """Where received rows land: ``out[index[j]]`` = received row j (peers in rank order, own rows included).

    Build one per exchange and reuse it with the same send rows: the gather that places this rank's
    own rows straight from the source is derived once and kept here.
    """

    def __init__(self, index: torch.Tensor):
        self.index = index
        self._own: tuple | None = None  # (range, the source's index object, the gather)

    def own_gather(self, src: Rows, in_lo: int, out_lo: int, n: int) -> torch.Tensor:
        """Index over ``src.x`` whose gather puts the own rows in place (other positions: row 0, overwritten)."""
        span = (in_lo, out_lo, n)
        if self._own is None or self._own[0] != span or self._own[1] is not src.index:  # the object, not its id
            own = torch.arange(in_lo, in_lo + n, device=self.index.device)
            if src.index is not None:
                own = src.index[in_lo : in_lo + n]
            g = torch.zeros(self.index.numel(), dtype=torch.int64, device=self.index.device)
            g[self.index[out_lo : out_lo + n]] = own.to(torch.int64)
            self._own = (span, src.index, g)  # one source per placement: keep only the latest
        return self._own[2]


# -- plans ------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every rank of one call does: ``off`` (one all-to-all) or ``chunked`` in ``chunks`` calls."""

    policy: str
    chunks: int
    reason: str
    requested: str
    cache: bool = True  # False for fallbacks caused by disagreement (re-agreed next call)
    error: str = ""  # non-empty: raise TransportError (every rank alike) when used


def _crossing(sizes: Sequence[int], me: int) -> list[int]:
    """Split sizes without this rank's own segment (it never goes through the collective)."""
    return [0 if p == me else int(v) for p, v in enumerate(sizes)]


def _cuts(size: int, k: int) -> list[int]:
    return [(c * size) // k for c in range(k + 1)]


def chunk_rows(splits: Sequence[int], k: int) -> list[list[int]]:
    """Rows per peer of each of ``k`` chunks (chunk c of a segment of S rows: [cS/k, (c+1)S/k))."""
    cuts = [_cuts(int(s), k) for s in splits]
    return [[c[i + 1] - c[i] for c in cuts] for i in range(k)]


def staging_bytes(in_splits: Sequence[int], out_splits: Sequence[int], row_bytes: int, k: int,
                  recv_staged: bool = True) -> int:
    """Bound on the staging one rank allocates for ``k`` chunks: a send and a receive stage (two of each
    when pipelined), each at most ``sum ceil(split / k)`` rows (the exact chunks never exceed it); no
    receive stage when received rows go straight into the output (``recv_staged=False``)."""
    s = sum(-(-int(v) // k) for v in in_splits)
    r = sum(-(-int(v) // k) for v in out_splits) if recv_staged else 0
    return min(k, IN_FLIGHT) * (s + r) * row_bytes


def chunks_needed(in_splits: Sequence[int], out_splits: Sequence[int], row_bytes: int, capacity: int,
                  recv_staged: bool = True) -> int:
    """The fewest chunks whose staging fits ``capacity``; -1 when even one row per peer does not."""
    if staging_bytes(in_splits, out_splits, row_bytes, 1, recv_staged) <= capacity:
        return 1
    hi = max([1, *in_splits, *out_splits])
    if staging_bytes(in_splits, out_splits, row_bytes, hi, recv_staged) > capacity:
        return -1
    lo = 1  # staging(k) for k >= 2 is non-increasing in k: the first k that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if staging_bytes(in_splits, out_splits, row_bytes, mid, recv_staged) <= capacity:
            hi = mid
        else:
            lo = mid
    return hi


_FIXED = ("version", "policy", "long", "capacity", "threshold", "capable", "dtype", "row_elems", "elem_size",
          "grad", "planes", "recv_direct")


def receives_in_place(place, outs: Sequence[int], rank: int) -> bool:
    """Whether every chunk's received rows land straight in the output: peer order, one sending peer."""
    return place is None and sum(1 for r, v in enumerate(outs) if v and r != rank) <= 1


def _vector(s: TransportSettings, capable: bool, src, ins, outs, grad: bool, recv_direct: bool = False) -> list[int]:
    row_elems = 1
    for d in src.row_shape:
        row_elems *= int(d)
    return [_VERSION, POLICIES.index(s.policy), LONG_TRAINING.index(s.long_training), s.capacity_bytes,
            s.grad_threshold_bytes, int(capable), zlib.crc32(str(src.dtype).encode()), row_elems,
            torch.empty((), dtype=src.dtype).element_size(), int(grad), src.planes, int(recv_direct), *ins, *outs]


def decide(vectors: list[list[int]], transpose: bool = False) -> Plan:
    """The plan every rank derives from the gathered vectors (pure; the same on every rank)."""
    n, f = len(vectors), len(_FIXED)
    rows = [dict(zip(_FIXED, v[:f])) for v in vectors]
    ins = [list(v[f : f + n]) for v in vectors]
    outs = [list(v[f + n : f + 2 * n]) for v in vectors]
    if transpose:
        ins, outs = outs, ins
    requested = POLICIES[rows[0]["policy"]]
    for what in ("version", "dtype", "row_elems", "elem_size"):
        if len({r[what] for r in rows}) > 1:
            return Plan("off", 1, "", requested, False, f"ranks disagree on the operand's {what}: "
                        + ", ".join(f"rank {i}: {r[what]}" for i, r in enumerate(rows)))
    bad = [(r, p) for r in range(n) for p in range(n) if ins[r][p] != outs[p][r]]
    if bad:
        r, p = bad[0]
        return Plan("off", 1, "", requested, False,
                    f"ranks disagree on split sizes: rank {r} sends {ins[r][p]} rows to rank {p}, "
                    f"which expects {outs[p][r]}")
    settings = [(r["policy"], r["long"], r["capacity"], r["threshold"]) for r in rows]
    if len(set(settings)) > 1:
        desc = "; ".join(f"rank {i}: {POLICIES[s[0]]}, long-training {LONG_TRAINING[s[1]]}, capacity {s[2]}, "
                         f"threshold {s[3]}" for i, s in enumerate(settings))
        return Plan("off", 1, f"ranks disagree on transport settings ({desc}): every rank uses off",
                    requested, False)
    if requested == "off":
        return Plan("off", 1, "policy off", requested)
    incapable = [i for i, r in enumerate(rows) if not r["capable"]]
    if incapable:
        return Plan("off", 1, f"rank(s) {incapable} cannot run the chunked transport: every rank uses off",
                    requested, False)
    row_bytes = rows[0]["row_elems"] * rows[0]["elem_size"]
    cap, threshold, long = rows[0]["capacity"], rows[0]["threshold"], LONG_TRAINING[rows[0]["long"]]
    grad = any(r["grad"] for r in rows)
    plane = max(sum(i) * row_bytes // max(1, r["planes"]) for i, r in zip(ins, rows))
    # A rank's own segment never enters the collective (it is copied in place): staging holds crossing rows.
    ins, outs = [_crossing(i, r) for r, i in enumerate(ins)], [_crossing(o, r) for r, o in enumerate(outs)]
    # The forward's receive side stages nothing where rows land in place; the transposed exchange (a
    # backward) is planned as if it staged both sides.
    staged = [transpose or not r["recv_direct"] for r in rows]
    needs = [chunks_needed(i, o, row_bytes, cap, st) for i, o, st in zip(ins, outs, staged)]
    k = max(needs)
    if requested == "chunked":
        if min(needs) < 0:
            r = needs.index(-1)
            return Plan("off", 1, "", requested, True,
                        f"capacity {cap} bytes is below one row per peer on rank {r} "
                        f"(row {row_bytes} bytes, staging needs "
                        f"{staging_bytes(ins[r], outs[r], row_bytes, max([1, *ins[r], *outs[r]]), staged[r])} "
                        f"bytes at one row per peer): raise DITSP_A2A_CAPACITY_BYTES or use off/auto")
        return Plan("chunked", k, f"policy chunked: {k} chunk(s) within {cap} bytes", requested)
    if grad and plane > threshold and long != "chunked":
        return Plan("off", 1, f"auto: grad-tracked operand of {plane} bytes per plane > {threshold}: original "
                    "transport (long-training opt-in: chunked)", requested)
    if min(needs) < 0:
        return Plan("off", 1, f"auto: capacity {cap} bytes is below one row per peer: original transport",
                    requested)
    if k > 1:
        return Plan("chunked", k, f"auto: operand exceeds {cap} bytes of staging: {k} chunks", requested)
    return Plan("off", 1, f"auto: fits {cap} bytes of staging: one all-to-all", requested)


# -- one user's transport ------------------------------------------------------------


class Transport:
    """A group's all-to-all transport as one user holds it: the Comm, the settings, agreed plans (per key),
    what the last call used.

    ``settings``: a :class:`TransportSettings`, a config with the ``a2a_*`` fields
    (:class:`~ditsp.config.ParallelConfig`), or None (the environment, then the defaults), resolved once
    here. Build one per object that moves rows (a runtime, an attention strategy) on every rank alike.
    """

    def __init__(self, comm: Comm, settings=None):
        self.comm = comm
        self.settings = as_settings(settings)
        self.capable = True  # this rank can run chunked (tests flip it to simulate a rank that cannot)
        self.last: dict = {}
        self.agreements = 0
        self.used: dict = {}  # policy -> calls that used it (cleared by the caller at will)
        self._agreed: dict = {}
        self._said: set = set()

    @classmethod
    def of(cls, link: "Transport | Comm") -> "Transport":
        """``link`` itself, or a fresh Transport of a Comm (environment settings, nothing agreed yet)."""
        return link if isinstance(link, Transport) else cls(link)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def configure(self, settings=None) -> TransportSettings:
        """New settings (as for the constructor); clears the agreed plans. Call it on every rank alike."""
        self.settings = as_settings(settings)
        self._agreed.clear()
        return self.settings

    def report(self) -> dict:
        """What the last call used: policy, chunks, reason, settings and their sources."""
        return dict(self.last)

    def plan(self, src, ins, outs, grad: bool, key: Hashable | None, recv_direct: bool = False) -> tuple[Plan, Plan]:
        comm = self.comm
        s = self.settings
        vec = _vector(s, self.capable, src, ins, outs, grad, recv_direct)
        # The cache key holds only what changes on every rank together: the caller's key (the global
        # exchange), this rank's settings, dtype and row shape, and whether a backward pass is running.
        # Not the grad flag: it may differ per rank (an empty shard) and change on one rank alone.
        ck = None if key is None or s.agree == "every" else (
            key, tuple(vec[:9]), recv_direct, torch._C._current_graph_task_id() != -1)
        if ck is not None and ck in self._agreed:
            return self._agreed[ck]
        vecs = comm.all_gather_ints(vec)
        self.agreements += 1
        plans = (decide(vecs), decide(vecs, transpose=True))
        fwd = plans[0]
        if fwd.error:
            raise TransportError(f"rank {comm.rank}: {fwd.error}")
        if not fwd.cache and fwd.reason not in self._said:
            self._said.add(fwd.reason)
            log.warning("all-to-all transport: %s", fwd.reason)
        if ck is not None and fwd.cache:
            if len(self._agreed) >= _CACHE_MAX:  # every rank clears at the same call
                self._agreed.clear()
            self._agreed[ck] = plans
        return plans

    def all_to_all(self, send, input_splits: Sequence[int], output_splits: Sequence[int],
                   kind: str = "all_to_all", *, place: "Placement | None" = None,
                   key: Hashable | None = None, grad: bool | None = None) -> torch.Tensor:
        """Move packed rows: ``input_splits[p]`` rows to peer p, ``output_splits[r]`` rows from rank r.

        ``send``: a tensor (its rows are the packed buffer), :class:`Rows` (rows picked by an index), or
        any source with the same methods (``rows``, ``row_shape``, ``dtype``, ``device``, ``planes``,
        ``requires_grad``, ``materialize``, ``view_rows``, ``copy_rows``) that packs on demand. ``place``:
        put received row j at ``out[place.index[j]]`` instead of returning rows in peer order (``Rows``
        sources only). ``key``: a hashable that determines the global exchange on every rank (e.g.
        :func:`matrix_key`); with it the agreement is cached, without it every call agrees. ``grad``:
        whether the operand belongs to training (default: it requires grad, or this runs inside a
        backward pass). Returns a new tensor.
        """
        comm = self.comm
        src = send if not isinstance(send, torch.Tensor) else Rows(send)
        ins, outs = [int(v) for v in input_splits], [int(v) for v in output_splits]
        if len(ins) != comm.world_size or len(outs) != comm.world_size:
            raise ValueError(f"splits need {comm.world_size} entries, got {len(ins)} and {len(outs)}")
        if sum(ins) != src.rows:
            raise ValueError(f"rank {comm.rank}: input splits sum to {sum(ins)} rows, the operand has {src.rows}")
        if place is not None and (not isinstance(src, Rows) or place.index.numel() != sum(outs)):
            raise ValueError(f"rank {comm.rank}: a placement needs a Rows source and one position per received "
                             f"row ({sum(outs)}), got {place.index.numel()}")
        tracked = src.requires_grad and torch.is_grad_enabled()
        if grad is None:
            grad = src.requires_grad or torch._C._current_graph_task_id() != -1
        if comm.world_size == 1:
            plans = (Plan("off", 1, "one rank", "off"),) * 2
        else:
            plans = self.plan(src, ins, outs, bool(grad), key, receives_in_place(place, outs, comm.rank))
        plan = plans[0]
        if tracked:
            out = _A2A.apply(comm, plan, plans[1], ins, outs, kind, src.materialize())
            if place is not None:
                out = out.new_empty(out.shape).index_copy(0, place.index, out)
        else:
            out = _execute(comm, plan, src, ins, outs, kind, place)
        if comm.world_size > 1:
            s = self.settings
            self.last = {"policy": plan.policy, "chunks": plan.chunks, "requested": plan.requested,
                         "reason": plan.reason, "capacity_bytes": s.capacity_bytes, "long_training": s.long_training,
                         "sources": dict(s.sources), "kind": kind}
            self.used[plan.policy] = self.used.get(plan.policy, 0) + 1
        return out


def as_settings(settings=None) -> TransportSettings:
    """A :class:`TransportSettings` as given, or resolved from a config with ``a2a_*`` fields (None: env)."""
    return settings if isinstance(settings, TransportSettings) else TransportSettings.resolve(settings)


def matrix_key(counts) -> bytes:
    """A key for a global count matrix (every rank holds the same one)."""

    a = np.ascontiguousarray(counts, dtype=np.int64)
    return hashlib.sha1(a.tobytes() + str(a.shape).encode()).digest()


def shape_key(chunks, shapes) -> tuple:
    """A key for a codec exchange from what each rank sends (per peer) and receives (per peer)."""
    return (tuple(tuple(c.shape) for per in chunks for c in per), tuple(tuple(s) for per in shapes for s in per))


# -- execution ---------------------------------------------------------------------


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of every share, plus the total at the end (the one prefix-sum helper of ditsp)."""
    o = [0]
    for v in sizes:
        o.append(o[-1] + int(v))
    return o


def _row_bytes(src) -> int:
    n = torch.empty((), dtype=src.dtype).element_size()
    for d in src.row_shape:
        n *= int(d)
    return n


def _execute(comm: Comm, plan: Plan, src, ins, outs, kind, place: Placement | None) -> torch.Tensor:
    """Move the rows that cross ranks in ``k`` all-to-alls, and place this rank's own rows meanwhile.

    Every rank issues the same ``k`` calls (a rank with nothing to move joins with empty splits). The own
    segment is copied once, straight from the source to its place in the output, while the first chunk
    is in flight; two chunks are in flight at a time (chunk c is packed and posted, and chunk c-2
    unpacked, while chunk c-1 is in flight). Staging: up to two send and two receive stages of
    crossing rows, none where the rows already lie contiguous (sent straight from the source,
    received straight into the output).
    """
    if plan.error:
        raise TransportError(f"rank {comm.rank}: {plan.error}")
    me, n, shape = comm.rank, comm.world_size, src.row_shape
    k = plan.chunks if plan.policy == "chunked" else 1
    cin, cout = _crossing(ins, me), _crossing(outs, me)
    in_off, out_off = offsets(ins), offsets(outs)
    in_cuts, out_cuts = [_cuts(v, k) for v in cin], [_cuts(v, k) for v in cout]
    send_c, recv_c = chunk_rows(cin, k), chunk_rows(cout, k)
    new = dict(dtype=src.dtype, device=src.device)
    out = torch.empty((sum(outs),) + shape, **new)

    def run(off, cuts, c):  # chunk c's rows as one range [lo, hi) of the buffer, when its pieces abut
        rs = [(off[p] + cuts[p][c], off[p] + cuts[p][c + 1]) for p in range(n) if cuts[p][c + 1] > cuts[p][c]]
        if rs and all(a[1] == b[0] for a, b in zip(rs, rs[1:])):
            return rs[0][0], rs[-1][1]
        return None

    # Chunks whose rows lie contiguous go straight from the source / into the output (no staging).
    send_view, recv_view = [], []
    for c in range(k):
        r = run(in_off, in_cuts, c)
        send_view.append(None if r is None else src.view_rows(*r))
        r = run(out_off, out_cuts, c) if place is None else None
        recv_view.append(None if r is None else out[r[0] : r[1]])
    packs = sum(v is None and sum(send_c[c]) > 0 for c, v in enumerate(send_view))
    smax = max([sum(send_c[c]) for c in range(k) if send_view[c] is None] or [0])
    rmax = max([sum(recv_c[c]) for c in range(k) if recv_view[c] is None] or [0])
    unpacks = sum(v is None and sum(recv_c[c]) > 0 for c, v in enumerate(recv_view))
    nsend, nrecv = min(packs, IN_FLIGHT), max(min(unpacks, IN_FLIGHT), 1)
    sbufs = [torch.empty((smax,) + shape, **new) for _ in range(nsend)]
    rbufs = [torch.empty((rmax,) + shape, **new) for _ in range(nrecv)]
    staged = (nsend * smax + nrecv * rmax) * _row_bytes(src)
    dst_index = None if place is None else place.index

    def pack(c):
        if send_view[c] is not None:
            return send_view[c]
        if not sum(send_c[c]):
            return rbufs[0][:0]
        buf, o = sbufs[c % nsend], 0
        for p in range(n):
            a, b = in_cuts[p][c], in_cuts[p][c + 1]
            if b > a:
                src.copy_rows(in_off[p] + a, in_off[p] + b, buf[o : o + b - a])
                o += b - a
        return buf[:o]

    def unpack(c):
        if recv_view[c] is not None:
            return
        rbuf, o = rbufs[c % nrecv], 0
        for p in range(n):
            a, b = out_cuts[p][c], out_cuts[p][c + 1]
            if b > a:
                if dst_index is None:
                    out[out_off[p] + a : out_off[p] + b].copy_(rbuf[o : o + b - a])
                else:
                    as_words(out).index_copy_(0, dst_index[out_off[p] + a : out_off[p] + b],
                                              as_words(rbuf[o : o + b - a]))
                o += b - a

    def own():
        m = int(ins[me])
        if place is None:
            if m:
                src.copy_rows(in_off[me], in_off[me] + m, out[out_off[me] : out_off[me] + m])
        elif m and src.rows:
            g = place.own_gather(src, in_off[me], out_off[me], m)
            torch.index_select(as_words(src.x), 0, g, out=as_words(out))

    def post(c, packed):
        into = recv_view[c] if recv_view[c] is not None else rbufs[c % nrecv][: sum(recv_c[c])]
        return comm.all_to_all_single_async(into, packed, recv_c[c], send_c[c], kind=kind)

    def finish(c, work):
        if work is not None:
            work.wait()
        unpack(c)

    # Two chunks in flight: chunk c reuses the stages of chunk c-2, posted once that one is unpacked, so
    # one chunk's round-trip latency overlaps the other's transfer and the packing around them.
    comm.staging(staged)
    try:
        flying = [(0, post(0, pack(0)))]
        own()  # while chunk 0 is in flight
        for c in range(1, k):
            if len(flying) == IN_FLIGHT:
                finish(*flying.pop(0))  # chunk c-2: its stages are chunk c's
            flying.append((c, post(c, pack(c))))  # packed while chunk c-1 is in flight
        for c, work in flying:
            finish(c, work)
    finally:
        comm.staging(-staged)
    return out


class _A2A(torch.autograd.Function):
    """Differentiable packed all-to-all; the backward runs the transposed exchange with the saved plan."""

    @staticmethod
    def forward(ctx, comm, plan, plan_t, ins, outs, kind, x):
        ctx.saved = (comm, plan_t, ins, outs, kind)
        return _execute(comm, plan, Rows(x), ins, outs, kind, None)

    @staticmethod
    def backward(ctx, g):
        comm, plan_t, ins, outs, kind = ctx.saved
        return (None,) * 6 + (_execute(comm, plan_t, Rows(g.contiguous()), outs, ins, kind + "_bwd", None),)
