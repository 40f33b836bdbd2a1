"""Pictures of plans: which rank owns which window, and how balanced the ranks are."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from .schedule import SchedulePlan  # noqa: E402


def _rank_colors(world: int):
    base = plt.get_cmap("tab20" if world > 10 else "tab10")
    return [base(i % base.N) for i in range(world)]


def plot_schedule(schedule: SchedulePlan, path: str, frame: int = 0, title: str | None = None) -> None:
    """One panel per layout (frame ``frame``'s windows coloured by owner) plus token bars."""
    plans = list(schedule.plans.values())
    world = schedule.world_size
    colors = _rank_colors(world)
    t, h, w = schedule.grid
    frame = min(frame, t - 1)
    fig, axes = plt.subplots(
        1, len(plans) + 1, figsize=(5.2 * len(plans) + 4.5, 4.6), gridspec_kw={"width_ratios": [w / h] * len(plans) + [1.2]}
    )
    for ax, plan in zip(axes, plans):
        owner = plan.owner_and_position()[0].reshape(t, h, w)[frame]
        ax.imshow(owner, cmap=ListedColormap(colors), vmin=-0.5, vmax=world - 0.5, interpolation="nearest")
        for i, (st, sh, sw) in enumerate(plan.layout.windows):
            if st.start <= frame < st.stop:
                ax.add_patch(
                    Rectangle((sw.start - 0.5, sh.start - 0.5), sw.stop - sw.start, sh.stop - sh.start,
                              fill=False, lw=0.8, ec="black")
                )
        ax.set_title(f"{plan.layout.name}: {len(plan.layout)} windows, imbalance {plan.imbalance:.3f}", fontsize=10)
        ax.set_xlabel("w (tokens)")
        ax.set_ylabel("h (tokens)")
    bar_ax = axes[-1]
    width = 0.8 / len(plans)
    for k, plan in enumerate(plans):
        x = np.arange(world) + (k - (len(plans) - 1) / 2) * width
        bar_ax.bar(x, plan.rank_tokens, width, color=colors, edgecolor="black", hatch=["", "//", "xx"][k % 3],
                   label=plan.layout.name)
    bar_ax.axhline(schedule.num_tokens / world, color="gray", ls="--", lw=1, label="mean")
    bar_ax.set_xticks(range(world))
    bar_ax.set_xlabel("rank")
    bar_ax.set_ylabel("video tokens")
    bar_ax.set_title("tokens per rank", fontsize=10)
    bar_ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or f"grid {t}x{h}x{w}, SP={world}, planner {schedule.planner} (frame {frame})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
