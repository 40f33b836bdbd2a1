"""The report of a restoration: every rank's figures summed into rank 0's, its text, and its picture."""

from __future__ import annotations

import os

from ..pipeline.color_drift import format_color_drift
from ..pipeline.seams import format_seams

STAGES = ("read", "vae_encode", "dit", "vae_decode", "color_fix", "write")


def summarize(results: list[dict]) -> dict:
    """One report from every rank's: rank 0's, with per-rank peaks and bytes."""
    out = dict(results[0])
    out["world_size"] = len(results)
    out["rank_stage_peak_bytes"] = [r["stage_peak_bytes"] for r in results]
    out["rank_stage_cpu_s"] = [r["stage_cpu_s"] for r in results]
    out["rank_cpu_s"] = [r["cpu_s"] for r in results]
    out["rank_times"] = [{k: r[k] for k in ("entered_at", "load_s", "done_at")} for r in results]
    out["rank_bytes_sent"] = [r["bytes_sent"] for r in results]
    out["bytes_moved"] = sum(r["bytes_sent"] for r in results)
    for k in ("stage_peak_bytes", "stage_cpu_s", "cpu_s", "entered_at", "load_s", "done_at"):
        out.pop(k, None)
    out.pop("rank", None)
    return out


def format_report(s: dict) -> str:
    """The text report of `ditsp upscale`."""
    total = sum(s["stage_s"].values())
    lines = [
        *(["RANDOM WEIGHTS: seeded random weights (a smoke test), not a restoration"] if s.get("random_weights") else []),
        f"{s['input']} -> {s['output']}: {s['frames_written']} frames, {s['geometry']}, "
        f"{len(s['windows'])} window(s), SP={s['world_size']}",
        f"DiT: {s['dit_path']}",
        f"kernel calls: {s.get('kernel_shapes', 'deterministic')}",
        *([f"CPU allocator: {s['cpu_allocator']}"] if s.get("cpu_allocator") else []),
        f"compile: {s.get('compile', 'eager')}",
        *(f"{m}" for m in s["vae_modes"]),
        *(_recovered(r) for r in s.get("recovery") or ()),
        *(["APPROXIMATE: a VAE mode that is not exact ran (tiled: its tiles are blended), so the frames are not "
           "those of an exact mode"] if s.get("approximate") else []),
        *(f"input: {m}" for m in s.get("media_notes") or ()),
        f"{'stage':<11} {'time s':>8} {'share':>6} {'peak MiB (max rank)':>20}",
    ]
    for k in STAGES:
        peak = max(r[k] for r in s["rank_stage_peak_bytes"])
        lines.append(f"{k:<11} {s['stage_s'][k]:>8.2f} {100 * s['stage_s'][k] / max(total, 1e-9):>5.0f}% "
                     f"{peak / 2**20:>20.1f}")
    if s.get("written_behind"):  # a video (an image is written at once)
        lines.append("(the frames are encoded in a thread of their own, behind the next window; the encoder's "
                     "last frames at the end)")
    lines.append(f"bytes moved (all ranks): {s['bytes_moved'] / 2**20:.2f} MiB; frames sha256 {s['sha256'][:16]}")
    if s.get("seams"):
        lines.append(format_seams(s["seams"]))
    if s.get("color_drift"):
        lines.append(format_color_drift(s["color_drift"]))
    return "\n".join(lines)


def _recovered(r: dict) -> str:
    """A recovery step of the report (job/recovery.py) as a line."""
    what = (f"VAE mode {r['from']} -> {r['to']}" if r["kind"] == "vae_mode"
            else f"window frames {r['from']} -> {r['to']}, the clip restarted")
    ranks = ", ".join(map(str, r["ranks"]))
    return (f"recovered: window {r['window']}/{r['windows']}, rank{'s' if len(r['ranks']) > 1 else ''} {ranks} ran "
            f"out of memory in {r['stage']} ({r['error']}): {what}; {r['output']}")


def plot_report(s: dict, path: str) -> None:
    """Input vs output frames, and the per-stage timeline of rank 0 (one PNG, written atomically)."""
    import matplotlib  # local: a heavy optional package, loaded only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: a heavy optional package, loaded only when this runs

    samples = s.get("samples")
    k = 0 if samples is None else samples[0].shape[0]
    fig = plt.figure(figsize=(4 * max(k, 2), 7 if k else 3))
    rows = 3 if k else 1
    for i in range(k):
        for r, (imgs, label) in enumerate(zip(samples, ("input (resized)", "restored"))):
            ax = fig.add_subplot(rows, k, r * k + i + 1)
            ax.imshow(imgs[i].numpy())
            ax.set_title(f"{label}, sample {i + 1}", fontsize=9)
            ax.axis("off")
    ax = fig.add_subplot(rows, 1, rows)
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors))
    for stage, win, a, b in s["timeline"]:
        ax.barh(STAGES.index(stage), b - a, left=a, color=colors[stage], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(STAGES)), STAGES)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (rank 0)")
    ax.set_title(f"per-stage timeline, SP={s['world_size']}, {len(s['windows'])} window(s)", fontsize=9)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
