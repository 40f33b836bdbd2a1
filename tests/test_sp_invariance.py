"""The NaDiT output does not depend on the SP degree, bit for bit (issue #15).

Every SP output here is compared with ``torch.equal`` to the one-device output
(same CPU, one compute thread per rank and in the reference, this torch build).
The grids are chosen for the cases where the degree could leak into the
arithmetic (see docs/determinism.md):

- ``(1, 21, 21)``: regular windows of 1, 20, 20 and 400 tokens: at SP=4 a rank
  holds only the 1-token window (both planners), at SP=5 ranks are also empty;
- ``(5, 1, 2)``: 10 tokens in windows of 2, 4, 4: ranks of 2 rows, empty ranks;
- ``(2, 4, 7)``: two windows: SP 3-5 leave ranks empty;
- ``(5, 20, 36)``: the reference vectors' grid, ragged windows of 9 shapes.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ditsp.config import ParallelConfig
from ditsp.models.seedvr2.job.forward import Engine, RunSpec, build_for
from ditsp.models.seedvr2.nadit import NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.config import TINY, TINY_7B
from ditsp.attention.window import segment_attention
from ditsp.fixed_shape import FAST, KernelShapes, linear_rows, plain_linear, use
from ditsp.models.seedvr2.nadit.tokenwise import TokenLinear
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime
from ditsp.windows.schedule import plan_schedule

pytestmark = [pytest.mark.bitwise, pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

DATA = Path(__file__).parent / "data"
ONE_ROW, SMALL_ROWS, EMPTY, RAGGED = (1, 21, 21), (5, 1, 2), (2, 4, 7), (5, 20, 36)
DEGREES = (2, 3, 4, 5)




# -- rank functions (module level: they travel to the ranks by name) ----------------------------------


@torch.no_grad()
def forward_specs(ctx, specs, deterministic=True):
    """Every rank's output of each spec (the ranks' model cache serves specs of one model in a row)."""
    outs = []
    for spec in specs:
        engine = Engine.get(spec.model_spec)
        model, vid, txt = build_for(spec)
        rt = engine.runtime(spec.grid, spec.sp, ctx.group, spec.path, spec.planner, deterministic)
        outs.append(model(vid, txt, 1000.0, runtime=rt))
    return outs


@torch.no_grad()
def forward_vectors(ctx, directory, planner):
    """The shipped reference vector set's model and inputs under window SP."""
    cfg, model, d = vector_model(directory)
    rt = parallelize(cfg, ParallelConfig.window(ctx.world_size, window_planner=planner, deterministic=True),
                     model.grid_of(d["vid_in"].shape), ctx.group)
    return model(d["vid_in"], d["txt_in"], d["timestep"], runtime=rt)


def vector_model(directory):
    cfg = TINY_7B if "7b" in Path(directory).name else TINY
    model = NaDiT(cfg).eval()
    load_checkpoint(model, Path(directory) / "weights.safetensors")
    return cfg, model, load_file(Path(directory) / "io.safetensors")


@torch.no_grad()
def single(spec, deterministic=True):
    model, vid, txt = build_for(RunSpec(spec.model, spec.grid, 1, dtype=spec.dtype, seed=spec.seed))
    rt = single_runtime(model.cfg, model.grid_of(vid.shape), deterministic=deterministic)
    return model(vid, txt, 1000.0, runtime=rt)


def check_all_equal(results, specs, refs):
    for rank, outs in enumerate(results):
        for spec, out in zip(specs, outs):
            ref = refs[(spec.model, spec.grid, spec.dtype)]
            assert out.dtype == ref.dtype
            assert torch.equal(out, ref), (
                f"rank {rank} {spec}: max |diff| {(out.float() - ref.float()).abs().max().item():.3g}")


def run_matrix(clusters, models, grids, dtypes, planners, path="window", extra=()):
    """Every (model, dtype, grid, planner) at every degree; ``extra``: more (model, grid, dtype, planner)."""
    combos = [(m, g, dt, pl) for m in models for dt in dtypes for g in grids for pl in planners] + list(extra)
    specs = {n: [RunSpec(m, g, n, dtype=dt, planner=pl, path=path) for m, g, dt, pl in combos] for n in DEGREES}
    refs = {(s.model, s.grid, s.dtype): single(s) for s in specs[DEGREES[0]]}
    for n in DEGREES:
        check_all_equal(clusters(n).run(forward_specs, specs[n]), specs[n], refs)


# -- the grids really reach the cases named above -----------------------------------------------------


def test_the_grids_hold_one_row_ranks_small_ranks_and_empty_ranks():
    methods = TINY.window_methods
    rows = {(g, n, pl): plan_schedule(g, methods, n, pl).plans[methods[0]].rank_tokens.tolist()
            for g in (ONE_ROW, SMALL_ROWS, EMPTY) for n in DEGREES for pl in ("lpt", "locality")}
    assert 1 in rows[(ONE_ROW, 4, "lpt")] and 1 in rows[(ONE_ROW, 4, "locality")]
    assert 1 in rows[(ONE_ROW, 5, "lpt")] and 0 in rows[(ONE_ROW, 5, "lpt")]
    assert 2 in rows[(SMALL_ROWS, 3, "lpt")] and 0 in rows[(SMALL_ROWS, 5, "locality")]
    assert all(0 in rows[(EMPTY, n, "lpt")] for n in (3, 4, 5))


# -- window-aligned SP ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_window_sp_3b_tiny_bitwise_at_every_degree_and_planner(clusters, dtype):
    """RAGGED in fp32 is the 3B reference vectors' test below; here it runs in bf16."""
    extra = [("tiny", RAGGED, "bf16", "lpt"), ("tiny", RAGGED, "bf16", "locality")] if dtype == "bf16" else []
    run_matrix(clusters, ["tiny"], [ONE_ROW, SMALL_ROWS, EMPTY], [dtype], ["lpt", "locality"], extra=extra)


def test_window_sp_7b_tiny_bitwise_at_every_degree_and_planner(clusters):
    run_matrix(clusters, ["tiny-7b"], [ONE_ROW, SMALL_ROWS, EMPTY], ["fp32", "bf16"], ["lpt", "locality"])


def test_window_sp_small_preset_bitwise(clusters):
    specs = {n: [RunSpec("small", ONE_ROW, n, dtype=dt, planner=pl) for dt in ("fp32", "bf16")
                 for pl in ("lpt", "locality")] for n in (2, 4, 5)}
    refs = {(s.model, s.grid, s.dtype): single(s) for s in specs[2]}
    for n, ss in specs.items():
        check_all_equal(clusters(n).run(forward_specs, ss), ss, refs)


@pytest.mark.parametrize("directory", [DATA / "nadit-3b-tiny", DATA / "nadit-7b-tiny"], ids=["3b", "7b"])
def test_reference_vectors_bitwise_at_every_degree(clusters, directory):
    _, model, d = vector_model(directory)
    with torch.no_grad():
        ref = model(d["vid_in"], d["txt_in"], d["timestep"],
                    runtime=single_runtime(model.cfg, model.grid_of(d["vid_in"].shape), deterministic=True))
    for n in DEGREES:
        for planner in ("lpt", "locality"):
            for rank, out in enumerate(clusters(n).run(forward_vectors, str(directory), planner)):
                assert torch.equal(out, ref), f"SP={n} {planner} rank {rank}"


# -- the Ulysses baseline -------------------------------------------------------------------------


def test_ulysses_baseline_bitwise_at_every_degree(clusters):
    """Rows in contiguous shards (2 rows per rank at SP=5 on SMALL_ROWS), heads 3 over up to 5 ranks."""
    run_matrix(clusters, ["tiny"], [ONE_ROW, SMALL_ROWS], ["fp32", "bf16"], ["lpt"], path="ulysses",
               extra=[("tiny", RAGGED, "fp32", "lpt")])


# -- the fixed-shape calls (the premise, on this machine's kernels) ---------------------------------


@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_rows_do_not_depend_on_the_row_count_or_position(threads):
    """A row's bits from linear_rows are the same whichever rows share its call: the premise of the
    fixed-shape tiles, checked on this machine's kernels (rows shifted across tile boundaries too)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    small = KernelShapes(row_tile=24)  # several tiles, tails of every length
    counts = list(range(1, 30)) + [47, 48, 49, 191, 193, 401]
    for k, n, bias in [(96, 288, False), (132, 96, True)]:
        for dtype in (torch.float32, torch.bfloat16):
            tok = TokenLinear(k, n, bias=bias).to(dtype)
            x = torch.randn(600, k).to(dtype)
            for shapes in (small, KernelShapes()):
                with use(shapes):
                    full = tok(x)
                    bad = [(a, m) for a in (0, 7, 23) for m in counts if not torch.equal(tok(x[a:a + m]), full[a:a + m])]
                assert bad == [], (k, n, dtype, shapes.row_tile, bad[:8])
            with use(FAST):  # the fast policy: one plain call (float32 on oneDNN, ditsp.cpu.gemm)
                assert torch.equal(tok(x[:5]), plain_linear(x[:5], tok.weight, tok.bias))


@torch.no_grad()
def test_window_attention_pairs_do_not_depend_on_the_other_windows():
    """segment_attention gives a window the same bits alone, with neighbours, and at any batch position."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for lq, lk in ((5, 9), (40, 51)):
            q, k, v = (torch.randn(7, l, 3, 32).to(dtype) for l in (lq, lk, lk))
            full = segment_attention(q, k, v)
            for a, m in ((0, 1), (3, 1), (2, 4), (1, 6)):
                assert torch.equal(segment_attention(q[a:a + m], k[a:a + m], v[a:a + m]), full[a:a + m]), (dtype, lq, a, m)
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
            assert (full.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_linear_rows_keeps_autograd():
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(7, 6, requires_grad=True)
    linear_rows(x, w, shapes=KernelShapes(row_tile=4)).sum().backward()
    assert torch.allclose(w.grad, x.detach().sum(0).expand(8, 6)) and torch.allclose(x.grad, w.detach().sum(0).expand(7, 6))
    assert torch.allclose(linear_rows(x[:2], w), F.linear(x[:2], w))


def test_fast_policy_is_within_tolerance_of_one_device(clusters):
    """deterministic=False runs plain kernel calls: equal to one device within 1e-5 of the output scale
    (SP=4 on ONE_ROW puts the 1-token window alone on a rank, where plain GEMMs run on 1 row)."""
    for dtype, bound in (("fp32", 1e-5), ("bf16", 3e-2)):
        spec = RunSpec("tiny", ONE_ROW, 4, dtype=dtype)
        ref = single(spec, deterministic=False).float()
        for out in clusters(4).run(forward_specs, [spec], False):
            assert (out[0].float() - ref).abs().max() <= bound * ref.abs().max(), dtype
