"""What `ditsp plan` reports: a JSON-ready summary of a planned request, and its text form."""

from __future__ import annotations

import math

from ....windows.capacity import Capacities, Shares, proportional_split
from ....windows.traffic import ulysses_traffic, window_sp_traffic
from ..nadit.config import NaDiTConfig
from ....windows.schedule import SchedulePlan, plan_schedule
from ....windows.geometry import window_size

BF16 = 2

# Live activation rows of width ``vid_dim`` at the attention peak of a window-SP layer (CPU grouped
# SDPA: the block's input and its qkv, normed q/k, the group's gathered q/k/v, rotated q/k, the
# text-extended k/v, the SDPA output, the output rows), measured with a live-tensor tracker on the
# ``small`` model; the text rows (replicated, tens of rows) are left out.
ATTN_ROWS = 12.5


def memory_estimate(schedule: SchedulePlan, cfg: NaDiTConfig, dtype_bytes: int = BF16, feed: str = "rows",
                    weights=None, rank: int | None = None) -> dict:
    """Peak memory of the most loaded rank of a window-SP forward, by part (bytes).

    ``activations`` is the block's peak (the larger of the MLP and attention
    phases: the layer's input, attention output, new residual and MLP input
    plus the MLP's hidden tensors; or :data:`ATTN_ROWS` rows of ``vid_dim``);
    ``exchange`` is a layout change (old rows, packed send, received and
    reordered rows); ``output`` the end of the forward: with ``feed="rows"``
    the rank's output rows and their hand-off, with ``"canonical"`` the
    all-gather of every rank's padded share plus the canonical and unpatched
    copies of the whole output. ``peak_added`` is what a forward adds to a
    rank holding the weights and its input (the largest phase);
    ``total`` adds the weights and the input. ``weights`` (a
    :class:`~ditsp.weights.sizing.WeightBytes`) counts them as stored (FP8, GGUF) plus one layer's
    dequantization buffer; default: every parameter in the compute dtype. ``rank``: that rank's tokens and
    input share (ranks of unequal capacity) instead of the most loaded rank's.
    """
    if feed not in ("rows", "canonical"):
        raise ValueError(f"feed must be 'rows' or 'canonical', got {feed!r}")
    b, d, p = dtype_bytes, cfg.vid_dim, schedule.world_size
    if rank is None:
        n = max(int(plan.rank_tokens.max()) for plan in schedule.plans.values())
    else:
        n = max(int(plan.rank_tokens[rank]) for plan in schedule.plans.values())
    N = schedule.num_tokens
    hidden = cfg.mlp_hidden * 2  # SwiGLU: gate and in-projection (SiLU and product in place); GELU: fc1, act
    mlp = n * (4 * d + hidden) * b
    attention = int(n * ATTN_ROWS * d * b)
    exchange = n * 4 * d * b
    out_c, in_c = cfg.out_patch_channels, cfg.patch_channels
    if feed == "rows":
        output = n * (d + 2 * out_c) * b
        inputs = _input_rows(schedule, rank) * in_c * b
    else:
        output = (p * n + 2 * N) * out_c * b + n * d * b
        inputs = 2 * N * in_c * b  # the whole latent and its patched copy
    phases = {"activations": max(mlp, attention), "mlp": mlp, "attention": attention, "exchange": exchange,
              "output": output}
    peak = max(mlp, attention, exchange, output)
    kept, buffer, fmt = (cfg.param_count() * b, 0, "bf16" if b == BF16 else f"{8 * b}-bit") if weights is None \
        else (weights.kept, weights.buffer, weights.fmt)
    return {"rank_tokens": n, "weights": kept, "weights_format": fmt, "dequant_buffer": buffer, "input": inputs,
            **phases, "peak_added": peak, "total": kept + buffer + inputs + peak, "feed": feed, "dtype_bytes": b}


def _input_rows(schedule: SchedulePlan, rank: int | None) -> int:
    """Rows of the DiT's input a rank holds before the first layout (the VAE's slab: its speed's share)."""
    N, p = schedule.num_tokens, schedule.world_size
    if rank is None or schedule.shares is None:
        return -(-N // p)
    return proportional_split(N, schedule.shares.speed)[rank]


def token_bytes(cfg: NaDiTConfig, dtype_bytes: int = BF16) -> int:
    """Bytes of a window-SP forward's peak per token a rank holds (feed ``rows``: :func:`memory_estimate`'s
    phases are each linear in the rank's tokens)."""
    b, d = dtype_bytes, cfg.vid_dim
    hidden = cfg.mlp_hidden * 2
    return max((4 * d + hidden) * b, int(ATTN_ROWS * d * b), 4 * d * b, (d + 2 * cfg.out_patch_channels) * b)


def token_caps(cfg: NaDiTConfig, num_tokens: int, caps: Capacities, weights=None,
               dtype_bytes: int = BF16) -> tuple[int, ...] | None:
    """Per rank, the most tokens its memory holds in a window-SP forward (the weights, its input share and
    the peak per token, :func:`memory_estimate`); None without memory figures."""
    if caps.memory is None:
        return None
    kept = cfg.param_count() * dtype_bytes if weights is None else weights.kept + weights.buffer
    per = token_bytes(cfg, dtype_bytes)
    rows = proportional_split(num_tokens, caps.speed)
    return tuple(max(0, (m - kept - r * cfg.patch_channels * dtype_bytes) // per)
                 for m, r in zip(caps.memory, rows))


def rank_table(schedule: SchedulePlan, cfg: NaDiTConfig, caps: Capacities, weights=None) -> dict:
    """Per rank: its speed and budget, tokens (the most over layouts), modelled memory, whether it fits, and
    modelled time; and the forward's modelled time. Times are in units of one forward of every token on
    one speed-1 rank: a rank's is the sum over layers of its tokens / speed, the forward's the sum over
    layers of the slowest rank's (the ranks meet at every layout change)."""
    p, N = schedule.world_size, schedule.num_tokens
    layers = [schedule.layer_plan(i) for i in range(len(schedule.layer_methods))]
    ranks = []
    for r in range(p):
        m = memory_estimate(schedule, cfg, weights=weights, rank=r)
        budget = None if caps.memory is None else caps.memory[r]
        ranks.append({
            "rank": r, "speed": caps.speed[r], "memory_budget": budget,
            "tokens": max(int(plan.rank_tokens[r]) for plan in schedule.plans.values()),
            "memory": m["total"], "fits": None if budget is None else m["total"] <= budget,
            "modelled_time": round(sum(int(pl.rank_tokens[r]) for pl in layers) / caps.speed[r] / (len(layers) * N), 6),
        })
    forward = sum(max(int(pl.rank_tokens[r]) / caps.speed[r] for r in range(p)) for pl in layers) / (len(layers) * N)
    return {"ranks": ranks, "modelled_time": round(forward, 6),
            "fits": None if caps.memory is None else all(x["fits"] for x in ranks)}


def summarize(schedule: SchedulePlan, cfg: NaDiTConfig, weights=None, capacities: Capacities | None = None,
              even: SchedulePlan | None = None) -> dict:
    """The plan of one request as a plain dict (the ``--json`` schema). ``capacities``: the ranks' speeds
    and memory (``capacities`` and ``per_rank``: each rank's tokens, memory and modelled time), with
    ``even`` the same request split evenly for comparison (``equal_split``)."""
    p = schedule.world_size
    layouts = {}
    for plan in schedule.plans.values():
        layouts[plan.layout.name] = {
            "windows": len(plan.layout),
            "window_size": list(_window_size(plan)),
            "rank_tokens": [int(v) for v in plan.rank_tokens],
            "rank_windows": [len(w) for w in plan.rank_windows],
            "imbalance": round(plan.imbalance, 6),
        }
    trans = {}
    for name, t in schedule.distinct_transitions().items():
        trans[name] = {
            "tokens_moved": t.tokens_moved,
            "fraction_moved": round(t.fraction_moved, 6),
            "max_rank_send_tokens": int(t.rank_send.max()),
            "max_rank_recv_tokens": int(t.rank_recv.max()),
            "count_matrix": t.counts.tolist(),
        }
    wsp = window_sp_traffic(schedule, cfg.vid_dim, cfg.txt_len, cfg.out_patch_channels, BF16)
    uly = ulysses_traffic(
        schedule.num_tokens, cfg.txt_len, p, cfg.num_layers, cfg.heads * cfg.head_dim, cfg.out_patch_channels, BF16
    )
    out = {
        "model": cfg.name,
        "grid": list(schedule.grid),
        "tokens": schedule.num_tokens,
        "world_size": p,
        "planner": schedule.planner,
        "layers": cfg.num_layers,
        "layouts": layouts,
        "transitions": len(schedule.transitions()),
        "transition": trans,
        "bytes_per_forward": {"window_sp": wsp.total, "ulysses": uly.total},
        "bytes_breakdown": {"window_sp": wsp.as_dict(), "ulysses": uly.as_dict()},
        "ulysses_heads_divisible": cfg.heads % p == 0,
        "memory_per_rank": memory_estimate(schedule, cfg, weights=weights),
    }
    if capacities is not None:
        out["capacities"] = capacities.as_dict()
        out["per_rank"] = rank_table(schedule, cfg, capacities, weights)
        if even is not None:
            out["equal_split"] = rank_table(even, cfg, capacities, weights)
    return out


def _window_size(plan) -> tuple[int, int, int]:
    return window_size(plan.layout.grid, plan.layout.num_windows)


def plan_request(grid, cfg: NaDiTConfig, world_size: int, planner: str = "lpt",
                 shares: Shares | None = None) -> SchedulePlan:
    return plan_schedule(grid, cfg.window_methods, world_size, planner, cfg.num_windows, shares=shares)


def plan_for(grid, cfg: NaDiTConfig, caps: Capacities, planner: str = "lpt", weights=None) -> SchedulePlan:
    """The plan for ranks of ``caps``: balanced by modelled time under the tokens each rank's memory holds,
    or, where their memory cannot hold the request together, by speed alone (the report then says which
    rank does not fit)."""
    n = int(math.prod(grid))
    limits = token_caps(cfg, n, caps, weights)
    if limits is not None and sum(limits) < n:
        limits = None
    return plan_request(grid, cfg, caps.world_size, planner, caps.shares(limits))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _weights(m: dict) -> str:
    if not m.get("dequant_buffer"):
        fmt = m.get("weights_format")
        return f"{_gib(m['weights'])}" + (f" ({fmt})" if fmt and fmt != "bf16" else "")
    return f"{_gib(m['weights'])} ({m['weights_format']}) + dequant buffer {_gib(m['dequant_buffer'])}"


def format_summary(summary: dict, notes: list[str] = ()) -> str:
    """Human-readable plan (what `ditsp plan` prints)."""
    t, h, w = summary["grid"]
    lines = [
        f"model {summary['model']}: grid T,H,W = {t},{h},{w} -> {summary['tokens']:,} video tokens, "
        f"SP={summary['world_size']}, planner {summary['planner']}",
    ]
    lines += [f"  note: {n}" for n in notes]
    for name, lay in summary["layouts"].items():
        lines.append(
            f"{name:>8}: {lay['windows']} windows of up to {'x'.join(map(str, lay['window_size']))}, "
            f"imbalance {lay['imbalance']:.4f}"
        )
        lines.append(f"{'':>10}rank tokens  {lay['rank_tokens']}")
        lines.append(f"{'':>10}rank windows {lay['rank_windows']}")
    lines.append(f"transitions per forward: {summary['transitions']} ({summary['layers']} layers)")
    for name, tr in summary["transition"].items():
        lines.append(
            f"  {name}: {tr['tokens_moved']:,} tokens moved ({100 * tr['fraction_moved']:.1f}%), "
            f"max per-rank send {tr['max_rank_send_tokens']:,}, recv {tr['max_rank_recv_tokens']:,}"
        )
    b = summary["bytes_per_forward"]
    ratio = b["window_sp"] / b["ulysses"] if b["ulysses"] else float("nan")
    lines.append(
        f"bytes per forward (bf16, all ranks): window SP {_gib(b['window_sp'])}, "
        f"Ulysses {_gib(b['ulysses'])} ({ratio:.2f}x)"
    )
    m = summary.get("memory_per_rank")
    if m:
        lines.append(
            f"memory per rank (bf16, window SP, most loaded rank {m['rank_tokens']:,} tokens): "
            f"total {_gib(m['total'])} = weights {_weights(m)} + input {_gib(m['input'])} + peak "
            f"{_gib(m['peak_added'])} (MLP {_gib(m['mlp'])}, attention workspace {_gib(m['attention'])}, "
            f"exchange buffers {_gib(m['exchange'])}, output {_gib(m['output'])})"
        )
    if summary.get("per_rank"):
        lines += _rank_lines(summary)
    if not summary["ulysses_heads_divisible"]:
        lines.append("  (Ulysses as in the reference needs heads % SP == 0; window SP does not)")
    return "\n".join(lines)


def _rank_lines(summary: dict) -> list[str]:
    """The per-rank table of a plan for ranks of unequal capacity, and the equal split beside it."""
    pr, eq = summary["per_rank"], summary.get("equal_split")
    lines = ["per rank (bf16, window SP; modelled time in forwards of every token on one speed-1 rank):",
             f"  {'rank':>4} {'speed':>6} {'tokens':>10} {'memory':>22} {'time':>7}"
             + (f" | equal split {'tokens':>10} {'memory':>10} {'time':>7}" if eq else "")]
    for i, r in enumerate(pr["ranks"]):
        budget = "" if r["memory_budget"] is None else f" of {r['memory_budget'] / 2**30:.2f}"
        mark = "" if r["fits"] is None else ("" if r["fits"] else " NO FIT")
        row = (f"  {r['rank']:>4} {r['speed']:>6g} {r['tokens']:>10,} {_gib(r['memory']) + budget + mark:>22} "
               f"{r['modelled_time']:>7.4f}")
        if eq:
            e = eq["ranks"][i]
            mem = f"{e['memory'] / 2**30:.2f} GiB" + ("" if e["fits"] in (None, True) else "!")
            row += f" | {'':11} {e['tokens']:>10,} {mem:>10} {e['modelled_time']:>7.4f}"
        lines.append(row)
    tail = f"  forward: modelled time {pr['modelled_time']:.4f}"
    if pr["fits"] is not None:
        tail += ", every rank fits" if pr["fits"] else ", does NOT fit"
    if eq:
        tail += (f" (equal split: {eq['modelled_time']:.4f}"
                 + ("" if eq["fits"] is None else (", fits" if eq["fits"] else ", does not fit")) + ")")
    return lines + [tail]
