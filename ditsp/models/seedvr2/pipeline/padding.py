"""Frame padding before the causal VAE (which needs ``T = 4n + 1`` frames).

Two policies, both repeating the last frame:

* ``pad_frames`` (ditsp's default): pad to the next ``4n + 1`` only, so the
  restored video never depends on how many GPUs run it.
* ``reference_pad``: the reference script pads to ``(T - 1) % (4 * sp) == 0``
  and to at least ``4 * sp + 1`` frames, so its latent length, and with it
  the output, changes with the SP degree. Kept for parity checks.

Videos are ``(C, T, H, W)``; a single frame (an image) is never padded. The
number of frames before padding must be kept to cut the decoded video back.
"""

from __future__ import annotations

import torch

from ..vae.config import RELEASED  # the reference pipeline's VAE: the default factors


def padded_length(frames: int, multiple: int = RELEASED.temporal_factor) -> int:
    """Smallest ``T' >= frames`` with ``(T' - 1) % multiple == 0`` (1 stays 1)."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if frames == 1:
        return 1
    return frames + (-(frames - 1)) % multiple


def reference_padded_length(frames: int, sp: int = 1, temporal_factor: int = RELEASED.temporal_factor) -> int:
    """Frame count after the reference's SP-dependent padding."""
    if sp < 1:
        raise ValueError(f"sp must be >= 1, got {sp}")
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    k = temporal_factor * sp
    if frames == 1:
        return 1
    if frames <= k:
        return k + 1
    return padded_length(frames, k)


def repeat_last(video: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """Append copies of the last frame along ``dim`` until it has ``length`` frames."""
    t = video.shape[dim]
    if length < t:
        raise ValueError(f"cannot pad {t} frames down to {length}")
    if length == t:
        return video
    last = video.narrow(dim, t - 1, 1)
    reps = [1] * video.ndim
    reps[dim] = length - t
    return torch.cat([video, last.repeat(*reps)], dim=dim)


def pad_frames(video: torch.Tensor, multiple: int = RELEASED.temporal_factor, dim: int = 1) -> torch.Tensor:
    """Pad ``(C, T, H, W)`` (time on ``dim``) to ``kn + 1`` frames (k = ``multiple``, the VAE's time factor) by
    repeating the last."""
    return repeat_last(video, padded_length(video.shape[dim], multiple), dim)


def reference_pad(video: torch.Tensor, sp: int = 1) -> torch.Tensor:
    """The reference's padding of ``(C, T, H, W)`` for SP degree ``sp`` (depends on ``sp``)."""
    return repeat_last(video, reference_padded_length(video.shape[1], sp), 1)
