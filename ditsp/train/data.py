"""(degraded, clean) clip pairs for restoration training, from the pictures the installed packages ship.

A clean clip is a crop of a photograph panned a few pixels per frame (motion
without a video corpus). Its degraded twin goes through the chain
restoration models are trained on, each step drawn per clip from a seeded
generator: Gaussian blur, downscale (area), Gaussian noise, then real
compression through PyAV (H.264 of the whole clip, or JPEG per frame), and a
bicubic upscale back to the clean size (the pipeline restores at the output
size). Everything is a function of (seed, index): the same pair on every rank
and on a resumed run.

Two photographs never enter training: ``chelsea`` (and its alias ``cat``)
makes the held-out clip (:func:`held_out_clip`), and matplotlib's
``grace_hopper.jpg`` (a portrait) is the unseen photograph the restorer's
benchmark also cuts a clip from.
"""

from __future__ import annotations

import io
from fractions import Fraction
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import av

# Every picture the installed packages ship for offline use: scikit-image's bundled data, and the photographs in
# matplotlib's sample data (``mpl:<file>``), less the two held out.
TRAIN_IMAGES = ("astronaut", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "colorwheel",
                "retina", "brick", "grass", "gravel", "camera", "coins", "moon", "clock", "horse", "cell", "page",
                "text", "logo", "checkerboard", "mpl:Minduka_Present_Blue_Pack.png")
HELD_OUT = "chelsea"
UNSEEN = "mpl:grace_hopper.jpg"  # a photograph no training saw (the restorer's second test clip)


def photograph(name: str) -> np.ndarray:
    """A bundled photograph as (H, W, 3) uint8 (grey replicated, alpha dropped): a scikit-image data name, or
    ``mpl:<file>`` from matplotlib's sample data."""
    if name in (HELD_OUT, "cat") and name != HELD_OUT:
        raise ValueError(f"{name!r} is the held-out image")
    if name.startswith("mpl:"):
        import matplotlib.cbook  # local: loaded only when this runs
        from PIL import Image

        with Image.open(matplotlib.cbook.get_sample_data(name[4:], asfileobj=False)) as f:
            im = np.array(f.convert("RGB"))  # a writable copy
    else:
        import skimage.data  # local: a heavy optional package, loaded only when this runs

        im = np.asarray(getattr(skimage.data, name)())
    if im.dtype != np.uint8:
        im = (np.clip(im.astype(np.float64) / max(im.max(), 1), 0, 1) * 255).astype(np.uint8)
    if im.ndim == 2:
        im = np.repeat(im[..., None], 3, -1)
    return np.ascontiguousarray(im[..., :3])


@dataclass(frozen=True)
class Degradation:
    """Ranges of the degradation chain; each clip draws its own values."""

    scale: int = 2  # downscale factor (the restorer upscales by it)
    blur_sigma: tuple[float, float] = (0.2, 1.2)
    noise_std: tuple[float, float] = (0.0, 0.03)  # in [0, 1] units
    crf: tuple[int, int] = (24, 36)  # H.264
    jpeg_q: tuple[int, int] = (4, 16)  # JPEG qscale (higher: worse)
    h264_share: float = 0.5  # clips compressed with H.264 (the rest: JPEG)


def gaussian_blur(frames: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of (T, 3, H, W) float frames (reflect padding); sigma <= 0: unchanged."""
    if sigma <= 0:
        return frames
    r = max(1, int(round(3 * sigma)))
    x = torch.arange(-r, r + 1, dtype=torch.float64)
    k = torch.exp(-x ** 2 / (2 * sigma ** 2))
    k = (k / k.sum()).to(frames.dtype)
    c = frames.shape[1]
    y = F.pad(frames, (r, r, r, r), mode="reflect")
    y = F.conv2d(y, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(y, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def to_u8(frames: torch.Tensor) -> np.ndarray:
    """(T, 3, H, W) float in [0, 1] -> (T, H, W, 3) uint8."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def from_u8(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255


def h264_roundtrip(frames: np.ndarray, crf: int) -> np.ndarray:
    """(T, H, W, 3) uint8 through a real H.264 encode (libx264, yuv420p, in memory) and decode."""
    t, h, w, _ = frames.shape
    ph, pw = -h % 2, -w % 2  # yuv420p needs even sizes
    src = np.pad(frames, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        st = out.add_stream("libx264", rate=12)
        st.width, st.height, st.pix_fmt = src.shape[2], src.shape[1], "yuv420p"
        st.options = {"crf": str(int(crf)), "preset": "veryfast", "threads": "1"}
        for f in src:
            out.mux(st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(st.encode())
    buf.seek(0)
    with av.open(buf) as inp:
        dec = [f.to_ndarray(format="rgb24") for f in inp.decode(video=0)]
    if len(dec) != t:
        raise RuntimeError(f"H.264 round trip returned {len(dec)} frames, expected {t}")
    return np.stack(dec)[:, :h, :w]


def jpeg_roundtrip(frames: np.ndarray, qscale: int) -> np.ndarray:
    """(T, H, W, 3) uint8, each frame through a real JPEG encode (PyAV's mjpeg, yuvj420p) and decode."""
    out = []
    for f in frames:
        enc = av.CodecContext.create("mjpeg", "w")
        h, w = f.shape[:2]
        enc.width, enc.height, enc.pix_fmt = w + w % 2, h + h % 2, "yuvj420p"
        enc.time_base = Fraction(1, 12)
        enc.options = {"qmin": str(qscale), "qmax": str(qscale)}
        frame = av.VideoFrame.from_ndarray(np.pad(f, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge"), format="rgb24")
        packets = enc.encode(frame) + enc.encode(None)
        dec = av.CodecContext.create("mjpeg", "r")
        got = [g for p in packets for g in dec.decode(p)]
        out.append(got[0].to_ndarray(format="rgb24")[:h, :w])
    return np.stack(out)


def degrade(clean: torch.Tensor, deg: Degradation, g: torch.Generator) -> torch.Tensor:
    """(T, 3, H, W) clean frames in [0, 1] -> degraded frames of the same size (the restorer's input)."""
    def u(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g, dtype=torch.float64).item()

    t, _, h, w = clean.shape
    x = gaussian_blur(clean, u(*deg.blur_sigma))
    x = F.interpolate(x, size=(h // deg.scale, w // deg.scale), mode="area")
    x = x + torch.randn(x.shape, generator=g) * u(*deg.noise_std)
    if torch.rand((), generator=g).item() < deg.h264_share:
        x = from_u8(h264_roundtrip(to_u8(x), int(round(u(*deg.crf)))))
    else:
        x = from_u8(jpeg_roundtrip(to_u8(x), int(round(u(*deg.jpeg_q)))))
    return F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False).clamp(0, 1)


def pan_clip(image: np.ndarray, frames: int, size: tuple[int, int], g: torch.Generator,
             max_step: int = 3, zoom: tuple[float, float] = (0.25, 1.0), zoom_drift: float = 0.0) -> torch.Tensor:
    """A (T, 3, h, w) clip in [0, 1]: a random crop of ``image`` panned by a random step per frame.

    ``zoom_drift`` > 0 also zooms over the clip: the crop's side changes by a factor drawn from
    ``[1 - zoom_drift, 1 + zoom_drift]`` from the first frame to the last, about the crop's centre
    (never outside the first frame's crop)."""
    h, w = size
    H, W = image.shape[:2]
    z = zoom[0] + (zoom[1] - zoom[0]) * torch.rand((), generator=g).item()
    ch, cw = max(h, int(min(H, W) * z * h / max(h, w))), max(w, int(min(H, W) * z * w / max(h, w)))
    dy, dx = (int(v) for v in torch.randint(-max_step, max_step + 1, (2,), generator=g))
    span_y, span_x = abs(dy) * (frames - 1), abs(dx) * (frames - 1)
    ch, cw = min(ch, H - span_y), min(cw, W - span_x)  # every frame's crop inside the photograph
    y0 = int(torch.randint(0, max(1, H - ch - span_y), (), generator=g)) + (span_y if dy < 0 else 0)
    x0 = int(torch.randint(0, max(1, W - cw - span_x), (), generator=g)) + (span_x if dx < 0 else 0)
    drift = 1.0
    if zoom_drift > 0:
        drift = 1 - zoom_drift + 2 * zoom_drift * torch.rand((), generator=g).item()
    img = torch.from_numpy(image).permute(2, 0, 1).float() / 255
    crops = []
    for i in range(frames):
        f = 1 + (drift - 1) * i / max(1, frames - 1)
        fh, fw = max(1, min(ch, round(ch * f))), max(1, min(cw, round(cw * f)))  # zooming stays inside the crop
        top, left = y0 + i * dy + (ch - fh) // 2, x0 + i * dx + (cw - fw) // 2
        crop = img[:, top: top + fh, left: left + fw].unsqueeze(0)
        crops.append(F.interpolate(crop, size=(h, w), mode="area")[0] if (fh, fw) != (h, w) else crop[0])
    return torch.stack(crops)


class ClipPairs:
    """Item ``i`` -> (degraded, clean), both (T, 3, H, W) in [0, 1], a pure function of (seed, i)."""

    def __init__(self, frames: int = 5, size: tuple[int, int] = (32, 32), seed: int = 0,
                 degradation: Degradation = Degradation(), images=TRAIN_IMAGES, zoom_drift: float = 0.15):
        if HELD_OUT in images or "cat" in images or UNSEEN in images:
            raise ValueError("a held-out image cannot be a training image")
        self.frames, self.size, self.seed, self.deg = frames, tuple(size), seed, degradation
        self.zoom_drift = zoom_drift
        self.names = tuple(images)
        self._images: dict[str, np.ndarray] = {}

    def image(self, name: str) -> np.ndarray:
        if name not in self._images:
            self._images[name] = photograph(name)
        return self._images[name]

    def _clean(self, i: int, size) -> tuple[torch.Tensor, torch.Generator]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + int(i)) & ((1 << 62) - 1))
        name = self.names[int(torch.randint(0, len(self.names), (), generator=g))]
        clean = pan_clip(self.image(name), self.frames, tuple(size or self.size), g, zoom_drift=self.zoom_drift)
        if torch.rand((), generator=g).item() < 0.5:
            clean = clean.flip(-1)
        return clean, g

    def item(self, i: int, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Item ``i`` at ``size`` (default: the dataset's)."""
        clean, g = self._clean(i, size)
        return degrade(clean, self.deg, g), clean

    __getitem__ = item

    def batch(self, step: int, batch: int, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``step*batch .. step*batch+batch-1`` stacked: (B, T, 3, H, W) each, at ``size``."""
        pairs = [self.item(step * batch + j, size) for j in range(batch)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def clean_batch(self, step: int, batch: int, size: tuple[int, int] | None = None) -> torch.Tensor:
        """The clean clips of :meth:`batch` alone (B, T, 3, H, W), without the degradations' cost (the same
        clips: the degradations draw after them)."""
        return torch.stack([self._clean(step * batch + j, size)[0] for j in range(batch)])


def held_out_clip(frames: int, size: tuple[int, int], seed: int = 1234, degradation: Degradation = Degradation(),
                  image: str = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
    """(degraded at 1/scale size, clean) clip of a held-out photograph: the pipeline's input and reference.

    ``image``: :data:`HELD_OUT` (the main job's clip) or :data:`UNSEEN`. The degraded clip is returned at
    the low resolution (before the bicubic upscale), as a user's input."""
    if image not in (HELD_OUT, UNSEEN):
        raise ValueError(f"{image!r} is a training image; held out are {HELD_OUT!r} and {UNSEEN!r}")
    g = torch.Generator().manual_seed(seed)
    clean = pan_clip(photograph(image), frames, size, g, zoom=(0.6, 0.6))
    h, w = size
    full = degrade(clean, degradation, g)  # the training chain, upscaled back; the input is its low-res form
    low = F.interpolate(full, size=(h // degradation.scale, w // degradation.scale), mode="area")
    return low, clean
