"""Sizes and time budgets of the GPU check: ``gpu`` (the real run on one H200-class device) and ``tiny`` (the
same code on a CPU in seconds, the suite's dry run).

The ``gpu`` budgets are ceilings per step; the run's own ceiling (``total_s``, about six minutes) is
lower than their sum, since most steps end well inside theirs, and keeps one device call short enough
to leave room for a rerun within a fifteen-minute loan; steps the run's ceiling leaves no time for are
skipped, said so. A step stops at its budget whatever
it is doing; inside a step, an item whose predicted time does not fit what is left is skipped and
said so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEPS = ("env", "attention", "dit", "vae", "compile", "fp8", "ranks")


@dataclass(frozen=True)
class Profile:
    name: str
    total_s: float  # the whole run's ceiling (the parent's deadline)
    budgets: dict  # step -> seconds at most
    matmul_n: int  # the bf16 matmul ceiling: (n, n) @ (n, n)
    copy_mib: int  # the copy ceiling: one device-to-device copy of this many MiB
    attn_seq: int  # attention kernel table: query and key rows per check (not a multiple of 32 on purpose)
    attn_head_dims: tuple  # the head dims the models use
    attn_timing: tuple  # (heads, seq, head dim) of the kernel timing rows
    dit: tuple  # (preset, (width, height, frames), timed repeats), in order; the 3B's rows first
    vae_widths: tuple | None  # None: the released VAE
    vae_groups: int | None
    vae_clip: tuple  # (frames, height, width) of encode + decode
    vae_reps: int  # timed runs after the measured-peak run (0: the peak run's time is the time)
    compile_model: str
    compile_layers: int
    compile_size: tuple  # (width, height, frames)
    compile_backend: str  # torch.compile backend: inductor (the product's) or eager (tracing only: the dry run)
    fp8_model: str  # the model whose linear shapes are timed
    fp8_size: tuple  # (width, height, frames): the rows of each linear
    ranks_model: str
    ranks_size: tuple  # (width, height, frames): big enough that layout changes move rows between 2 ranks
    ranks_vae_clip: tuple  # (frames, height, width), tiny VAE
    dtype: str = "bf16"
    notes: tuple = field(default=())


GPU = Profile(
    name="gpu", total_s=370.0,
    budgets={"env": 25, "attention": 40, "dit": 110, "vae": 65, "compile": 90, "fp8": 15, "ranks": 45},
    matmul_n=8192, copy_mib=4096,
    attn_seq=300, attn_head_dims=(64, 128), attn_timing=(24, 4096, 128),
    dit=(("seedvr2-3b", (1280, 720, 33), 3), ("seedvr2-3b", (1920, 1080, 81), 2), ("seedvr2-7b", (1280, 720, 33), 2)),
    vae_widths=None, vae_groups=None, vae_clip=(17, 720, 1280),
    compile_model="seedvr2-3b", compile_layers=2, compile_size=(1280, 720, 33), compile_backend="inductor",
    fp8_model="seedvr2-3b", fp8_size=(1280, 720, 33),
    ranks_model="tiny", ranks_size=(288, 160, 17), ranks_vae_clip=(9, 64, 96), vae_reps=1,
)

TINY = Profile(
    name="tiny", total_s=150.0,
    budgets={"env": 20, "attention": 30, "dit": 30, "vae": 40, "compile": 60, "fp8": 15, "ranks": 60},
    matmul_n=256, copy_mib=16,
    attn_seq=37, attn_head_dims=(32,), attn_timing=(2, 128, 32),
    dit=(("tiny", (64, 48, 5), 1), ("tiny", (96, 64, 9), 1), ("tiny-7b", (64, 48, 5), 1)),
    vae_widths=(8, 16, 16, 16), vae_groups=4, vae_clip=(5, 16, 32), vae_reps=0,
    compile_model="tiny", compile_layers=2, compile_size=(64, 48, 5), compile_backend="eager",
    fp8_model="tiny", fp8_size=(64, 48, 5),
    ranks_model="tiny", ranks_size=(64, 48, 17), ranks_vae_clip=(5, 32, 48),
    notes=("tiny profile: the gpu profile's code at CPU sizes (reduced widths), a dry run, not a measurement",),
)

PROFILES = {p.name: p for p in (GPU, TINY)}


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
