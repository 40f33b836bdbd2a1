"""Quality figures of a restoration against a clean reference: PSNR and SSIM (scikit-image's metrics).

Frames are uint8 ``(T, H, W, 3)``; PSNR uses data range 255, SSIM
scikit-image's default 7x7 uniform window over the three channels
(``channel_axis=-1``). Each figure is the mean over frames; per window (the
restorer's temporal windows) and overall. The baseline is a bicubic upscale of
the input to the output size (antialiased, as the pipeline resizes), delivered
the way the restored frames were: a video output's frames are read back from
its H.264 yuv420p file, so the bicubic frames go through the same encoder
(:func:`through_video`), else the comparison would charge the encoder's loss
(0.25 dB on the main job's clip at crf 18) to the restorer alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from .probe import open_media
import os
import tempfile


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import peak_signal_noise_ratio  # local: a heavy optional package, loaded only when this runs

    return float(peak_signal_noise_ratio(b, a, data_range=255))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity  # local: a heavy optional package, loaded only when this runs

    return float(structural_similarity(b, a, data_range=255, channel_axis=-1))


def frame_scores(frames: np.ndarray, reference: np.ndarray) -> list[tuple[float, float]]:
    """(PSNR, SSIM) of each frame against the reference frame of the same index."""
    if frames.shape != reference.shape:
        raise ValueError(f"frames {tuple(frames.shape)} and reference {tuple(reference.shape)} differ in size")
    return [(psnr(f, r), ssim(f, r)) for f, r in zip(frames, reference)]


def bicubic(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(T, h, w, 3) uint8 -> (T, H, W, 3) uint8, antialiased bicubic."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    y = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    return y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def summarize(scores: list[tuple[float, float]], windows: Sequence[Sequence[int]]) -> dict:
    def mean(rows):
        return {"psnr": float(np.mean([r[0] for r in rows])), "ssim": float(np.mean([r[1] for r in rows]))}

    return {"overall": mean(scores), "windows": [mean(scores[a:b]) for a, b in windows]}


def through_video(frames: np.ndarray, fps: float, crf: int) -> np.ndarray:
    """``frames`` as a video file written like the restorer's output (:func:`~ditsp.io.write.write_video`,
    ``crf``) reads them back."""
    from .write import write_video

    with tempfile.TemporaryDirectory(prefix="ditsp-baseline-") as folder:
        path = os.path.join(folder, "bicubic.mp4")
        write_video(path, list(frames), fps, crf=crf)
        return read_frames(path)


def report(restored: np.ndarray, source: np.ndarray, reference: np.ndarray,
           windows: Sequence[Sequence[int]] | None = None, baseline: np.ndarray | None = None) -> dict:
    """Restored and bicubic figures against ``reference`` (all frames the restorer wrote); ``baseline``:
    the bicubic frames as delivered (default: :func:`bicubic` of ``source``, unencoded)."""
    t = restored.shape[0]
    if reference.shape[0] < t:
        raise ValueError(f"the reference has {reference.shape[0]} frames, the output {t}")
    reference = reference[:t]
    if reference.shape[1:] != restored.shape[1:]:
        raise ValueError(f"the reference is {reference.shape[2]}x{reference.shape[1]}, the output "
                         f"{restored.shape[2]}x{restored.shape[1]}: pass a reference of the output's size")
    windows = windows or [(0, t)]
    base = bicubic(source[:t], restored.shape[1:3]) if baseline is None else baseline[:t]
    return {"restored": summarize(frame_scores(restored, reference), windows),
            "bicubic": summarize(frame_scores(base, reference), windows), "windows": [list(w) for w in windows]}


def format_report(q: dict) -> str:
    r, b = q["restored"]["overall"], q["bicubic"]["overall"]
    lines = [f"quality vs reference: restored PSNR {r['psnr']:.2f} dB SSIM {r['ssim']:.4f}; "
             f"bicubic PSNR {b['psnr']:.2f} dB SSIM {b['ssim']:.4f}"
             + (f" ({q['baseline']})" if q.get("baseline", "bicubic") != "bicubic" else "")]
    for (a, z), wr, wb in zip(q["windows"], q["restored"]["windows"], q["bicubic"]["windows"]):
        lines.append(f"  frames {a}-{z - 1}: restored {wr['psnr']:.2f} dB / {wr['ssim']:.4f}, "
                     f"bicubic {wb['psnr']:.2f} dB / {wb['ssim']:.4f}")
    return "\n".join(lines)


def read_frames(path: str) -> np.ndarray:
    """Every frame of a video, image or frame folder as (T, H, W, 3) uint8."""

    _, chunks = open_media(path)
    frames = torch.cat([c if c.dim() == 4 else c[None] for c in chunks])  # (T, 3, H, W)
    return frames.permute(0, 2, 3, 1).contiguous().numpy()


def plot_compare(source: np.ndarray, restored: np.ndarray, reference: np.ndarray, path: str, q: dict,
                 columns: int = 4, baseline: np.ndarray | None = None) -> None:
    """Rows: the input (each pixel shown as a block at the output size), the restored frames, the bicubic upscale
    of the input, the clean original; each labelled with its PSNR and SSIM."""
    import matplotlib  # local: a heavy optional package, loaded only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: a heavy optional package, loaded only when this runs

    t = restored.shape[0]
    idx = sorted({int(round(i * (t - 1) / max(1, columns - 1))) for i in range(columns)})
    up = bicubic(source[:t], restored.shape[1:3]) if baseline is None else baseline[:t]
    big = np.repeat(np.repeat(source[:t], restored.shape[1] // source.shape[1], 1), restored.shape[2] // source.shape[2], 2)
    r, b = q["restored"]["overall"], q["bicubic"]["overall"]
    rows = [(f"input {source.shape[2]}x{source.shape[1]}", big),
            (f"restored {r['psnr']:.2f} dB / {r['ssim']:.3f}", restored),
            (f"bicubic {b['psnr']:.2f} dB / {b['ssim']:.3f}", up), ("clean original", reference[:t])]
    fig, axes = plt.subplots(len(rows), len(idx), figsize=(2.2 * len(idx), 2.1 * len(rows)), squeeze=False)
    for i, (title, frames) in enumerate(rows):
        for j, k in enumerate(idx):
            ax = axes[i][j]
            ax.imshow(frames[k], interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(title, fontsize=8)
            if i == 0:
                ax.set_title(f"frame {k}", fontsize=8)
    fig.tight_layout()

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".quality.", suffix=".png", dir=folder)  # written whole, then renamed
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
