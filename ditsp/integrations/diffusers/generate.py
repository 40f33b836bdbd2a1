"""Text-to-video generation with a diffusers Wan pipeline folder under ditsp SP and CFG parallel.

The folder is a saved diffusers pipeline (``model_index.json`` with
``transformer/``, ``vae/`` and ``scheduler/``), loaded with
``from_pretrained`` on local paths only (no hub). The prompt comes as
precomputed embeddings (a safetensors file with ``prompt_embeds`` and, for
guidance, ``negative_prompt_embeds``): the text encoder and tokenizer are
not loaded, so no ``transformers`` install or tokenizer files are needed.

The denoising loop is Wan's (flow-matching scheduler steps, guidance
``uncond + g * (cond - uncond)``, Wan 2.2's per-token timesteps when the
pipeline expands them); the transformer runs under
:func:`~.parallelize.parallelize`, both guidance passes at once with
``cfg_degree=2``. Noise is drawn on the CPU from the seed, so every rank
and every degree starts from the same latents. Rank 0 decodes and writes.

Nothing non-finite becomes a video: NaN/Inf prompt embeddings or weights are
refused by name before the first step, and latents that turn NaN/Inf stop the
run at the step they did (a NaN latent decodes to a black video). Each part
loaded and each step done beats the rank's heartbeat
(:mod:`ditsp.distributed.heartbeat`), so ``--timeout`` is the launcher's
stuck-rank check, not a deadline the pipeline's loading could overrun.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...config import ParallelConfig
from ...distributed.heartbeat import beat
from ...io.formats import WRITE_IMAGE_EXTS
from ...weights.formats import error_line
from .hooks import ParallelizeError
from .cfg import cfg_forward
from .parallelize import parallelize
from safetensors.torch import load_file
from ...io.write import write_image, write_video

PIPELINES = ("WanPipeline",)  # the pipeline classes this job runs


@dataclass(frozen=True)
class GenerateRequest:
    folder: str
    embeds: str
    output: str | None
    height: int
    width: int
    frames: int
    steps: int = 20
    guidance: float = 5.0
    seed: int = 0
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    fps: float = 16.0
    overwrite: bool = False
    progress: bool = True
    return_frames: bool = False


PARTS = ("transformer", "vae", "scheduler")  # the pipeline's parts this job loads


def pipeline_index(folder: str | Path) -> dict:
    """``model_index.json`` of a pipeline folder, checked to be one this job runs (one-line errors)."""
    p = Path(folder) / "model_index.json"
    if not p.is_file():
        raise ParallelizeError(f"{folder}: no model_index.json (a diffusers pipeline folder is expected)")
    try:
        index = json.loads(p.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ParallelizeError(f"{p}: not a readable JSON file ({error_line(e)})") from None
    if not isinstance(index, dict):
        raise ParallelizeError(f"{p}: expected a JSON object, got a {type(index).__name__}")
    name = index.get("_class_name")
    if name not in PIPELINES:
        raise ParallelizeError(f"{folder}: pipeline {name} is not supported; ditsp generate runs {', '.join(PIPELINES)}")
    if index.get("transformer_2") not in (None, [None, None]):
        raise ParallelizeError(f"{folder}: two-expert pipelines (transformer_2) are not supported yet")
    for part in PARTS:
        entry = index.get(part)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, str) for v in entry)):
            raise ParallelizeError(f"{p}: {part!r} must be [library, class], got {json.dumps(entry)[:80]}")
        if not (Path(folder) / part).is_dir():
            raise ParallelizeError(f"{folder}: the {part}/ folder is missing")
    return index


def load_embeds(path: str | Path, guidance: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prompt, negative prompt or None) embeddings of a safetensors file, each a finite float
    ``[batch, tokens, dim]`` tensor (one-line errors)."""
    try:
        d = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - any reader failure: not a safetensors file
        raise ParallelizeError(f"{path}: not a safetensors file of prompt embeddings ({error_line(e)})") from None
    if "prompt_embeds" not in d:
        raise ParallelizeError(f"{path}: no 'prompt_embeds' tensor (found {sorted(d)})")
    neg = d.get("negative_prompt_embeds")
    if guidance > 1 and neg is None:
        raise ParallelizeError(f"{path}: guidance {guidance} needs 'negative_prompt_embeds' (or --guidance 1)")
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        t = d.get(name)
        if t is None:
            continue
        if not t.is_floating_point() or t.dim() != 3:
            raise ParallelizeError(f"{path}: {name} must be a float [batch, tokens, dim] tensor, got "
                                   f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ParallelizeError(f"{path}: {name} holds {bad} NaN/Inf value(s) of {t.numel()}")
    if neg is not None and neg.shape[-1] != d["prompt_embeds"].shape[-1]:
        raise ParallelizeError(f"{path}: negative_prompt_embeds has width {neg.shape[-1]}, prompt_embeds "
                               f"{d['prompt_embeds'].shape[-1]}")
    return d["prompt_embeds"].float(), None if neg is None else neg.float()


def check_weights(module: torch.nn.Module, where: str) -> None:
    """Refuse (one line, naming them) weights that hold NaN or Inf: they would decode to a black video."""
    bad = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
           if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ParallelizeError(f"{where}: {len(bad)} weight tensor(s) hold NaN or Inf "
                               f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''})")


def _class(folder: str, index: dict, part: str):
    import diffusers  # local: a heavy optional package, loaded only when this runs

    lib, cls = index[part]
    if lib != "diffusers" or not hasattr(diffusers, cls):
        raise ParallelizeError(f"{folder}: {part} is {lib}.{cls}, not a diffusers class")
    return getattr(diffusers, cls)


def _component(folder: str, index: dict, part: str):
    cls = _class(folder, index, part)
    try:
        return cls.from_pretrained(folder, subfolder=part, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a missing or malformed file of the part
        raise ParallelizeError(f"{folder}/{part}: cannot load it ({error_line(e)})") from None


def _config(folder: str, index: dict, part: str) -> dict:
    cls = _class(folder, index, part)
    try:
        return dict(cls.load_config(folder, subfolder=part, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - a missing or malformed config.json
        raise ParallelizeError(f"{folder}/{part}: unreadable config ({error_line(e)})") from None


def _counts(cfg: dict, key: str, default, n: int, where: str) -> tuple[int, ...]:
    """``cfg[key]`` as ``n`` integers >= 1 (one-line error otherwise: a 0 would divide by zero)."""
    v = cfg.get(key, default)
    vals = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    if len(vals) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in vals):
        raise ParallelizeError(f"{where}: {key} must be {'an integer' if n == 1 else f'{n} integers'} >= 1, "
                               f"got {json.dumps(v)[:60]}")
    return vals


def latent_shape(req: GenerateRequest, index: dict) -> tuple[int, ...]:
    """The latent ``[1, C, F', H', W']`` of a request (one-line error for sizes the VAE cannot make)."""
    vae = _config(req.folder, index, "vae")
    tr = _config(req.folder, index, "transformer")
    where_vae, where_tr = f"{req.folder}/vae/config.json", f"{req.folder}/transformer/config.json"
    (st,) = _counts(vae, "scale_factor_temporal", 4, 1, where_vae)
    (ss,) = _counts(vae, "scale_factor_spatial", 8, 1, where_vae)
    ph, pw = _counts(tr, "patch_size", (1, 2, 2), 3, where_tr)[1:]
    (channels,) = _counts(tr, "in_channels", 16, 1, where_tr)
    if req.height % (ss * ph) or req.width % (ss * pw):
        raise ParallelizeError(f"height and width must be multiples of {ss * ph}x{ss * pw}; got {req.width}x{req.height}")
    if (req.frames - 1) % st or req.height % ss or req.width % ss:
        raise ParallelizeError(f"frames must be {st}n+1 and height, width multiples of {ss}; "
                               f"got {req.frames} frames at {req.width}x{req.height}")
    return (1, channels, (req.frames - 1) // st + 1, req.height // ss, req.width // ss)


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """VAE output ``[1, 3, F, H, W]`` in [-1, 1] -> ``[F, H, W, 3]`` uint8."""
    return ((video[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


@torch.no_grad()
def rank_generate(ctx, req: GenerateRequest) -> dict:
    """One rank's share of a generation; rank 0 decodes, writes and returns the report."""
    from tqdm import tqdm  # local: only a run that draws a bar loads it

    index = pipeline_index(req.folder)
    cond, neg = load_embeds(req.embeds, req.guidance)
    shape = latent_shape(req, index)
    beat()  # each part loaded is progress: loading a pipeline is no stuck rank
    transformer = _component(req.folder, index, "transformer").eval()
    check_weights(transformer, f"{req.folder}/transformer")
    beat()
    scheduler = _component(req.folder, index, "scheduler")
    group = ctx.group if ctx.world_size > 1 else None
    config = ParallelConfig(ulysses_degree=req.ulysses, ring_degree=req.ring, cfg_degree=req.cfg, advanced_uaa=True)
    parallelize(transformer, config, group)
    beat()
    rank0 = ctx.rank == 0
    vae = _component(req.folder, index, "vae").eval() if rank0 else None
    if vae is not None:
        check_weights(vae, f"{req.folder}/vae")
        beat()
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(req.seed), dtype=torch.float32)
    scheduler.set_timesteps(req.steps)
    scheduler.set_begin_index(0)
    expand = bool(index.get("expand_timesteps", False))
    p = transformer.config.patch_size
    guided = req.guidance > 1
    step_s = []
    bar = tqdm(total=req.steps, desc="generate", unit="step", disable=not (rank0 and req.progress), leave=False)
    for i, t in enumerate(scheduler.timesteps):
        t0 = time.perf_counter()
        if expand:  # Wan 2.2 TI2V: one timestep per post-patch token
            tokens = shape[2] // p[0] * (shape[3] // p[1]) * (shape[4] // p[2])
            timestep = t.expand(1, tokens)
        else:
            timestep = t.expand(1)
        base = {"hidden_states": latents, "timestep": timestep}
        if guided:
            c, u = cfg_forward(transformer, {**base, "encoder_hidden_states": cond},
                               {**base, "encoder_hidden_states": neg})
            noise = u + req.guidance * (c - u)
        else:
            noise = transformer(**base, encoder_hidden_states=cond, return_dict=False)[0]
        latents = scheduler.step(noise, t, latents, return_dict=False)[0]
        if not bool(torch.isfinite(latents).all()):  # the same latents on every rank: every rank stops here
            raise ParallelizeError(f"step {i + 1} of {req.steps}: the latents turned NaN or Inf (guidance "
                                   f"{req.guidance}); stopped before writing a black video")
        beat()
        step_s.append(time.perf_counter() - t0)
        bar.update()
    bar.close()
    if not rank0:
        return {}
    t0 = time.perf_counter()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    video = vae.decode(latents * std + mean, return_dict=False)[0]
    if not bool(torch.isfinite(video).all()):
        raise ParallelizeError("the decoded video is NaN or Inf (the VAE's output); nothing written")
    frames = to_uint8(video)
    decode_s = time.perf_counter() - t0
    written = None
    if req.output:
        if frames.shape[0] == 1 and Path(req.output).suffix.lower() in WRITE_IMAGE_EXTS:
            written = str(write_image(req.output, frames[0], overwrite=req.overwrite))
        else:
            written = str(write_video(req.output, frames, req.fps, overwrite=req.overwrite))
    report = {
        "request": asdict(req), "output": written, "latent_shape": list(shape),
        "frames": int(frames.shape[0]), "size": [int(frames.shape[2]), int(frames.shape[1])],
        "ranks": ctx.world_size, "sp": config.sp_degree, "cfg": config.cfg_degree,
        "attention": transformer._ditsp_runtime.attention.name, "step_s": step_s, "decode_s": decode_s,
        "frames_sha256": hashlib.sha256(frames.numpy().tobytes()).hexdigest()[:16],
        "latents": latents,
    }
    if req.return_frames:
        report["frames_u8"] = frames
    return report
