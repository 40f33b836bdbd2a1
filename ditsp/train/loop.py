"""The training loop on an SP group: AdamW, optional bf16 autocast, gradient clipping, checkpoints.

Every rank of the group runs the same loop on the same batch (data and noise
of step ``s`` are a pure function of (seed, s)). The DiT's forward and
backward run under window SP (:mod:`ditsp.distributed.autograd`); the
parameters' partial gradients are summed in rank order, so every rank holds
the same gradients, takes the same AdamW step and keeps the same weights:
rank 0 alone writes checkpoints, the plot and the report. The VAE (frozen in
the ``dit`` objective) runs replicated on every rank.

Data-parallel replicas of SP groups (``dp x sp`` ranks) are not built: the
loop would need a second (data) group whose gradient all-reduce follows the
SP one, and a batch split by replica.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import ParallelConfig
from ..distributed.autograd import reduce_gradients
from ..distributed.comm import Comm
from ..models.seedvr2.compiled import compile_dit, compile_vae, describe
from ..models.seedvr2.nadit.model import NaDiT, build_model
from ..models.seedvr2.vae.model import VideoVAE
from ..weights import is_quantized
from . import checkpoint as ckpt
from .data import ClipPairs
from .objective import DIT_LOSSES, OBJECTIVES, check_vae_training, dit_loss, init_dit_as_identity, init_for_training, vae_loss
from ..models.seedvr2.presets import MODELS, dit_config, vae_config
from ..models.seedvr2.vae.fixtures import seeded_vae
from ..models.seedvr2.vae.checkpoint import load_checkpoint as load_vae
import math
from dataclasses import replace
from ..models.seedvr2.parallelize import parallelize


@dataclass
class TrainConfig:
    objective: str = "dit"
    out: str = "out/train"
    steps: int = 100
    batch: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    bf16: bool = False
    seed: int = 0
    frames: int = 5
    size: tuple = (32, 32)  # clean clip (h, w), or several (h, w) taken in turn, step by step
    sp: int = 1
    path: str = "window"
    planner: str = "lpt"
    model: str = "tiny"
    dit: str | None = None  # initial DiT weights (safetensors); default: seeded
    vae: str | None = None  # initial VAE weights (safetensors); default: seeded
    freeze: tuple = ()  # DiT parameter-name prefixes kept fixed
    dit_loss: str = "mse"  # the DiT objective's distance (objective.DIT_LOSSES)
    activation_checkpointing: bool = False
    # torch.compile of the DiT blocks and the VAE's GroupNorm+SiLU (ditsp.models.seedvr2.compiled); the DiT's
    # runtime then runs plain kernel calls (compiled kernels are not fixed-shape calls)
    compile: bool = False
    checkpoint_every: int = 50
    resume: bool = False
    progress: bool = True
    plot: bool = True
    warmup: int = 20
    json: bool = False

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose from {', '.join(OBJECTIVES)}")
        if self.dit_loss not in DIT_LOSSES:
            raise ValueError(f"unknown DiT loss {self.dit_loss!r}; choose from {', '.join(DIT_LOSSES)}")
        if self.objective == "vae":
            check_vae_training(self.sp)
        for name in ("steps", "batch", "frames", "sp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(sorted(MODELS))}")
        vae = vae_config(self.model)
        if (self.frames - 1) % vae.temporal_factor:
            raise ValueError(f"a clip of this model's VAE needs {vae.temporal_factor}n + 1 frames, got {self.frames}")
        sizes = tuple(tuple(s) for s in self.size) if self.size and not isinstance(self.size[0], int) \
            else (tuple(self.size),)
        multiple = vae.spatial_factor * 2  # the VAE's space factor times the DiT's 2x2 patch
        for s in sizes:
            if len(s) != 2 or any(v < multiple or v % multiple for v in s):
                raise ValueError(f"the clip size must be a multiple of {multiple} (this model's VAE and patch), "
                                 f"got {s[::-1]} (WxH)")
        self.size = sizes[0] if len(sizes) == 1 else sizes
        self.freeze = tuple(self.freeze)
        for name, low in (("lr", 0.0), ("clip", 0.0), ("weight_decay", None)):  # None: >= 0, else > low
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v >= 0 if low is None else v > low)):
                raise ValueError(f"{name} must be a finite number {'>= 0' if low is None else '> 0'}, got {v!r}")
        if self.checkpoint_every < 1 or self.warmup < 0:
            raise ValueError(f"checkpoint_every must be >= 1 and warmup >= 0, got {self.checkpoint_every} and "
                             f"{self.warmup}")

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """The clip sizes (h, w), taken in turn: step ``s`` uses ``sizes[s % len(sizes)]``."""
        return (self.size,) if isinstance(self.size[0], int) else self.size


def text_embedding(model: NaDiT, seed: int = 0) -> torch.Tensor:
    """The text the restoration pipeline gives a model without an embedding file (weights.load's draw)."""
    return torch.randn(model.cfg.txt_len, model.cfg.txt_in_dim, generator=torch.Generator().manual_seed(seed + 11))


def build(cfg: TrainConfig):
    """(dit, vae, the trainable modules by name, their parameters) of ``cfg``, fp32."""

    dit = build_model(dit_config(cfg.model), checkpoint=cfg.dit, seed=0)
    if cfg.objective == "dit" and not cfg.dit:
        init_dit_as_identity(dit)  # a restorer from scratch starts at "x0 = the degraded latent"
    vae_cfg = vae_config(cfg.model)
    vae = seeded_vae(vae_cfg, 7)
    if cfg.vae:
        load_vae(vae, cfg.vae)
    elif cfg.objective == "vae":
        init_for_training(vae)
    vae = vae.float()
    dit.checkpoint_blocks = cfg.activation_checkpointing
    if cfg.objective == "dit":
        trainable = {"dit": dit}
        params = [p for n, p in dit.named_parameters() if not n.endswith(".rope.freqs")
                  and not any(n.startswith(f) for f in cfg.freeze)]
    else:
        trainable = {"vae": vae}
        params = list(vae.parameters())
    quantized = [f"--{name} {path}" for name, path, m in (("dit", cfg.dit, dit), ("vae", cfg.vae, vae))
                 if path and is_quantized(m) and name in trainable]
    if quantized:  # FP8 bytes and GGUF blocks have no gradient: training needs float weights
        raise ValueError(f"{quantized[0]}: quantized weights (FP8/GGUF) cannot be trained; give a float checkpoint "
                         f"(fp32/fp16/bf16 .safetensors or .pth)")
    for m in (dit, vae):
        m.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return dit, vae, trainable, params


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% over the run."""

    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


class Trainer:
    """One rank's training state; ``group`` None trains on this device alone."""

    def __init__(self, cfg: TrainConfig, group=None):
        self.cfg, self.group = cfg, group
        self.comm = Comm.of(group)
        self.dit, self.vae, self.modules, self.params = build(cfg)
        if cfg.compile:
            compile_dit(self.dit)
            compile_vae(self.vae)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.data = ClipPairs(cfg.frames, cfg.sizes[0], cfg.seed)
        self.text = text_embedding(self.dit)
        self.step, self.losses = 0, []
        self.saved = 0  # the step of the last checkpoint written or resumed from (0: none)
        self.names = {id(p): f"{k}.{n}" for k, m in self.modules.items() for n, p in m.named_parameters()}
        self._runtimes = {}

    @property
    def rank0(self) -> bool:
        return self.comm.rank == 0

    def runtime(self, latent_shape):
        if self.cfg.objective != "dit":
            return None
        if latent_shape not in self._runtimes:
            grid = self.dit.grid_of(latent_shape)
            pc = ParallelConfig.window(self.comm.world_size, window_path=self.cfg.path,
                                       window_planner=self.cfg.planner if self.cfg.path == "window" else None,
                                       **({"deterministic": False} if self.cfg.compile else {}))
            self._runtimes[latent_shape] = parallelize(self.dit.cfg, pc, grid, self.group)
        return self._runtimes[latent_shape]

    def loss(self, step: int) -> torch.Tensor:
        size = self.cfg.sizes[step % len(self.cfg.sizes)]
        if self.cfg.objective == "vae":  # clean clips only: the degradations (real codecs) cost more than a step
            clean = self.data.clean_batch(step, self.cfg.batch, size)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
                return vae_loss(self.vae, clean).float()
        degraded, clean = self.data.batch(step, self.cfg.batch, size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            g = torch.Generator().manual_seed(self.cfg.seed * 7919 + step + 1)
            t, h, w = self.vae.cfg.latent_shape(self.cfg.frames, *size)
            return dit_loss(self.dit, self.vae, self.text, degraded, clean, g, self.runtime((t, h, w)),
                            self.cfg.dit_loss).float()

    def gradients(self, step: int) -> float:
        """Forward + backward of ``step``; partial gradients summed over the group. Returns the loss."""
        for p in self.params:
            p.grad = None
        loss = self.loss(step)
        loss.backward()
        reduce_gradients(self.comm, self.params)
        return loss.item()

    def train_step(self) -> float:
        """One step; :class:`~.checkpoint.NonFiniteError` naming the step, before anything non-finite
        is kept, when the loss or the gradients are NaN/Inf or the step made a weight so. Every rank
        of the group holds the same loss, gradients and weights, so every rank stops at the same step."""
        loss = self.gradients(self.step)
        if not math.isfinite(loss):
            self._stop(f"the loss is {loss}")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip))
        if not math.isfinite(norm):
            self._stop(f"the gradient norm is {norm} (loss {loss:.4g})")
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.cfg, self.step)
        self.opt.step()
        bad = ckpt.nonfinite((self.names[id(p)], p.detach()) for p in self.params)
        if bad:
            self._stop(f"the optimizer step made {len(bad)} weight tensor(s) NaN or Inf ({', '.join(bad[:3])}"
                       f"{', ...' if len(bad) > 3 else ''}; lr {lr_at(self.cfg, self.step):.3g})")
        self.step += 1
        self.losses.append(loss)
        return loss

    def _stop(self, why: str) -> None:
        kept = (f"the last checkpoint, after step {self.saved}, is kept" if self.saved
                else "no checkpoint was written")
        raise ckpt.NonFiniteError(f"step {self.step + 1}: {why}; training stopped ({kept}; a lower --lr or "
                                  f"--clip may help)")

    def save(self) -> None:
        if self.rank0:
            ckpt.save(Path(self.cfg.out) / "checkpoint.pt", self.modules, self.opt, self.step, self.losses,
                      asdict(self.cfg))
        self.saved = self.step

    def restore(self) -> None:
        path = Path(self.cfg.out) / "checkpoint.pt"
        if path.exists():
            self.step, self.losses = ckpt.load(path, self.modules, self.opt, asdict(self.cfg))
            self.saved = self.step

    def run(self) -> dict:
        cfg = self.cfg
        if cfg.resume:
            self.restore()
        bar = None
        if cfg.progress and self.rank0:
            # local: only a run that draws a bar loads it
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {cfg.objective}", file=sys.stderr,
                       dynamic_ncols=True)
        t0 = time.perf_counter()
        start = self.step
        while self.step < cfg.steps:
            loss = self.train_step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t0
        report = {"objective": cfg.objective, "steps": self.step, "resumed_from": start, "sp": self.comm.world_size,
                  "path": cfg.path, "final_loss": self.losses[-1] if self.losses else None,
                  "first_loss": self.losses[0] if self.losses else None,
                  "seconds": round(elapsed, 2), "s_per_step": round(elapsed / max(1, self.step - start), 3),
                  "trainable_parameters": sum(p.numel() for p in self.params), "out": cfg.out,
                  "compile": describe(self.dit, self.vae)}
        if self.rank0:
            out = Path(cfg.out)
            for name, m in self.modules.items():
                ckpt.export_weights(out / f"{name}.safetensors", m)
            if cfg.plot and self.losses:
                plot_losses(self.losses, out / "loss.png", cfg.objective)
            ckpt.atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1)))
        return report


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    import matplotlib  # local: a heavy optional package, loaded only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: a heavy optional package, loaded only when this runs

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="step")
    k = max(1, len(losses) // 20)
    if len(losses) >= 2 * k and k > 1:
        smooth = [sum(losses[i - k:i]) / k for i in range(k, len(losses) + 1)]
        ax.plot(range(k, len(losses) + 1), smooth, lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_yscale("log"), ax.set_title(f"ditsp train: {title}")
    ax.legend()
    fig.tight_layout()
    ckpt.atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def rank_train(ctx, cfg: TrainConfig) -> dict:
    """Rank function (LocalCluster or torchrun): the loop on the context's group."""
    torch.set_num_threads(1)
    return Trainer(cfg, ctx.group if ctx.world_size > 1 else None).run()


def rank_check(ctx, cfg: TrainConfig) -> dict:
    """Rank function: step 0's gradients on the group (for ``--check``)."""
    t = Trainer(cfg, ctx.group if ctx.world_size > 1 else None)
    loss = t.gradients(0)
    return {"loss": loss, "grads": [p.grad.clone() for p in t.params]}


def check(cfg: TrainConfig, sp_results: dict) -> dict:
    """One step on this device vs ``sp_results`` (rank 0's :func:`rank_check`): max gradient difference."""

    one = Trainer(replace(cfg, sp=1))
    loss = one.gradients(0)
    diffs = [(a - p.grad).abs().max().item() for a, p in zip(sp_results["grads"], one.params)]
    scale = max(p.grad.abs().max().item() for p in one.params)
    return {"loss_one_device": loss, "loss_sp": sp_results["loss"], "max_grad_diff": max(diffs),
            "max_grad": scale, "relative": max(diffs) / max(scale, 1e-30)}
