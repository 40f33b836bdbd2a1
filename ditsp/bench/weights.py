"""`ditsp bench weights`: load a 7B-shaped DiT file in each format; peak host memory and time per load.

Files of the 7B's tensor names and shapes (width 3072, its blocks; ``--layers`` of 36 on a small
machine) are generated on disk with seeded values, in bf16 safetensors, FP8 e4m3fn safetensors,
Q8_0 and Q4_K_M GGUF. Each load runs in a fresh process (so peaks do not mix) and is measured two
ways: the peak of anonymous memory (the process's own pages, sampled every millisecond: what the
rank really holds) and the RSS high-water mark, which also counts the file's pages the memory map
has touched (clean page cache, shared by every process of the host reading the file, dropped
under pressure). The bf16 file is also loaded the way ditsp did before streaming (the whole
state_dict read, cast to fp32, loaded, then cast to bf16) for comparison. A table goes to benchmarks/results/weights.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

RESULTS = os.path.join("benchmarks", "results", "weights.md")
GiB = 2**30


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("weights", help="peak host memory and time of loading a 7B-shaped DiT in each format")
    p.add_argument("--model", default="seedvr2-7b")
    p.add_argument("--layers", type=int, default=4, help="blocks of the model to generate (the 7B has 36)")
    p.add_argument("--formats", default="bf16,fp8_e4m3fn,Q8_0,Q4_K_M")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder, removed)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--skip-memory", action="store_true", help="only the quality table (seconds)")
    p.set_defaults(func=main)
    return p


# ----------------------------------------------------------------------------- files


def _tensors(model: str, layers: int, seed: int = 0):
    """(file name, shape, make) of every DiT tensor, reference names, seeded values (bf16)."""
    import torch

    from ..models.seedvr2.nadit.config import get_config
    from ..models.seedvr2.nadit.model import NaDiT
    from ..models.seedvr2.nadit.rope import RopeBuffer

    with torch.device("meta"):
        net = NaDiT(get_config(model, layers))
    ropes = {f"{n}.freqs": m for n, m in net.named_modules() if isinstance(m, RopeBuffer)}
    out = []
    for i, (k, v) in enumerate(net.state_dict().items()):
        shape = tuple(v.shape)
        if k in ropes:
            make = (lambda m=ropes[k]: m.analytic_freqs())
            k = k[: -len(".rope.freqs")] + ".rope.rope.freqs"
        elif len(shape) >= 2:
            make = (lambda s=shape, i=i: (torch.randn(s, generator=torch.Generator().manual_seed(seed + i)) * 0.02)
                    .to(torch.bfloat16))
        else:
            make = (lambda s=shape: torch.ones(s, dtype=torch.bfloat16))
        out.append((k, shape, make))
    return out


def write_file(fmt: str, folder: str, model: str, layers: int) -> str:
    import torch
    from safetensors.torch import save_file

    from ..weights import fp8
    from ..weights.gguf_write import Lazy, q4_k_m, q8_0, write_gguf

    items = _tensors(model, layers)
    if fmt in ("Q8_0", "Q4_K_M"):
        policy = {"Q8_0": q8_0, "Q4_K_M": q4_k_m}[fmt]
        path = os.path.join(folder, f"dit-{fmt}.gguf")
        return write_gguf(path, [(k, Lazy(s, m), "F32" if ".rope." in k else policy(k, s)) for k, s, m in items])
    path = os.path.join(folder, f"dit_{fmt}.safetensors")
    sd = {}
    for k, s, m in items:
        t = m()
        if fmt in fp8.FORMATS and fp8.eligible(k, s):
            t = t.to(fp8.FORMATS[fmt])
        sd[k] = t.contiguous() if ".rope." in k else t.to(t.dtype if fmt in fp8.FORMATS else torch.bfloat16)
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


# ----------------------------------------------------------------------------- one load, in a child


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


class LoadPeaks:
    """Memory of this process over a ``with`` block, from /proc (Linux): the anonymous memory's peak
    above its start (sampled every millisecond), the RSS high-water mark above the start's RSS, and
    the file pages mapped at the end above the start's. The high-water mark is reset on entry."""

    def __enter__(self) -> "LoadPeaks":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base, self._anon, self._stop = _status(), 0, threading.Event()

        def sample():
            while not self._stop.is_set():
                self._anon = max(self._anon, _status()["RssAnon"])
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        end = _status()
        self.peak_anon = self._anon - self.base["RssAnon"]
        self.peak_rss = end["VmHWM"] - self.base["VmRSS"]
        self.file_pages = end["RssFile"] - self.base["RssFile"]


def measure(path: str, model: str, layers: int, mode: str) -> dict:
    """Load ``path`` into a meta-built DiT (``mode`` "streaming", or "before": the previous loader's
    steps -- the whole file read and checked, every tensor cast to the meta model's fp32, loaded,
    then cast to bf16); peaks relative to the process before loading, every large allocation its own mapping
    (``exact_cpu_peaks``: no heap retention in the figures)."""
    import torch

    from ..memory import exact_cpu_peaks

    exact_cpu_peaks()

    from ..models.seedvr2.nadit.checkpoint import load_checkpoint
    from ..models.seedvr2.nadit.config import get_config
    from ..models.seedvr2.nadit.model import NaDiT
    from ..weights import held_bytes, max_buffer_bytes
    from ..weights.sizing import of_checkpoint

    cfg = get_config(model, layers)
    estimate = of_checkpoint(path, "bf16")
    with torch.device("meta"):
        net = NaDiT(cfg)
    with LoadPeaks() as mem:
        t0 = time.perf_counter()
        if mode == "before":
            from safetensors.torch import load_file

            sd = load_file(path)
            for v in sd.values():  # its finiteness check
                bool(torch.isfinite(v).all())
            cast = {k: v.to(torch.float32) for k, v in sd.items()}
            net.load_state_dict({k.replace(".rope.rope.", ".rope."): v for k, v in cast.items()}, assign=True)
            del sd, cast
            net.to(torch.bfloat16)
        else:
            load_checkpoint(net, path, dtype=torch.bfloat16)
        secs = time.perf_counter() - t0
    return {"seconds": secs, "peak_anon": mem.peak_anon, "peak_rss": mem.peak_rss,
            "kept": held_bytes(net), "buffer": max_buffer_bytes(net), "estimate": estimate.kept,
            "estimate_buffer": estimate.buffer, "file": os.path.getsize(path)}


def _child(path, model, layers, mode) -> dict:
    code = ("import json,sys; from ditsp.bench.weights import measure; "
            f"print(json.dumps(measure({path!r}, {model!r}, {layers}, {mode!r})))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- quality

VECTORS = os.path.join("tests", "data")
# name -> (writer of a state_dict, file suffix); "bf16" rounds the weights to bf16 (the float baseline).
QUALITY_FORMATS = ("bf16", "fp8_e4m3fn", "fp8_e4m3fn_scaled", "fp8_e5m2_scaled", "Q8_0", "Q4_K_M")


def _write_quality(fmt: str, sd, folder: str, prefix: str) -> str:
    import torch
    from safetensors.torch import save_file

    from ..weights.convert import save_fp8, save_gguf
    from ..weights.gguf_write import q4_k_m, q8_0

    base = os.path.join(folder, f"{prefix}-{fmt}")
    if fmt == "bf16":
        save_file({k: (v if ".rope." in k else v.to(torch.bfloat16)).contiguous() for k, v in sd.items()},
                  base + ".safetensors")
        return base + ".safetensors"
    if fmt.startswith("fp8"):
        return save_fp8(sd, base + ".safetensors", fmt.removesuffix("_scaled"), scaled=fmt.endswith("_scaled"))
    return save_gguf(sd, base + ".gguf", {"Q8_0": q8_0, "Q4_K_M": q4_k_m}[fmt], prefix="model.diffusion_model."
                     if prefix != "vae" else "")


def quality(folder: str) -> list[dict]:
    """Per format: max and relative (L2) error of the tiny DiTs' outputs (the reference vectors'
    inputs and weights) and of the tiny VAE's decoded frames, against the fp32 weights; fp32 compute."""
    import torch
    from safetensors.torch import load_file

    from ..models.seedvr2.nadit.model import NaDiT
    from ..models.seedvr2.nadit.checkpoint import load_checkpoint
    from ..models.seedvr2.parallelize import single_runtime
    from ..models.seedvr2.verify import nadit_config, read_config
    from ..models.seedvr2.vae import TINY as VAE_TINY
    from ..models.seedvr2.vae import VideoVAE
    from ..models.seedvr2.vae import load_checkpoint as load_vae
    from ..models.seedvr2.vae.fixtures import seeded_vae

    torch.set_num_threads(1)

    def err(out, ref):
        return float((out - ref).abs().max() / ref.abs().max()), float((out - ref).norm() / ref.norm())

    rows = []
    for name in ("nadit-3b-tiny", "nadit-7b-tiny"):
        d = os.path.join(VECTORS, name)
        cfg = nadit_config(read_config(d), name)
        sd = load_file(os.path.join(d, "weights.safetensors"))
        io = load_file(os.path.join(d, "io.safetensors"))
        full = NaDiT(cfg).eval()
        load_checkpoint(full, sd)
        with torch.no_grad():
            one = single_runtime(cfg, full.grid_of(io["vid_in"].shape))
            ref = full(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
        for fmt in QUALITY_FORMATS:
            with torch.device("meta"):
                m = NaDiT(cfg)
            load_checkpoint(m, _write_quality(fmt, sd, folder, name))
            with torch.no_grad():
                out = m.eval()(io["vid_in"], io["txt_in"], io["timestep"], runtime=one)
            rows.append({"model": name, "fmt": fmt, "what": "DiT output", **dict(zip(("max", "rel"), err(out, ref)))})
    vae = seeded_vae(VAE_TINY, 1234)
    io = load_file(os.path.join(VECTORS, "vae-tiny", "io.safetensors"))
    with torch.no_grad():
        ref = vae.decode(io["posterior_mean"])
    for fmt in QUALITY_FORMATS:
        with torch.device("meta"):
            v = VideoVAE(VAE_TINY)
        load_vae(v, _write_quality(fmt, vae.state_dict(), folder, "vae"))
        with torch.no_grad():
            out = v.eval().decode(io["posterior_mean"])
        rows.append({"model": "vae-tiny", "fmt": fmt, "what": "decoded frames", **dict(zip(("max", "rel"), err(out, ref)))})
    return rows


def quality_table(rows: list[dict]) -> list[str]:
    models = list(dict.fromkeys(r["model"] for r in rows))
    head = "| weights | " + " | ".join(f"{m} max | {m} rel" for m in models) + " |"
    lines = [head, "| --- |" + " ---: | ---: |" * len(models)]
    for fmt in QUALITY_FORMATS:
        cells = []
        for m in models:
            r = next(x for x in rows if x["model"] == m and x["fmt"] == fmt)
            cells += [f"{r['max']:.2e}", f"{r['rel']:.2e}"]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------- table


def main(args: argparse.Namespace, parser=None) -> int:
    import torch

    formats = [f for f in args.formats.split(",") if f]
    tmp = None
    folder = args.dir
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="ditsp-bench-weights-")
        folder = tmp.name
    os.makedirs(folder, exist_ok=True)
    rows = []
    try:
        qrows = quality(folder)
        for r in qrows:
            print(json.dumps(r), flush=True)
        for fmt in ([] if args.skip_memory else formats):
            t0 = time.perf_counter()
            path = write_file(fmt, folder, args.model, args.layers)
            made = time.perf_counter() - t0
            modes = ["streaming", "before"] if fmt == "bf16" else ["streaming"]
            for mode in modes:
                with open(path, "rb") as f:  # warm page cache: every load reads from memory, not disk
                    while f.read(1 << 24):
                        pass
                r = _child(path, args.model, args.layers, mode)
                r.update(fmt=fmt, mode=mode, write_s=made)
                rows.append(r)
                print(json.dumps(r), flush=True)
            os.remove(path)
    finally:
        if tmp is not None:
            tmp.cleanup()
    cap = torch.__config__.show().split("CPU capability usage:")[-1].splitlines()[0].strip()
    lines = [
        f"# Loading a 7B-shaped DiT: peak host memory per format (`ditsp bench weights`)",
        "",
        f"{args.model} tensor names and shapes, {args.layers} of 36 blocks (width 3072), seeded values; bf16 "
        f"compute; one process per load, one thread, warm page cache; CPU capability {cap}. *peak anon*: the "
        f"process's own memory (sampled every ms; every large allocation its own mapping); *peak RSS*: its high-water mark, which also counts the file pages the "
        f"memory map touched (page cache, shared by the host's readers). *kept*: the model's tensors after "
        f"loading; *estimate*: `ditsp/weights/sizing.py` from the file's header.",
        "",
        "| format | load | file GiB | kept GiB | estimate GiB | dequant buffer MiB | peak anon GiB | peak anon / kept "
        "| peak RSS GiB | load s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['fmt']} | {'previous loader (whole file, fp32, then bf16)' if r['mode'] == 'before' else 'streamed'} "
                     f"| {r['file'] / GiB:.2f} | {r['kept'] / GiB:.2f} | {r['estimate'] / GiB:.2f} "
                     f"| {r['buffer'] / 2**20:.0f} | {r['peak_anon'] / GiB:.2f} | {r['peak_anon'] / r['kept']:.2f} "
                     f"| {r['peak_rss'] / GiB:.2f} | {r['seconds']:.1f} |")
    if args.skip_memory and os.path.isfile(args.out):  # keep the memory table of the last full run
        with open(args.out) as f:
            old = f.read().split("\n# Quality")[0].rstrip("\n").splitlines()
        lines = old
    lines += [
        "",
        "# Quality per format (the reference vectors' tiny configs)",
        "",
        "Max |out - fp32| / max |fp32| and relative L2 error of the DiT output (3B and 7B tiny vector sets: "
        "their weights and inputs) and of the VAE's decoded frames (tiny VAE, the vectors' posterior mean), "
        "each format's weights computed in fp32 against the fp32 weights. `bf16` is the float baseline "
        "(weights rounded to bf16). FP8 files without a scale (ComfyUI's plain conversions) lose small "
        "weights to FP8's subnormal range; `_scaled` files carry a per-tensor scale (as `--weights-dtype fp8` "
        "makes). Q4_K_M is `ditsp/weights/gguf_write.py`'s mix (Q4_K, Q6_K for output projections) with a "
        "plain min/max Q4_K encoder, not llama.cpp's error-minimising one.",
        "",
        *quality_table(qrows),
    ]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    text = "\n".join(lines) + "\n"
    with open(args.out + ".tmp", "w") as f:
        f.write(text)
    os.replace(args.out + ".tmp", args.out)
    print(text)
    return 0
