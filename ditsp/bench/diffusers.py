"""`ditsp bench diffusers`: ditsp's parallelize vs diffusers' own context parallelism on the same tiny Wan.

Every configuration builds the same seeded ``WanTransformer3DModel`` on every
rank, applies its parallelism and runs the same full inputs; a forward's
time is the slowest rank's (ranks start each forward after a barrier), the
table shows the median over the timed forwards (configurations interleaved
round by round, so machine drift hits all alike), the peak is the most memory
one forward added on any rank (:class:`ditsp.memory.PeakMemory`), and the
error is rank 0's output against the unmodified model on one device.

diffusers' native context parallelism (``enable_parallelism(config=
ContextParallelConfig(...))``) needs two workarounds on CPU, both applied
here: ``torch.accelerator.device_count()`` is 0 on a CPU-only machine and
``enable_parallelism`` divides the rank by it (it is made to answer 1 while
the call runs), and its output hook rejects the ``return_dict=True`` output
object (forwards pass ``return_dict=False``). A third one showed up here:
with Wan 2.1's one timestep per sample (``[B]``) its input hook takes the
"unexpected dims, not split" branch and calls ``logger.warning_once``, which
the plain ``logging.Logger`` it holds lacks (in the ranks of this benchmark
only, ``warning_once`` is made ``warning``). A configuration that raises is
listed with the first line of its error: the table says what runs at all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ..argtypes import nonneg_int, positive_int

RESULTS = Path("benchmarks/results/diffusers.md")


def configs(p: int) -> list[str]:
    names = ["ditsp-ulysses", "ditsp-ring", "diffusers-ulysses", "diffusers-ring", "diffusers-ulysses-anything",
             "diffusers-ring-anything"]
    if p == 4:
        names.insert(2, "ditsp-usp-2x2")
    return names


def _grid(tokens: int) -> tuple[int, int, int]:
    """A latent (frames, height, width) with ``tokens`` post-patch tokens (patch 1x2x2): 4 frames of a near-square."""
    per = max(1, tokens // 4)
    h = max(1, int(per ** 0.5))
    while per % h:
        h -= 1
    return 4, 2 * h, 2 * (per // h)


def _model(heads: int, head_dim: int, layers: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32,
                                 ffn_dim=2 * heads * head_dim, num_layers=layers, rope_max_seq_len=128).eval()


def _apply(name: str, model, ctx):
    p = ctx.world_size
    if name.startswith("ditsp"):
        from ..config import ParallelConfig
        from ..integrations.diffusers import parallelize

        cfg = {"ditsp-ulysses": ParallelConfig(ulysses_degree=p, advanced_uaa=True),
               "ditsp-ring": ParallelConfig(ring_degree=p),
               "ditsp-usp-2x2": ParallelConfig(ulysses_degree=2, ring_degree=2, advanced_uaa=True)}[name]
        parallelize(model, cfg, ctx.group)
        return
    from diffusers import ContextParallelConfig

    kw = {"diffusers-ulysses": dict(ulysses_degree=p), "diffusers-ring": dict(ring_degree=p),
          "diffusers-ulysses-anything": dict(ulysses_degree=p, ulysses_anything=True),
          "diffusers-ring-anything": dict(ring_degree=p, ring_anything=True)}[name]
    import logging

    if not hasattr(logging.Logger, "warning_once"):  # workaround 3 (see the module doc); bench ranks only
        logging.Logger.warning_once = logging.Logger.warning
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # workaround 1 (see the module doc)
    try:
        model.enable_parallelism(config=ContextParallelConfig(**kw))
    finally:
        torch.accelerator.device_count = count


def _fail(e: Exception) -> str:
    return "fails: " + (str(e).splitlines() or [type(e).__name__])[0][:110]


def rank_bench(ctx, names, tokens_list, heads, head_dim, layers, warmup, repeats) -> list[dict]:
    """Every configuration set up side by side, then timed in interleaved rounds (machine drift hits all
    alike); a configuration that raises (every rank raises alike) is kept with its error."""
    import torch.distributed as dist

    from ..memory import PeakMemory

    rows = []
    for tokens in tokens_list:
        f, h, w = _grid(tokens)
        g = torch.Generator().manual_seed(1)
        x, t, text = torch.randn(1, 4, f, h, w, generator=g), torch.tensor([500]), torch.randn(1, 16, 32, generator=g)
        ref = None
        if ctx.rank == 0:
            with torch.no_grad():
                ref = _model(heads, head_dim, layers)(x, t, text, return_dict=False)[0]
        models, here = {}, []
        for name in names:
            row = {"config": name, "tokens": f * (h // 2) * (w // 2), "ranks": ctx.world_size, "status": "ok",
                   "times": [], "peak": 0}
            here.append(row)
            dist.barrier(group=ctx.group)
            try:
                model = _model(heads, head_dim, layers)
                _apply(name, model, ctx)
                with torch.no_grad():
                    for _ in range(max(1, warmup)):
                        out = model(x, t, text, return_dict=False)[0]  # workaround 2: no return_dict output
                if ref is not None:
                    row["rel_err"] = float((out - ref).abs().max() / ref.abs().max())
                models[name] = model
            except Exception as e:
                row["status"] = _fail(e)
        with torch.no_grad():
            for _ in range(repeats):
                for row in here:
                    if row["config"] not in models:
                        continue
                    dist.barrier(group=ctx.group)
                    mem = PeakMemory(torch.device("cpu"))
                    mem.start()
                    t0 = time.perf_counter()
                    models[row["config"]](x, t, text, return_dict=False)
                    row["times"].append(time.perf_counter() - t0)
                    row["peak"] = max(row["peak"], mem.peak_added())
        rows += here
        del models
        dist.barrier(group=ctx.group)
    return rows


def merge(per_rank: list[list[dict]]) -> list[dict]:
    out = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        if all(r["status"] == "ok" for r in rows):
            slowest = [max(ts) for ts in zip(*(r["times"] for r in rows))]
            row["ms"] = 1e3 * statistics.median(slowest)
            row["peak_mib"] = max(r["peak"] for r in rows) / 2**20
        elif row["status"] == "ok":
            row["status"] = next(r["status"] for r in rows if r["status"] != "ok")
        out.append(row)
    return out


def format_table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| config | ranks | tokens | forward ms | peak MiB | rel err vs 1 device | runs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(f"| {r['config']} | {r['ranks']} | {r['tokens']} | " +
                     (f"{r['ms']:.1f} | {r['peak_mib']:.1f} | {r.get('rel_err', float('nan')):.1e} | yes |" if ok
                      else f" | | | {r['status']} |"))
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("diffusers", help="ditsp parallelize vs diffusers' native context parallelism (tiny Wan)")
    p.add_argument("--sp", type=positive_int, default=2, help="ranks (local gloo processes)")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=32)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", default=str(RESULTS), help="markdown table written here (appended); '' for none")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    try:
        import diffusers
    except ImportError:
        msg = "ditsp bench diffusers needs diffusers (pip install 'ditsp[diffusers]')"
        if parser is not None:
            parser.error(msg)
        raise
    from ..distributed.launcher import LocalCluster

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # freed tensors leave RSS: honest peaks
    names = configs(args.sp)
    with LocalCluster(args.sp, timeout_s=1800, threads=args.threads) as c:
        per_rank = c.run(rank_bench, names, args.tokens, args.heads, args.head_dim, args.layers, args.warmup,
                         args.repeats, timeout_s=1800)
    rows = merge(per_rank)
    cap = next((ln.strip() for ln in torch.__config__.show().splitlines() if "CPU capability" in ln), "")
    header = (f"### diffusers {diffusers.__version__} WanTransformer3DModel, {args.layers} layers, {args.heads}x"
              f"{args.head_dim} heads, fp32, {args.sp} gloo ranks x {args.threads} thread(s), median of "
              f"{args.repeats} ({cap})")
    table = format_table(rows, header)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text((out.read_text() + "\n" if out.exists() else "") + table + "\n")
        tmp.replace(out)
    return 0
