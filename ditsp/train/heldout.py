"""The held-out clip of the main job: a degraded low-resolution input and its clean original.

``python -m ditsp.train.heldout out/input.mp4 out/clean --size 128x96 --frames 21``
writes the degraded clip (the training chain's degradations, at 1/2 size) as a
video and the clean clip (``size``) as a folder of PNG frames (lossless, the
``--reference`` of ``ditsp upscale``). It is made from scikit-image's
``chelsea``, a photograph the training never sees (:mod:`.data`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from ..io.write import write_image, write_video
from .data import held_out_clip, to_u8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditsp.train.heldout", description=__doc__.splitlines()[0])
    ap.add_argument("input", help="degraded clip to write (.mp4)")
    ap.add_argument("clean", help="folder for the clean frames (PNG)")
    ap.add_argument("--size", default="128x96", help="clean WxH (the restored output's size)")
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--fps", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    w, h = (int(v) for v in a.size.lower().split("x"))
    low, clean = held_out_clip(a.frames, (h, w), a.seed)
    write_video(a.input, to_u8(low), a.fps, crf=0, overwrite=a.overwrite)  # lossless (at crf 12 runs differed)
    out = Path(a.clean)
    if out.exists() and not a.overwrite:
        print(f"{out} exists (pass --overwrite)", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if str(out.parent) else "."))
    for i, f in enumerate(to_u8(clean)):
        write_image(tmp / f"{i:04d}.png", f)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote {a.input} ({w // 2}x{h // 2}, degraded) and {out}/ ({w}x{h}, clean), {a.frames} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())
