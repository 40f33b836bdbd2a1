"""Analytical bytes per forward for window-aligned SP and for the reference Ulysses path.

"Bytes" are payload bytes that leave a rank, summed over all ranks (a row a
rank keeps is free). Both paths end with the same all-gather of the output
patches, which is counted for both. A ring all-reduce of S bytes sends
2 * (P-1) / P * S per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import SchedulePlan


@dataclass(frozen=True)
class Traffic:
    transitions: int = 0
    text: int = 0
    attention: int = 0
    gather: int = 0

    @property
    def total(self) -> int:
        return self.transitions + self.text + self.attention + self.gather

    def as_dict(self) -> dict:
        return {
            "transitions": self.transitions,
            "text": self.text,
            "attention": self.attention,
            "gather": self.gather,
            "total": self.total,
        }


def _gather_bytes(tokens: int, world: int, out_channels: int, elem: int) -> int:
    return (world - 1) * tokens * out_channels * elem


def window_sp_traffic(
    schedule: SchedulePlan, dim: int, txt_len: int, out_channels: int, elem_bytes: int = 2
) -> Traffic:
    """Plan A: one row exchange per transition, a text all-reduce per layer but
    the last (whose text output the model discards), one final gather."""
    p = schedule.world_size
    moved = sum(t.tokens_moved for _, t in schedule.transitions())
    text_layers = max(0, len(schedule.layer_methods) - 1)
    text = text_layers * 2 * (p - 1) * txt_len * dim * elem_bytes if p > 1 else 0
    return Traffic(
        transitions=moved * dim * elem_bytes,
        text=text,
        gather=_gather_bytes(schedule.num_tokens, p, out_channels, elem_bytes),
    )


def ulysses_traffic(
    tokens: int, txt_len: int, world: int, layers: int, inner: int, out_channels: int, elem_bytes: int = 2
) -> Traffic:
    """Reference Ulysses: Q, K, V and O all-to-alls per layer over text+video,
    each moving (P-1)/P of an activation-sized tensor."""
    seq = tokens + txt_len
    per_a2a = seq * inner * elem_bytes * (world - 1) // world
    return Traffic(attention=4 * layers * per_a2a, gather=_gather_bytes(tokens, world, out_channels, elem_bytes))


def halo_traffic(plan, dim: int, inner: int, txt_len: int, out_channels: int, elem_bytes: int = 2) -> Traffic:
    """Plan B (:class:`ditsp.sp.halo_slab.HaloPlan`): per layer every halo row's Q/K/V
    (``3 * inner``) goes to the rank attending its window and its attention output
    (``inner``) comes back; the residual stream never moves. Text all-reduce and
    output gather as Plan A. ``dim`` is unused by the halo itself (kept for symmetry)."""
    p = plan.world_size
    halo = sum(plan.halo_rows_per_layer())
    text_layers = max(0, len(plan.layer_methods) - 1)
    text = text_layers * 2 * (p - 1) * txt_len * dim * elem_bytes if p > 1 else 0
    return Traffic(attention=halo * 4 * inner * elem_bytes, text=text,
                   gather=_gather_bytes(plan.num_tokens, p, out_channels, elem_bytes))


def rounds_per_layer(path: str, transitions: int, layers: int, halo_layers: int = 0) -> dict:
    """Collective rounds per layer (averaged over the forward) on the latency-bound path.

    ``window``: one all-to-all per layout change, one text all-reduce per layer;
    ``halo``: two all-to-alls per layer whose layout has a halo, one text all-reduce;
    ``ulysses``: two all-to-alls (Q/K/V in, output out) and one text all-gather per layer.
    """
    if path == "window":
        a2a = transitions / layers
    elif path == "halo":
        a2a = 2 * halo_layers / layers
    elif path == "ulysses":
        a2a = 2.0
    else:
        raise ValueError(f"unknown path {path!r}")
    return {"all_to_all": a2a, "text": 1.0, "total": a2a + 1.0}
