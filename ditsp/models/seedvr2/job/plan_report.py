"""What `ditsp plan` reports: a JSON-ready summary of a planned request, and its text form."""

from __future__ import annotations

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
                    weights=None) -> dict:
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
    dequantization buffer; default: every parameter in the compute dtype.
    """
    if feed not in ("rows", "canonical"):
        raise ValueError(f"feed must be 'rows' or 'canonical', got {feed!r}")
    b, d, p = dtype_bytes, cfg.vid_dim, schedule.world_size
    n = max(int(plan.rank_tokens.max()) for plan in schedule.plans.values())
    N = schedule.num_tokens
    hidden = cfg.mlp_hidden * 2  # SwiGLU: gate and in-projection (SiLU and product in place); GELU: fc1, act
    mlp = n * (4 * d + hidden) * b
    attention = int(n * ATTN_ROWS * d * b)
    exchange = n * 4 * d * b
    out_c, in_c = cfg.out_patch_channels, cfg.patch_channels
    if feed == "rows":
        output = n * (d + 2 * out_c) * b
        inputs = -(-N // p) * in_c * b
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


def summarize(schedule: SchedulePlan, cfg: NaDiTConfig, weights=None) -> dict:
    """The plan of one request as a plain dict (the ``--json`` schema)."""
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
    return {
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


def _window_size(plan) -> tuple[int, int, int]:
    return window_size(plan.layout.grid, plan.layout.num_windows)


def plan_request(grid, cfg: NaDiTConfig, world_size: int, planner: str = "lpt") -> SchedulePlan:
    return plan_schedule(grid, cfg.window_methods, world_size, planner, cfg.num_windows)


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
    if not summary["ulysses_heads_divisible"]:
        lines.append("  (Ulysses as in the reference needs heads % SP == 0; window SP does not)")
    return "\n".join(lines)
