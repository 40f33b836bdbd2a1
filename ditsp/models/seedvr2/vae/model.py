"""SeedVR2's causal video VAE: encoder, decoder, diagonal Gaussian posterior, latent scaling.

Single-device use::

    vae = VideoVAE(RELEASED); load_checkpoint(vae, "ema_vae.pth")
    post = vae.encode(video)                  # video (B, 3, T, H, W) in [-1, 1], T % 4 == 1
    latent = vae.to_latent(post.sample(generator=g))   # x 0.9152: what the DiT sees
    video = vae.decode(vae.from_latent(latent))

``chunk`` (latent frames per chunk) runs the clip as causal time chunks with each conv's tail
carried between chunks: the same function, memory bounded by one chunk. Images are 4-D
(B, 3, H, W) and take the exact 2-D path. Sharded execution is in :mod:`.sharded`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import VaeConfig
from .execution import Exec
from .layers import CausalConv3d, Downsample, GroupNorm, MidBlock, ResnetBlock, Upsample


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, cfg: VaeConfig, down: bool, temporal: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, cfg) for i in range(n)])
        self.downsamplers = nn.ModuleList([Downsample(cout, temporal)] if down else [])

    def forward(self, x, ex):
        for r in self.resnets:
            x = r(x, ex)
        for d in self.downsamplers:
            x = d(x, ex)
        return x


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, cfg: VaeConfig, up: bool, temporal: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, cfg) for i in range(n)])
        self.upsamplers = nn.ModuleList([Upsample(cout, temporal)] if up else [])

    def forward(self, x, ex):
        for r in self.resnets:
            x = r(x, ex)
        for u in self.upsamplers:
            x = u(x, ex)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VaeConfig):
        super().__init__()
        w = cfg.widths
        self.conv_in = CausalConv3d(cfg.in_channels, w[0])
        self.down_blocks = nn.ModuleList([
            DownBlock(w[max(i - 1, 0)], w[i], cfg.layers_per_block, cfg, i < len(w) - 1, i in cfg.temporal_down_blocks)
            for i in range(len(w))])
        self.mid_block = MidBlock(w[-1], cfg)
        self.conv_norm_out = GroupNorm(cfg.groups, w[-1], eps=cfg.eps)
        self.conv_out = CausalConv3d(w[-1], 2 * cfg.latent_channels)

    def forward(self, x: torch.Tensor, ex: Exec) -> torch.Tensor:
        x = self.conv_in(ex.arrange(x), ex)
        for b in self.down_blocks:
            x = b(x, ex)
        x = self.mid_block(x, ex)
        return self.conv_out(self.conv_norm_out(x, ex, silu=True, then=self.conv_out), ex).contiguous()


class Decoder(nn.Module):
    def __init__(self, cfg: VaeConfig):
        super().__init__()
        w = tuple(reversed(cfg.widths))
        self.conv_in = CausalConv3d(cfg.latent_channels, w[0])
        # Registered before mid_block, as in the released state dict; the forward runs mid first.
        self.up_blocks = nn.ModuleList([
            UpBlock(w[max(i - 1, 0)], w[i], cfg.layers_per_block + 1, cfg, i < len(w) - 1, i in cfg.temporal_up_blocks)
            for i in range(len(w))])
        self.mid_block = MidBlock(w[0], cfg)
        self.conv_norm_out = GroupNorm(cfg.groups, w[-1], eps=cfg.eps)
        self.conv_out = CausalConv3d(w[-1], cfg.out_channels)

    def forward(self, z: torch.Tensor, ex: Exec) -> torch.Tensor:
        x = self.conv_in(ex.arrange(z), ex)
        x = self.mid_block(x, ex)
        for b in self.up_blocks:
            x = b(x, ex)
        return self.conv_out(self.conv_norm_out(x, ex, silu=True, then=self.conv_out), ex).contiguous()


@dataclass
class Posterior:
    """Diagonal Gaussian over the latent: ``mean``, ``logvar`` (clamped), both (B, 16, t, h, w)."""

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor, logvar_range=(-30.0, 20.0)) -> "Posterior":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean, logvar.clamp(*logvar_range))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, noise: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """mean + std * noise; ``noise`` defaults to a standard normal draw of the mean's shape."""
        if noise is None:
            noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device)
        return self.mean + self.std * noise.to(device=self.mean.device, dtype=self.mean.dtype)  # CPU draws too

    def mode(self) -> torch.Tensor:
        return self.mean


def time_pieces(T: int, first: int, step: int) -> list[tuple[int, int]]:
    """Frame ranges ``[0, first)``, then ``step`` frames each (the last may be shorter)."""
    out, a = [], 0
    b = min(first, T)
    while a < T:
        out.append((a, b))
        a, b = b, min(b + step, T)
    return out


def encoder_pieces(T: int, chunk: int | None, temporal_factor: int) -> list[tuple[int, int]]:
    """Input-frame chunks holding ``chunk`` latent frames each (the first: frame 0 plus ``chunk`` more)."""
    if chunk is None or T <= 1:
        return [(0, T)]
    return time_pieces(T, 1 + temporal_factor * chunk, temporal_factor * chunk)


def decoder_pieces(t: int, chunk: int | None) -> list[tuple[int, int]]:
    if chunk is None or t <= 1:
        return [(0, t)]
    return time_pieces(t, 1 + chunk, chunk)


def check_video(x: torch.Tensor, cfg: VaeConfig) -> torch.Tensor:
    if x.dim() != 5 or x.shape[1] != cfg.in_channels:
        raise ValueError(f"video must be (B, {cfg.in_channels}, T, H, W) or (B, {cfg.in_channels}, H, W); got {tuple(x.shape)}")
    if (x.shape[2] - 1) % cfg.temporal_factor:
        raise ValueError(f"a clip needs T = {cfg.temporal_factor}n + 1 frames, got T = {x.shape[2]}")
    if min(x.shape[3], x.shape[4]) < cfg.spatial_factor:
        raise ValueError(f"frames must be at least {cfg.spatial_factor} x {cfg.spatial_factor}, got {tuple(x.shape[3:])}")
    return x


class VideoVAE(nn.Module):
    """The wrapper: ``encoder``, ``decoder`` (state-dict names as released), scaling and sampling."""

    def __init__(self, cfg: VaeConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    # -- single device ----------------------------------------------------------

    def run_encoder(self, x: torch.Tensor, ex: Exec, pieces, rows=None, H=None) -> torch.Tensor:
        """Encoder over ``pieces`` (frame ranges of ``x``), causal state carried between them."""
        outs = []
        for a, b in pieces:
            outs.append(self.encoder(x[:, :, a:b], ex.begin(a, rows, H)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def run_decoder(self, z: torch.Tensor, ex: Exec, pieces, rows=None, H=None) -> torch.Tensor:
        outs = []
        for a, b in pieces:
            outs.append(self.decoder(z[:, :, a:b], ex.begin(a, rows, H)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def run_encoder_rows(self, x, ex: Exec, pieces, rows, H) -> torch.Tensor:
        """Encoder over a height slab: ``rows`` are every rank's pixel rows, ``H`` the frame height."""
        outs = [self.encoder(x[:, :, a:b], ex.begin(a, rows, H)) for a, b in pieces]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def run_decoder_rows(self, z, ex: Exec, pieces, rows, h) -> torch.Tensor:
        outs = [self.decoder(z[:, :, a:b], ex.begin(a, rows, h)) for a, b in pieces]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    @torch.no_grad()
    def encode(self, video: torch.Tensor, chunk: int | None = None) -> Posterior:
        """Posterior of ``video`` (B, 3, T, H, W) or an image (B, 3, H, W), values in [-1, 1]."""
        image = video.dim() == 4
        x = check_video(video.unsqueeze(2) if image else video, self.cfg)
        pieces = encoder_pieces(x.shape[2], chunk, self.cfg.temporal_factor)
        ex = Exec(carry={} if len(pieces) > 1 else None)
        moments = self.run_encoder(x.to(self.dtype), ex, pieces)
        return Posterior.from_moments(moments, self.cfg.logvar_range)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Video (B, 3, T, H, W) of an unscaled latent (B, 16, t, h, w); a 4-D latent gives an image."""
        image = z.dim() == 4
        z = z.unsqueeze(2) if image else z
        pieces = decoder_pieces(z.shape[2], chunk)
        ex = Exec(carry={} if len(pieces) > 1 else None)
        out = self.run_decoder(z.to(self.dtype), ex, pieces)
        return out[:, :, 0] if image else out

    # -- latent convention of the pipeline -----------------------------------------

    def to_latent(self, sample: torch.Tensor) -> torch.Tensor:
        """Posterior sample -> the DiT's latent: (sample - shift) * 0.9152 (layout unchanged)."""
        return (sample - self.cfg.shifting_factor) * self.cfg.scaling_factor

    def from_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return latent / self.cfg.scaling_factor + self.cfg.shifting_factor

    @staticmethod
    def channels_last(latent: torch.Tensor) -> torch.Tensor:
        """(B, C, t, h, w) -> (B, t, h, w, C), the layout handed to the DiT."""
        return latent.permute(0, 2, 3, 4, 1)

    @staticmethod
    def channels_first(latent: torch.Tensor) -> torch.Tensor:
        return latent.permute(0, 4, 1, 2, 3)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype
