"""ComfyUI nodes that restore one clip with SeedVR2 on several ranks (ditsp's sequence parallelism).

- **SeedVR2 model (ditsp)** (:class:`LoadSeedVR2`): a model from the table of models, its DiT and VAE files
  from ComfyUI's model folders (any format ditsp loads: .pth, .safetensors incl. FP8, .gguf), the compute
  dtype and how the ranks keep the weights. It starts nothing: its output owns the model's ranks
  (:class:`.group.RankGroup`), started by the first restoration and kept across prompts, so the weights
  load once per rank; they stop when ComfyUI unloads its models or drops the loader's output.
- **SeedVR2 upscale (ditsp SP)** (:class:`UpscaleSeedVR2`): IMAGE frames in, restored IMAGE frames out, with
  `ditsp upscale`'s options. The request is checked, planned and held to its memory budget before any rank
  starts (a job that would not fit is refused with the CLI's own message); the ranks run the same job
  as `ditsp upscale`, so the frames are the same; ComfyUI's progress bar follows rank 0, and ComfyUI's
  interrupt stops the ranks.

Every choice and default comes from the restoration request (:mod:`ditsp.models.seedvr2.job.request`),
like the CLI's flags. Audio, frame rate and files stay with ComfyUI's own video nodes.
"""

from __future__ import annotations

import os
import weakref

import torch

from ...memory import available_bytes, declared_available_bytes
from ...models.seedvr2.job import request
from . import host
from .frames import to_frames, to_images
from .group import Interrupted, RankGroup

CATEGORY = "ditsp/SeedVR2"
MODEL = "SEEDVR2_DITSP"  # the loader's output type
GiB = 2**30
_d = request.default

_LOADED: "weakref.WeakSet[LoadedModel]" = weakref.WeakSet()  # every loaded model's ranks, for ComfyUI's unload


def _unload_all() -> None:
    for m in list(_LOADED):
        m.group.close()


class LoadedModel:
    """The loader's output: a model's settings (the request's names) and the ranks that hold it."""

    def __init__(self, settings: dict, threads: int):
        self.settings, self.threads = settings, threads
        self.group = RankGroup(threads=threads, timeout_s=_d("timeout"))
        _LOADED.add(self)
        weakref.finalize(self, self.group.close)  # dropped from ComfyUI's cache: its ranks stop

    def __repr__(self) -> str:
        return f"LoadedModel({self.settings['model']}, {len(self.group.workers)} rank(s) up)"


class LoadSeedVR2:
    """A SeedVR2 model for the upscale node (nothing loads until a restoration needs it)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (list(request.MODELS), {"default": _d("model"), "tooltip":
                      "tiny: the small restorer shipped with ditsp; seedvr2-*: the released models (give their "
                      "DiT and VAE files)"}),
            "dit": (host.model_files(host.DIT_FOLDER), {"tooltip": "DiT weights from models/diffusion_models "
                    "(.pth, .safetensors incl. FP8, .gguf); (none): the model's shipped weights"}),
            "vae": (host.model_files(host.VAE_FOLDER), {"tooltip": "VAE weights from models/vae (e.g. ema_vae.pth)"}),
            "dtype": (["default", *request.DTYPE_NAMES], {"default": "default",
                      "tooltip": "compute dtype (default: bf16 for seedvr2-*, fp32 for tiny)"}),
            "weights_dtype": (list(request.WEIGHTS_DTYPES), {"default": _d("weights_dtype"), "tooltip":
                              "how each rank keeps the weights: as stored (FP8/GGUF stay quantized) or FP8"}),
            "threads": ("INT", {"default": _d("threads"), "min": 1, "max": 256,
                                "tooltip": "compute threads per rank"}),
            "random_weights": ("BOOLEAN", {"default": _d("random_weights"), "tooltip":
                               "seeded random weights where no file is given: a smoke test, not a restoration"}),
        }}

    def load(self, model, dit, vae, dtype, weights_dtype, threads, random_weights):
        from ...models.seedvr2.presets import default_dtype
        from ...models.seedvr2.weights import WeightsSpec  # the DiT and VAE modules: only when a model is made

        host.on_unload(_unload_all)
        settings = {"model": model, "dit": host.model_path(host.DIT_FOLDER, dit),
                    "vae": host.model_path(host.VAE_FOLDER, vae), "dtype": None if dtype == "default" else dtype,
                    "weights_dtype": weights_dtype, "random_weights": bool(random_weights)}
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        # the weights' own refusals now rather than at the first restoration: an unknown model, one without weights
        WeightsSpec(model, settings["dit"], settings["vae"], None, settings["dtype"] or default_dtype(model),
                    weights_dtype=None if weights_dtype == "stored" else weights_dtype,
                    random_weights=settings["random_weights"])
        return (LoadedModel(settings, threads),)


class UpscaleSeedVR2:
    """Restore IMAGE frames with a loaded SeedVR2 model on ``sp`` ranks (`ditsp upscale`'s job)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    FUNCTION = "upscale"
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (MODEL,),
            "images": ("IMAGE",),
            "scale": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 16.0, "step": 0.25, "tooltip":
                      "output area = scale x the input's sides (0: resolution, size, or the model's default)"}),
            "resolution": ("STRING", {"default": "", "tooltip": "WxH: the output's area, aspect kept"}),
            "size": ("STRING", {"default": "", "tooltip": "WxH: the exact output size"}),
            "seed": ("INT", {"default": _d("seed"), "min": 0, "max": 2**62}),
            "color_fix": (list(request.COLOR_FIX_CHOICES), {"default": _d("color_fix"), "tooltip":
                          "colour correction against the input (model: the model's own)"}),
            "window_frames": ("INT", {"default": _d("window_frames"), "min": 0, "max": 100000, "tooltip":
                              "frames per temporal window (kn+1); 0: the whole clip in one window"}),
            "overlap": ("INT", {"default": _d("overlap"), "min": 0, "max": 100000,
                                "tooltip": "frames shared and cross-faded by consecutive windows"}),
            "sp": ("INT", {"default": _d("sp"), "min": 1, "max": 1024,
                           "tooltip": "sequence-parallel degree: ranks that restore the clip together"}),
            "gpus": ("STRING", {"default": "", "tooltip": "GPU indices, one per rank (e.g. 0,1); empty: the "
                                "ranks run on the CPU"}),
            "vae_mode": (list(request.VAE_MODES), {"default": _d("vae_mode")}),
            "deterministic": ("BOOLEAN", {"default": _d("deterministic"), "tooltip":
                              "fixed-shape kernel calls: the same bytes at every SP degree"}),
            "max_memory": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1e6, "step": 0.5, "tooltip":
                           "GiB per rank (0: free memory over the ranks, counting what the ranks hold)"}),
            "force": ("BOOLEAN", {"default": _d("force"),
                                  "tooltip": "run even if the memory estimate exceeds the budget"}),
        }}

    def upscale(self, model, images, scale, resolution, size, seed, color_fix, window_frames, overlap, sp, gpus,
                vae_mode, deterministic, max_memory, force):
        frames = to_frames(images)
        req = plan(model, frames, scale=scale, resolution=resolution, size=size, seed=seed, color_fix=color_fix,
                   window_frames=window_frames, overlap=overlap, sp=sp, gpus=gpus, vae_mode=vae_mode,
                   deterministic=deterministic, max_memory=max_memory, force=force)
        bar = []

        def progress(done: int, total: int) -> None:
            if not bar:
                bar.append(host.progress_bar(total))
            if bar[0] is not None:
                bar[0].update_absolute(done, total)

        try:
            report = model.group.run(req, progress, host.interrupted)
        except Interrupted:
            host.raise_interrupt()
        return (to_images(report["output_frames"]),)


def plan(model: LoadedModel, frames: torch.Tensor, *, scale, resolution, size, seed, color_fix, window_frames,
         overlap, sp, gpus, vae_mode, deterministic, max_memory, force):
    """The node's inputs as the restoration's checked request, held to its memory budget: ValueError or
    MemoryError with the CLI's one line otherwise, before any rank starts."""
    sizes = {"scale": scale or None, "resolution": resolution.strip() or None, "size": size.strip() or None}
    if sum(v is not None for v in sizes.values()) > 1:
        raise ValueError("give at most one of scale, resolution, size")
    _check_gpus(gpus, sp)
    o = request.Options(input=f"IMAGE batch of {frames.shape[0]} frame(s)", output="", sp=sp, **model.settings,
                        **sizes, seed=seed, color_fix=color_fix, window_frames=window_frames, overlap=overlap,
                        vae_mode=vae_mode, deterministic=bool(deterministic), force=bool(force),
                        max_memory=_budget_gib(max_memory, sp, model.group), threads=model.threads, progress=False)
    checked = request.check(o, frames)
    request.check_memory(checked, o)
    _check_shared_memory(checked.req)
    return checked.req


def _budget_gib(max_memory: float, sp: int, group: RankGroup) -> float | None:
    """The per-rank budget: the node's, else (None) free memory over the ranks, plus what this model's ranks
    already hold (their weights are theirs to reuse, not a second copy to find room for)."""
    if max_memory:
        return max_memory
    held = group.held_bytes()
    if not held or declared_available_bytes() is not None:
        return None
    return (available_bytes(1) + held) / sp / GiB


def _check_gpus(gpus: str, sp: int) -> None:
    if not gpus.strip():
        return
    try:
        ids = [int(g) for g in gpus.replace(" ", "").split(",")]
    except ValueError:
        raise ValueError(f"gpus {gpus!r}: give device indices separated by commas, e.g. 0,1") from None
    if len(ids) != sp or len(set(ids)) != len(ids):
        raise ValueError(f"gpus {gpus!r}: give {sp} different device indices, one per rank")
    if not torch.cuda.is_available():
        raise ValueError(f"gpus {gpus!r}: this machine has no CUDA device; leave gpus empty to run the ranks "
                         f"on the CPU")
    raise ValueError(f"gpus {gpus!r}: ditsp's persistent ranks run on the CPU (gloo) for now; leave gpus empty")


def _check_shared_memory(req) -> None:
    """The frames go to the ranks and back through shared memory: refuse, before any work, a clip that
    would not fit in it (a container's small /dev/shm)."""
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return
    g = req.plan.geometry
    need = req.frames.numel() + req.plan.frames * g.out_width * g.out_height * 3
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise MemoryError(f"the frames need {need / GiB:.2f} GiB of shared memory to reach the ranks and come "
                          f"back, but {shm} has {free / GiB:.2f} GiB free (a container: give it --shm-size)")


NODE_CLASS_MAPPINGS = {"DitspLoadSeedVR2": LoadSeedVR2, "DitspUpscaleSeedVR2": UpscaleSeedVR2}
NODE_DISPLAY_NAME_MAPPINGS = {"DitspLoadSeedVR2": "SeedVR2 model (ditsp)",
                              "DitspUpscaleSeedVR2": "SeedVR2 upscale (ditsp SP)"}
