"""What a request needs on one GPU model (`ditsp plan --gpu`): per-rank memory and modelled stage times per SP
degree, and the smallest degree (with its VAE mode) that fits the card.

Memory is the estimator that admits or refuses a restoration (:func:`.budget.estimate`: DiT weights, DiT
activations, latents, the VAE's peak in the mode ``auto`` picks against what is left), its DiT activations
raised to the planned forward's peak on the most loaded rank where that is larger
(:func:`.plan_report.memory_estimate`), times the caching allocator's overhead, plus the per-rank CUDA
context. Times are counted work over the card's spec rates at a stated efficiency
(:class:`Efficiency`): the DiT's FLOPs on the busiest rank of the plan and the exchange's bytes (the
plan's transitions, the text all-reduce, the output gather) through :func:`ditsp.sp.choice.path_costs`, the
VAE's FLOPs and bytes on one rank's piece in its mode (:mod:`..vae.flops`). Every figure is a model, not a
measurement, until a GPU run calibrates :class:`Efficiency`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...gpus import Gpu
from ....sp.choice import Link, path_costs
from ..presets import dit_config, vae_config
from ..vae.flops import decoder_work, encoder_work
from ..vae.memory import piece_of
from ..vae.modes import BY_NAME
from .budget import estimate
from .plan_report import memory_estimate, plan_request
from .weight_memory import dit_weights

GiB = 2**30
DEGREES = tuple(range(1, 9))
DTYPE = "bf16"  # the compute dtype sized for
ELEM = 2


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the spec figures each stage reaches, and the device memory the tensors leave out.

    A model, not measured: nothing of ditsp has run on a GPU yet. A GPU measurement (``make gpu-check``: the
    DiT's achieved TFLOP/s, the VAE's times, peaks against the estimate) replaces these values and ``source``.
    """

    dit: float = 0.5  # of the dense bf16 rate: the DiT's matmuls and window attention
    vae: float = 0.3  # of the dense bf16 rate: the VAE's 3-D convolutions
    memory: float = 0.7  # of the device memory bandwidth: the VAE's norms, adds and copies
    link: float = 0.7  # of the link's per-direction rate: all-to-all, all-reduce, gather
    nvlink_latency_s: float = 10e-6  # per collective round
    pcie_latency_s: float = 25e-6
    allocator: float = 1.10  # the caching allocator's reserved bytes over the tensors' bytes
    context_gib: float = 1.0  # per rank: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
    source: str = "model, not measured"

    def link_of(self, gpu: Gpu) -> Link:
        return Link(bandwidth=gpu.link_gbs * 1e9 * self.link,
                    latency=self.nvlink_latency_s if gpu.nvlink else self.pcie_latency_s,
                    flops=gpu.bf16_tflops * 1e12 * self.dit, name=f"{gpu.label} {gpu.link}")


MODEL = Efficiency()


def pixels_of_grid(grid, model: str) -> tuple[int, tuple[int, int]]:
    """(padded frames, (height, width)) of the clip whose latent patchifies to ``grid``."""
    vcfg, (pt, ph, pw) = vae_config(model), dit_config(model).patch_size
    t, h, w = grid
    return (t * pt - 1) * vcfg.temporal_factor + 1, (h * ph * vcfg.spatial_factor, w * pw * vcfg.spatial_factor)


def vae_rank_work(model: str, op: str, frames: int, out_hw, sp: int, mode: str):
    """FLOPs and bytes of the busiest rank's share of ``op`` in ``mode``: the whole clip (replicated, chunked,
    tiled: chunks and tiles change memory, not the work, overlaps aside), its frames (time) or its rows (the
    height modes: the mid attention still on the whole frame)."""
    vcfg = vae_config(model)
    H, W = out_hw
    full = (frames, H, W) if op == "encode" else vcfg.latent_shape(frames, H, W)
    m, pc = BY_NAME[mode], piece_of(vcfg, op, (frames, H, W), sp, mode)
    shape = (pc.frames if mode == "time" else full[0], pc.rows if m.slab else full[1], full[2])
    full_rows = vcfg.latent_shape(frames, H, W)[1] if m.slab and sp > 1 else None
    return (encoder_work if op == "encode" else decoder_work)(vcfg, shape, ELEM, full_rows)


def size_degree(model: str, grid, sp: int, planner: str, gpu: Gpu, fmt: str = "bf16", layers: int | None = None,
                eff: Efficiency = MODEL) -> dict:
    """One row of the sizing: memory per rank (bytes, by part), VAE mode, counted work and modelled seconds."""
    cfg = dit_config(model, layers)
    frames, out_hw = pixels_of_grid(grid, model)
    weights = dit_weights(model, DTYPE, fmt=fmt, layers=layers)
    plan_dit = memory_estimate(plan_request(grid, cfg, sp, planner), cfg, weights=weights)
    dit_plan = plan_dit["input"] + plan_dit["peak_added"]
    card = int(gpu.memory_gib * GiB)
    budget = int((card - eff.context_gib * GiB) / eff.allocator)  # what the tensors may take
    base = estimate(model, DTYPE, frames, out_hw, sp, weights=weights)
    extra = max(0, dit_plan - base.dit_activations)
    e = estimate(model, DTYPE, frames, out_hw, sp, "auto", budget - extra, weights=weights)
    tensors = e.total + extra
    per_rank = int(tensors * eff.allocator + eff.context_gib * GiB)
    cost = path_costs(cfg, grid, sp, eff.link_of(gpu), ELEM, candidates=(f"window/{planner}",))[0]
    rate, bw = gpu.bf16_tflops * 1e12, gpu.memory_tbs * 1e12
    work = {op: vae_rank_work(model, op, frames, out_hw, sp, e.vae_mode) for op in ("encode", "decode")}
    vae_s = {op: max(w.flops / (rate * eff.vae), w.bytes / (bw * eff.memory)) for op, w in work.items()}
    seconds = {"dit": cost.compute_s, "vae_encode": vae_s["encode"], "vae_decode": vae_s["decode"],
               "exchange": cost.comm_s + cost.latency_s}
    seconds["total"] = sum(seconds.values())
    return {
        "sp": sp, "vae_mode": e.vae_mode, "vae_exact": BY_NAME[e.vae_mode].exact,
        "memory": {"dit_weights": e.dit_weights, "dit_dequant": e.dit_dequant,
                   "dit_activations": e.dit_activations + extra, "latents": e.latents, "vae": e.vae,
                   "tensors": tensors, "allocator_factor": eff.allocator, "context": int(eff.context_gib * GiB),
                   "per_rank": per_rank, "card": card, "fits": per_rank <= card},
        "flops": {"dit": cost.compute_s * eff.link_of(gpu).flops, "vae_encode": work["encode"].flops,
                  "vae_decode": work["decode"].flops},
        "bytes": {"vae_encode": work["encode"].bytes, "vae_decode": work["decode"].bytes,
                  "exchange": cost.bytes},
        "seconds": seconds,
    }


def size(model: str, grid, gpu: Gpu, planner: str = "lpt", degrees=DEGREES, fmt: str = "bf16",
         layers: int | None = None, eff: Efficiency = MODEL) -> dict:
    """The sizing of ``grid`` on ``gpu`` at each degree (the ``--json`` ``gpu`` object), and what the job needs:
    the smallest degree that fits with an exact VAE mode, else with tiled (approximate), else none."""
    rows = []
    for sp in sorted(set(degrees)):
        try:
            rows.append(size_degree(model, grid, sp, planner, gpu, fmt, layers, eff))
        except ValueError as e:
            rows.append({"sp": sp, "error": str(e)})
    ok = [r for r in rows if "error" not in r and r["memory"]["fits"]]
    pick = next((r for r in ok if r["vae_exact"]), ok[0] if ok else None)
    needs = None if pick is None else {"sp": pick["sp"], "vae_mode": pick["vae_mode"], "exact": pick["vae_exact"],
                                       "per_rank": pick["memory"]["per_rank"]}
    return {"gpu": gpu.as_dict(), "model": asdict(eff), "planner": planner, "weights_format": fmt,
            "degrees": rows, "needs": needs}


def format_sizing(s: dict) -> str:
    """The text table `ditsp plan --gpu` prints."""
    g, e = s["gpu"], s["model"]
    card = g["memory_gib"]
    lines = [
        f"GPU sizing on {g['label']}: {card:g} GiB, bf16 {g['bf16_tflops']:g} TFLOP/s dense, memory "
        f"{g['memory_tbs']:g} TB/s, {g['link']} {g['link_gbs']:g} GB/s per direction ({g['source']})",
        f"  {e['source']}: DiT at {e['dit']:.0%} and VAE at {e['vae']:.0%} of the bf16 rate, memory at "
        f"{e['memory']:.0%}, link at {e['link']:.0%}; per rank = tensors x {e['allocator']:.2f} (allocator) + "
        f"{e['context_gib']:g} GiB (context)",
        f"  {'SP':>3}  {'VAE mode':<16}{'per rank':>10}  {'fits':<4}{'DiT s':>8}{'encode s':>10}{'decode s':>10}"
        f"{'exchange s':>12}{'total s':>9}",
    ]
    for r in s["degrees"]:
        if "error" in r:
            lines.append(f"  {r['sp']:>3}  cannot plan: {r['error']}")
            continue
        m, t = r["memory"], r["seconds"]
        mode = r["vae_mode"] + ("" if r["vae_exact"] else " (approx)")
        lines.append(
            f"  {r['sp']:>3}  {mode:<16}{m['per_rank'] / GiB:>6.1f} GiB  {'yes' if m['fits'] else 'no':<4}"
            f"{t['dit']:>8.2f}{t['vae_encode']:>10.2f}{t['vae_decode']:>10.2f}{t['exchange']:>12.3f}{t['total']:>9.2f}")
    n = s["needs"]
    if n is None:
        lines.append(f"needs: more than SP {s['degrees'][-1]['sp']} on this card (or smaller weights, shorter windows)")
    else:
        lines.append(f"needs: SP {n['sp']} with VAE mode {n['vae_mode']}{'' if n['exact'] else ' (APPROXIMATE)'} "
                     f"({n['per_rank'] / GiB:.1f} of {card:g} GiB per rank)")
    return "\n".join(lines)


def plot_sizing(s: dict, path: str) -> None:
    """Per-rank memory against the card, and the stacked stage times, per SP degree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in s["degrees"] if "error" not in r]
    sp = [r["sp"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.bar(sp, [r["memory"]["per_rank"] / GiB for r in rows], color=["tab:green" if r["memory"]["fits"] else
                                                                   "tab:red" for r in rows])
    a.axhline(s["gpu"]["memory_gib"], color="black", ls="--", lw=1, label=f"{s['gpu']['name']} memory")
    for x, r in zip(sp, rows):
        a.annotate(r["vae_mode"], (x, r["memory"]["per_rank"] / GiB), ha="center", va="bottom", fontsize=7)
    a.set(xlabel="SP degree", ylabel="GiB per rank", title="per-rank memory (model)")
    a.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for key in ("dit", "vae_encode", "vae_decode", "exchange"):
        vals = [r["seconds"][key] for r in rows]
        b.bar(sp, vals, bottom=bottom, label=key)
        bottom = [x + v for x, v in zip(bottom, vals)]
    b.set(xlabel="SP degree", ylabel="seconds", title=f"stage times ({s['model']['source']})")
    b.legend(fontsize=8)
    fig.suptitle(s["gpu"]["label"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
