"""What `ditsp plan` reports: a JSON-ready summary of a planned request, and its text form."""

from __future__ import annotations

from ...windows.traffic import ulysses_traffic, window_sp_traffic
from .nadit.config import NaDiTConfig
from ...windows.schedule import SchedulePlan, plan_schedule

BF16 = 2


def summarize(schedule: SchedulePlan, cfg: NaDiTConfig) -> dict:
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
    }


def _window_size(plan) -> tuple[int, int, int]:
    from ...windows.geometry import window_size

    return window_size(plan.layout.grid, plan.layout.num_windows)


def plan_request(grid, cfg: NaDiTConfig, world_size: int, planner: str = "lpt") -> SchedulePlan:
    return plan_schedule(grid, cfg.window_methods, world_size, planner, cfg.num_windows)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


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
    if not summary["ulysses_heads_divisible"]:
        lines.append("  (Ulysses as in the reference needs heads % SP == 0; window SP does not)")
    return "\n".join(lines)
