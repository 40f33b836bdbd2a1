"""The training objectives: the one-step restoration loss of the DiT, and the VAE's reconstruction.

``dit`` (what SeedVR2 samples with one step): the DiT sees
``[noise | condition | 1]`` at the single sampling timestep t = T = 1000 and
predicts v; the one-step sample is ``x0 = noise - v``. The loss is x0
regression at that timestep, ``mean((noise - v - z_clean)^2)``, i.e. velocity
regression on the target ``v* = noise - z_clean``: the two are the same
number. ``z_clean`` is the frozen VAE's posterior mean of the clean clip (x
0.9152); the condition is a posterior sample of the degraded clip, as the
restoration pipeline encodes it. No perceptual or adversarial term (no
offline LPIPS weights here).

``vae``: reconstruction of the clean clip from the posterior mean, L1 + MSE
in [-1, 1] pixels, plus a small penalty on the mean's scale (the KL term's
mean part). A VAE trained from scratch has its posterior's log-variance pinned
at the range's floor (:func:`pin_posterior_std`): reconstructing through a
sample whose noise starts at unit scale, against a latent a few tenths wide,
taught the decoder to ignore the latent, and the restoration pipeline, which
conditions the DiT on a sample, would be handed mostly noise. The VAE trains on
one device only (see :func:`check_vae_training`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..fixed_shape import FAST, use
from ..models.seedvr2.pipeline.condition import SCHEDULE_T, dit_input, make_noise
from ..models.seedvr2.vae.execution import Exec
from ..models.seedvr2.vae.model import Posterior, VideoVAE, decoder_pieces, encoder_pieces

OBJECTIVES = ("dit", "vae")
KL_WEIGHT = 1e-4


def to_unit(frames: torch.Tensor) -> torch.Tensor:
    """(B, T, 3, H, W) in [0, 1] -> the VAE's (B, 3, T, H, W) in [-1, 1]."""
    return (frames * 2 - 1).permute(0, 2, 1, 3, 4)


def posterior(vae: VideoVAE, frames: torch.Tensor) -> Posterior:
    """The VAE's posterior of (B, T, 3, H, W) frames, differentiable (plain kernel calls)."""
    x = to_unit(frames).to(vae.dtype)
    with use(FAST):
        moments = vae.run_encoder(x, Exec(), encoder_pieces(x.shape[2], None, vae.cfg.temporal_factor))
    return Posterior.from_moments(moments, vae.cfg.logvar_range)


def decode(vae: VideoVAE, z: torch.Tensor) -> torch.Tensor:
    """Unscaled latent (B, 16, t, h, w) -> (B, 3, T, H, W) in [-1, 1], differentiable."""
    with use(FAST):
        return vae.run_decoder(z, Exec(), decoder_pieces(z.shape[2], None))


def vae_loss(vae: VideoVAE, clean: torch.Tensor) -> torch.Tensor:
    """Reconstruction of ``clean`` from its posterior mean (no draw: the loss is a function of the weights)."""
    post = posterior(vae, clean)
    recon = decode(vae, post.mean)
    target = to_unit(clean).to(recon.dtype)
    scale = 0.5 * post.mean.pow(2).mean()
    return F.l1_loss(recon, target) + F.mse_loss(recon, target) + KL_WEIGHT * scale


@torch.no_grad()
def init_for_training(vae: VideoVAE, seed: int = 7) -> VideoVAE:
    """Weights a VAE trained from scratch starts from (not the test vectors' recipe, which is built to stress
    the kernels: peaked attention, large biases, a near-empty first group).

    He-normal convs, unit-scale linears, zero biases, unit norms, and every residual branch's last layer
    (each resnet's ``conv2``, the attention's output projection) at zero, so each block starts as the
    identity and the signal reaches the loss through the down- and up-sampling path alone: measured on
    the small restorer's VAE, training loss 0.29 after 300 steps against 0.41 from the vectors' recipe."""
    g = torch.Generator().manual_seed(seed)
    for name, p in vae.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 5:
            p.copy_(torch.randn(p.shape, generator=g) * math.sqrt(2.0 / p[0].numel()))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        else:
            p.fill_(1.0)
    for name, m in vae.named_modules():
        if name.endswith(".conv2") or name.endswith(".to_out.0"):
            m.weight.zero_()
    return pin_posterior_std(vae)


@torch.no_grad()
def pin_posterior_std(vae: VideoVAE) -> VideoVAE:
    """Set the encoder's log-variance channels to the range's floor: weights 0, bias ``logvar_range[0]``.

    The posterior's std is then ~3e-7, so a sample is its mean; :func:`vae_loss` never reads these
    channels, so they get no gradient and stay pinned through training (weight decay shrinks the bias
    by lr x decay of itself per step: 1e-5 at the defaults)."""
    c, half = vae.encoder.conv_out, vae.cfg.latent_channels
    c.weight[half:] = 0
    c.bias[half:] = vae.cfg.logvar_range[0]
    return vae


@torch.no_grad()
def latents(vae: VideoVAE, degraded: torch.Tensor, clean: torch.Tensor, g: torch.Generator):
    """(condition, target) channels-last (B, t, h, w, 16), scaled: a sample of the degraded clip, the clean mean."""
    pc, pd = posterior(vae, clean), posterior(vae, degraded)
    eps = make_noise(pd.mean.shape, g, dtype=torch.float32).to(pd.mean.dtype)
    cond = vae.to_latent(pd.sample(eps))
    target = vae.to_latent(pc.mean)
    return VideoVAE.channels_last(cond).float(), VideoVAE.channels_last(target).float()


SSIM_WINDOW = 7  # the quality metric's window (ditsp/io/quality.py: scikit-image's default, uniform)


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Mean SSIM of (N, C, H, W) images, as the quality metric computes it: a uniform 7 x 7 window over
    valid positions, sample covariances, K1 = 0.01 and K2 = 0.03 of ``data_range``; differentiable."""
    pool = lambda a: F.avg_pool2d(a, SSIM_WINDOW, stride=1)  # noqa: E731
    n = SSIM_WINDOW ** 2
    mx, my = pool(x), pool(y)
    vx, vy = (pool(x * x) - mx * mx) * n / (n - 1), (pool(y * y) - my * my) * n / (n - 1)
    cxy = (pool(x * y) - mx * my) * n / (n - 1)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.mean()


def latent_ssim(x0: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SSIM of each latent channel's (h, w) image of every frame, x0 against the target ``z`` (both
    (t, h, w, C)), the data range the target's. The small restorer's latent channels are the frame's
    2 x 2 pixel sub-grids (ditsp/train/vae_start.py), so this is the frame's SSIM at half resolution,
    for no decode; the windows must fit the latent (h, w >= 7)."""
    a, b = x0.permute(0, 3, 1, 2), z.permute(0, 3, 1, 2)  # (t, C, h, w)
    live = b.flatten(2).std(-1).amax(0) > 0  # channels the VAE leaves at zero carry no structure
    span = (b.amax() - b.amin()).clamp_min(1e-6).detach()
    return ssim(a[:, live], b[:, live], float(span))


# the x0 regression's distance (``ditsp train --dit-loss``): (x0, target), both (t, h, w, C) -> loss
DIT_LOSSES = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "l1-ssim": lambda x0, z: F.l1_loss(x0, z) + 1 - latent_ssim(x0, z),
}


def dit_loss(dit, vae: VideoVAE, text: torch.Tensor, degraded: torch.Tensor, clean: torch.Tensor,
             g: torch.Generator, runtime, distance: str = "mse") -> torch.Tensor:
    """Mean over the batch of the one-step x0 regression; ``runtime``: the DiT's (the SP group's, or
    :func:`~ditsp.models.seedvr2.parallelize.single_runtime`'s on one device); ``distance``: a key of
    :data:`DIT_LOSSES` (``l1-ssim`` adds SSIM over the latent channels: a mean-squared fit bought
    PSNR with faint patterned error in flat regions, which SSIM counts)."""
    cond, target = latents(vae, degraded, clean, g)
    losses = []
    for c, z in zip(cond, target):
        noise = make_noise(z.shape, g, dtype=torch.float32)
        v = dit(dit_input(noise, c).to(dit.dtype), text.to(dit.dtype), SCHEDULE_T, runtime=runtime)
        losses.append(DIT_LOSSES[distance](noise - v.float(), z))
    return torch.stack(losses).mean()


IDENTITY_CARRIER = 40.0  # the constant hidden unit of init_dit_as_identity: it holds the head's RMS near constant


@torch.no_grad()
def init_dit_as_identity(dit, seed: int = 0):
    """Weights a restoring DiT trained from scratch starts from: its one-step sample is the condition
    (``x0 = noise - v = condition``), so training learns a correction of the degraded latent instead of
    the whole latent. Measured on the small restorer (300 steps each): from the seeded weights the restored
    clip stayed 1.4 dB under bicubic; this start begins where the degraded latent decodes to.

    Every block's video branches (attention and MLP output projections; shared with the text's in the
    later blocks) start at zero, so each block is
    the identity on video rows. The patch embedding writes ``noise - condition`` of each patch position
    and channel on a hidden unit of its own, plus one constant unit (:data:`IDENTITY_CARRIER`) that keeps
    the output head's RMS norm nearly the same on every token (the head is then nearly affine); the other
    units keep their seeded weights for the blocks to read. The output projection is the least-squares
    inverse of the head at the sampling timestep, fitted on seeded probe rows."""
    from ..models.seedvr2.pipeline.condition import LATENT_CHANNELS

    cfg = dit.cfg
    positions = math.prod(cfg.patch_size)
    units, c = positions * LATENT_CHANNELS, LATENT_CHANNELS
    if cfg.vid_dim < units + 1 or cfg.vid_in_channels != 2 * c + 1:
        raise ValueError(f"an identity start needs vid_dim >= {units + 1} and [noise | condition | mask] input; "
                         f"{cfg.name} has vid_dim {cfg.vid_dim} and {cfg.vid_in_channels} input channels")
    for name, p in dit.named_parameters():
        if name.endswith(("attn.proj_out.vid.weight", "attn.proj_out.vid.bias", "mlp.vid.proj_out.weight",
                          "attn.proj_out.all.weight", "attn.proj_out.all.bias", "mlp.all.proj_out.weight")):
            p.zero_()  # (blocks whose video and text share projections: both streams' branches)
    w, b = dit.vid_in.proj.weight, dit.vid_in.proj.bias
    w[: units + 1].zero_()
    b[: units + 1].zero_()
    stride = cfg.vid_in_channels  # patch rows are (position, channel) with the channel fastest
    for pos in range(positions):
        for ch in range(c):
            w[pos * c + ch, pos * stride + ch] = 1.0
            w[pos * c + ch, pos * stride + c + ch] = -1.0
    b[units] = IDENTITY_CARRIER
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(4096, positions, c, generator=g)
    cond = torch.randn(4096, positions, c, generator=g)
    rows = torch.cat([noise, cond, torch.ones(4096, positions, 1)], dim=-1).reshape(4096, -1).to(w.dtype)
    t = torch.full((1,), float(SCHEDULE_T))
    emb = dit.emb_in(t, w.dtype)[0]
    head = dit.head.apply(dit, dit.vid_in.proj(rows), emb, cfg.norm_eps).double()
    target = (noise - cond).reshape(4096, -1).double()
    design = torch.cat([head, torch.ones(4096, 1, dtype=torch.float64)], dim=1)
    solution = torch.linalg.lstsq(design, target).solution  # (dim + 1, out)
    dit.vid_out.proj.weight.copy_(solution[:-1].T.to(w.dtype))
    dit.vid_out.proj.bias.copy_(solution[-1].to(w.dtype))
    return dit


def check_vae_training(sp: int) -> None:
    """The VAE trains on one device only: its sharded modes cannot be differentiated.

    Their group-norm statistics, halo rows and attention tokens travel by
    all-gathers and point-to-point copies without a backward rule (the
    gradient of a halo row belongs to the neighbour that sent it, and
    nothing sends it back), so a gradient through them would be silently
    wrong; the replicated VAE would only repeat the same work on every rank."""
    if sp > 1:
        raise ValueError("the VAE trains on one device (--sp 1): its sharded modes have no backward "
                         "(group-norm statistics and halo rows are all-gathers without gradient rules)")
