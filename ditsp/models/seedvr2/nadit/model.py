"""NaDiT: the SeedVR2 diffusion transformer, 3B (reference ``models/dit_v2``) and 7B
(``models/dit``) families, one code path.

The families share geometry, time embedding, patching, the runtime protocol
and the loader; they differ in their block class and output head
(:data:`FAMILIES`), picked by ``cfg.variant``.

The forward always runs through an SP runtime (:class:`ditsp.sp.SPRuntime`)
that its caller builds, from outside the model (``..parallelize``): a one-rank
window runtime on a single device (``single_runtime``), the SP group's runtime
under window-aligned SP, Plan B or the Ulysses baseline (``parallelize``). Each rank
keeps only its own video rows from the patch embedding to the output
projection (everything but attention is tokenwise), text is replicated, and
the runtime re-shards at layout changes, reduces the per-window text outputs
and gathers the output.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ....fixed_shape import use as use_kernel_shapes
from ....sp import SPRuntime, check_request
from ....sp.recompute import checkpointed
from ....weights.load import quantize_
from ....windows.ownership import RowOwnership
from .blocks import NaMMSRBlock
from .blocks_7b import NaMMSRBlock7B
from .checkpoint import load_checkpoint
from .config import NaDiTConfig, get_config
from .heads import NormAdaHead, OutAda, PlainHead, RMSNormWeight  # noqa: F401 - OutAda/RMSNormWeight re-exported
from .tokenwise import TokenLinear
from ...meta import meta_device

# variant -> (block class, output head)
FAMILIES = {"3b": (NaMMSRBlock, NormAdaHead), "7b": (NaMMSRBlock7B, PlainHead)}

SINUSOIDAL_DIM = 256


def timestep_sinusoid(t: torch.Tensor, dim: int = SINUSOIDAL_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """[sin(t f_k), cos(t f_k)], f_k = exp(-ln(max_period) k / (dim/2)): diffusers'
    ``get_timestep_embedding`` with flip_sin_to_cos=False, downscale_freq_shift=0."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    arg = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.sin(arg), torch.cos(arg)], dim=-1)


class TimeEmbedding(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.proj_in = nn.Linear(SINUSOIDAL_DIM, dim)
        self.proj_hid = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, out_dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = timestep_sinusoid(t).to(dtype)
        return self.proj_out(F.silu(self.proj_hid(F.silu(self.proj_in(h)))))


class PatchIn(nn.Module):
    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.proj = TokenLinear(in_channels, dim)


class PatchOut(nn.Module):
    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.proj = TokenLinear(dim, out_channels)


def patchify(vid: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """(T, H, W, C) -> (T/pt * H/ph * W/pw, pt*ph*pw*C) canonical rows, (dt, dy, dx, c) with c fastest."""
    pt, ph, pw = patch
    T, H, W, C = vid.shape
    x = vid.view(T // pt, pt, H // ph, ph, W // pw, pw, C).permute(0, 2, 4, 1, 3, 5, 6)
    return x.reshape(-1, pt * ph * pw * C)


def unpatchify(y: torch.Tensor, grid: Sequence[int], patch: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`patchify`: canonical rows -> (T, H, W, C) channels-last."""
    (T, H, W), (pt, ph, pw) = grid, patch
    y = y.view(T, H, W, pt, ph, pw, -1).permute(0, 3, 1, 4, 2, 5, 6)
    return y.reshape(T * pt, H * ph, W * pw, -1)


def x0_from_v(noise: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One-step v_lerp sampler at t = T: ``x0 = noise - v``."""
    return noise - v


class NaDiT(nn.Module):
    """SeedVR2 NaDiT of either family; parameter names mirror the reference except
    the RoPE buffer, registered as ``blocks.<i>.attn.rope.freqs``."""

    def __init__(self, cfg: NaDiTConfig):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_blocks = False  # activation checkpointing per block (training; ditsp.sp.recompute)
        d = cfg.vid_dim
        self.vid_in = PatchIn(cfg.patch_channels, d)
        self.txt_in = nn.Linear(cfg.txt_in_dim, d)
        self.emb_in = TimeEmbedding(d, cfg.emb_dim)
        block, self.head = FAMILIES[cfg.variant]
        self.blocks = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.head.install(self, d)
        self.vid_out = PatchOut(d, cfg.out_patch_channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.vid_in.proj.weight.dtype

    def grid_of(self, latent_shape: Sequence[int]) -> tuple[int, int, int]:
        """Post-patch token grid of a (T, H, W[, C]) latent."""
        (T, H, W), (pt, ph, pw) = latent_shape[:3], self.cfg.patch_size
        if T % pt or H % ph or W % pw:
            raise ValueError(f"latent (T,H,W)=({T},{H},{W}) does not divide by the patch {self.cfg.patch_size}")
        return (T // pt, H // ph, W // pw)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, timestep, runtime: SPRuntime | None = None,
                states: dict | None = None, rows: RowOwnership | None = None) -> torch.Tensor:
        """vid (T, H, W, 33) latent, txt (L, txt_in_dim), timestep scalar -> v (T, H, W, 16).

        ``runtime`` is required: on one device
        :func:`ditsp.models.seedvr2.parallelize.single_runtime`, under SP the group's
        (:func:`ditsp.models.seedvr2.parallelize.parallelize`), and every rank returns the full output.

        ``rows``: ``vid`` is only this rank's ``(n, 33)`` rows of the latent
        grid as ``rows`` holds them (e.g. a sharded VAE's height slab), and the
        result is this rank's ``(n, 16)`` rows of the same ownership: the
        latent goes straight to the windows and back, never whole on a rank.

        ``states`` (a dict, for debugging against reference vectors) receives
        ``emb``, ``vid_patch_in``, ``txt_proj_in`` and every block's ``block<i>.vid``
        (canonical rows, gathered: every rank must pass it) and ``block<i>.txt``;
        a 7B model then also computes the last block's discarded text output.
        """
        if runtime is None:
            raise TypeError("NaDiT.forward needs a runtime: ditsp.models.seedvr2.parallelize.single_runtime(cfg, grid) "
                            "on one device, parallelize(cfg, parallel_config, grid, group) under SP")
        grid = self.grid_of(rows.grid if rows is not None else vid.shape)
        check_request(runtime, grid, self.cfg.window_methods, self.cfg.name)
        with use_kernel_shapes(runtime.kernel_shapes):  # the request's kernel-shape policy, for every call below
            return self._forward(vid, txt, timestep, runtime, grid, states, rows)

    def _forward(self, vid, txt, timestep, rt: SPRuntime, grid, states, rows) -> torch.Tensor:
        cfg, dtype = self.cfg, self.dtype
        if rows is not None and states is not None:
            raise ValueError("states are recorded on canonical input only (rows=None)")
        t = torch.as_tensor(timestep, dtype=torch.float32, device=vid.device).reshape(-1)[:1]
        emb = self.emb_in(t, dtype)[0]  # one clip, one timestep: one emb serves every token
        if rows is None:
            x = rt.scatter(patchify(vid.to(dtype), cfg.patch_size), 0)
        else:
            x = rt.scatter_rows(vid.to(dtype), rows, cfg.patch_size)
        x = self.vid_in.proj(x)
        txt = self.txt_in(txt.to(dtype))
        if states is not None:
            states.update({"emb": emb[None], "vid_patch_in": rt.gather(x), "txt_proj_in": txt})
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = rt.enter_layer(x, i)
            # The last block's text output is discarded: skip it unless states are recorded.
            pack, txt_out = rt.window_pack(i, x.device), i < last or states is not None
            if self.checkpoint_blocks and torch.is_grad_enabled():  # training: recompute in the backward
                x, txt = checkpointed(block, rt, x, txt, emb, pack, rt, i, txt_out=txt_out)
            else:
                x, txt = block(x, txt, emb, pack, rt, i, txt_out=txt_out)
            if states is not None:
                states[f"block{i}.vid"], states[f"block{i}.txt"] = rt.gather(x), txt
        y = self.head.apply(self, x, emb, cfg.norm_eps)
        y = self.vid_out.proj(y)  # tokenwise: gather the 64-wide output, not the hidden state
        if rows is not None:
            return rt.gather_rows(y, rows, cfg.patch_size)
        return unpatchify(rt.gather(y), grid, cfg.patch_size)


@torch.no_grad()
def init_random_(model: NaDiT, seed: int = 0, std: float = 0.05) -> NaDiT:
    """Seeded weights, identical on every rank: ``std * randn`` everywhere, except
    RMSNorm weights and AdaSingle scales/gates, ``1 + std * randn`` (so every block
    visibly changes the residual stream, as in the reference vectors). Drawn on the parameters' device
    (a model made there with ``to_empty``: no host copy of a 3B's weights), so the bits follow the device."""
    g = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, device=p.device) * std
        unit = name.endswith(("_scale", "_gate")) or ".norm_" in name or name.startswith("vid_out_norm.")
        p.copy_(r + 1.0 if unit else r)
    return model


def random_inputs(cfg: NaDiTConfig, grid: Sequence[int], seed: int = 0, txt_len: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded latent (T, H, W, 33) for post-patch ``grid`` and text (L, txt_in_dim), fp32."""
    g = torch.Generator().manual_seed(seed)
    (T, H, W), (pt, ph, pw) = grid, cfg.patch_size
    vid = torch.randn(T * pt, H * ph, W * pw, cfg.vid_in_channels, generator=g)
    txt = torch.randn(txt_len or cfg.txt_len, cfg.txt_in_dim, generator=g)
    return vid, txt


def build_model(cfg: NaDiTConfig | str, num_layers: int | None = None, checkpoint: str | None = None, seed: int = 0,
                dtype: torch.dtype = torch.float32, device="cpu", allow_truncated: bool = False,
                weights_dtype: str | None = None, comm=None, read: str | None = None) -> NaDiT:
    """A ready NaDiT: preset name or config, strict checkpoint or seeded random weights, eval mode.

    ``weights_dtype`` ("fp8", "fp8_e5m2"; None keeps the file's formats) quantizes the weight
    matrices at load; FP8/GGUF checkpoints stay quantized either way (``ditsp/weights``).
    ``comm``/``read``: the ranks loading the checkpoint together (``ditsp/weights/shared.py``)."""

    cfg = get_config(cfg, num_layers) if isinstance(cfg, str) else (cfg.with_layers(num_layers) if num_layers else cfg)
    if checkpoint:
        with meta_device():
            model = NaDiT(cfg)
        load_checkpoint(model, checkpoint, allow_truncated=allow_truncated, dtype=dtype, weights_dtype=weights_dtype,
                        comm=comm, read=read)
    else:
        model = quantize_(init_random_(NaDiT(cfg), seed), weights_dtype, dtype)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
