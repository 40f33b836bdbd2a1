"""Step 5a: ``--compile`` of the DiT blocks (:func:`ditsp.models.seedvr2.compiled.compile_dit`) against eager:
the 3B at released widths cut to the profile's blocks (two: one with its text tail, the last), 720p: eager and
compiled forward time, the first compiled forward (the compile), graphs and graph breaks, and the
output against eager. A compile that falls back to eager is a failure. The tiny profile traces with
dynamo's ``eager`` backend (no code generation) so the dry run takes seconds.
"""

from __future__ import annotations

import time
from unittest import mock

import torch

from ditsp.models.seedvr2 import compiled
from ditsp.models.seedvr2.parallelize import single_runtime

from . import build
from .measure import rel_err, sync, timed

TITLE = "--compile of the DiT blocks against eager"
AGREE = 3e-2  # bf16: compiled kernels fuse and round differently


@torch.no_grad()
def run(ctx) -> None:
    dev, prof = ctx.device, ctx.profile
    model = build.dit(prof.compile_model, dev, prof.dtype, layers=prof.compile_layers)
    grid, vid, txt = build.inputs(model.cfg, prof.compile_size, dev)
    rt = single_runtime(model.cfg, grid)
    fwd = lambda: model(vid, txt, 1000.0, runtime=rt)  # noqa: E731
    eager_s, _ = timed(fwd, dev, reps=3, warmup=1)
    want = fwd()
    import torch._dynamo

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    backend = prof.compile_backend
    plain = torch.compile
    patch = mock.patch.object(torch, "compile", lambda fn, **kw: plain(fn, backend=backend, **kw)) \
        if backend != "inductor" else mock.patch.object(torch, "compile", plain)
    with patch:
        state = compiled.compile_dit(model)
        t0 = time.perf_counter()
        got = fwd()
        sync(dev)
        first = time.perf_counter() - t0
    if state.error is not None:
        ctx.fail("compile", f"fell back to eager: {state.error}", first_s=round(first, 2))
        return
    comp_s, _ = timed(fwd, dev, reps=3, warmup=1)
    err = rel_err(got, want)
    graphs = int(counters["stats"].get("unique_graphs", 0))
    breaks = sum(counters["graph_break"].values())
    ok = err <= AGREE and bool(torch.isfinite(got).all())
    ctx.row("compiled vs eager", "ok" if ok else "FAIL", None if ok else f"output differs from eager by {err:.2e}",
            model=f"{prof.compile_model} x{prof.compile_layers} blocks", grid=list(grid), backend=backend,
            eager_s=round(eager_s, 4), compiled_s=round(comp_s, 4), speedup=round(eager_s / comp_s, 3),
            first_compiled_s=round(first, 2), graphs=graphs, graph_breaks=breaks, err=round(err, 6),
            state=state.describe())
    reasons = sorted({str(k)[:100] for k in counters["graph_break"]})
    if reasons:
        ctx.note("graph breaks: " + "; ".join(reasons))
