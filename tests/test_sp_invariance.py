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
from ditsp.engine import Engine, RunSpec, build_for
from ditsp.models.seedvr2.nadit import NaDiT, load_checkpoint
from ditsp.models.seedvr2.nadit.config import TINY, TINY_7B
from ditsp.models.seedvr2.nadit.tokenwise import ROW_BLOCK, TokenLinear, linear_rows, row_guard
from ditsp.models.seedvr2.parallelize import parallelize
from ditsp.windows.schedule import plan_schedule

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

DATA = Path(__file__).parent / "data"
ONE_ROW, SMALL_ROWS, EMPTY, RAGGED = (1, 21, 21), (5, 1, 2), (2, 4, 7), (5, 20, 36)
DEGREES = (2, 3, 4, 5)




# -- rank functions (module level: they travel to the ranks by name) ----------------------------------


@torch.no_grad()
def forward_specs(ctx, specs, guard=True):
    """Every rank's output of each spec (the ranks' model cache serves specs of one model in a row)."""
    outs = []
    with row_guard(guard):
        for spec in specs:
            engine = Engine.get(spec.model_spec)
            model, vid, txt = build_for(spec)
            rt = engine.runtime(spec.grid, spec.sp, ctx.group, spec.path, spec.planner)
            outs.append(model(vid, txt, 1000.0, runtime=rt))
    return outs


@torch.no_grad()
def forward_vectors(ctx, directory, planner):
    """The shipped reference vector set's model and inputs under window SP."""
    cfg, model, d = vector_model(directory)
    rt = parallelize(cfg, ParallelConfig(ulysses_degree=ctx.world_size, window_planner=planner),
                     model.grid_of(d["vid_in"].shape), ctx.group, planner)
    return model(d["vid_in"], d["txt_in"], d["timestep"], runtime=rt)


def vector_model(directory):
    cfg = TINY_7B if "7b" in Path(directory).name else TINY
    model = NaDiT(cfg).eval()
    load_checkpoint(model, Path(directory) / "weights.safetensors")
    return cfg, model, load_file(Path(directory) / "io.safetensors")


@torch.no_grad()
def single(spec, guard=True):
    with row_guard(guard):
        model, vid, txt = build_for(RunSpec(spec.model, spec.grid, 1, dtype=spec.dtype, seed=spec.seed))
        return model(vid, txt, 1000.0)


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


def test_window_sp_3b_tiny_bitwise_at_every_degree_and_planner(clusters):
    """RAGGED in fp32 is the 3B reference vectors' test below; here it runs in bf16."""
    run_matrix(clusters, ["tiny"], [ONE_ROW, SMALL_ROWS, EMPTY], ["fp32", "bf16"], ["lpt", "locality"],
               extra=[("tiny", RAGGED, "bf16", "lpt"), ("tiny", RAGGED, "bf16", "locality")])


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
        ref = model(d["vid_in"], d["txt_in"], d["timestep"])
    for n in DEGREES:
        for planner in ("lpt", "locality"):
            for rank, out in enumerate(clusters(n).run(forward_vectors, str(directory), planner)):
                assert torch.equal(out, ref), f"SP={n} {planner} rank {rank}"


# -- the Ulysses baseline -------------------------------------------------------------------------


def test_ulysses_baseline_bitwise_at_every_degree(clusters):
    """Rows in contiguous shards (2 rows per rank at SP=5 on SMALL_ROWS), heads 3 over up to 5 ranks."""
    run_matrix(clusters, ["tiny"], [ONE_ROW, SMALL_ROWS], ["fp32", "bf16"], ["lpt"], path="ulysses",
               extra=[("tiny", RAGGED, "fp32", "lpt")])


# -- the row-count guard ----------------------------------------------------------------------------


def _rows_differ(linear, x, counts):
    """Row counts m whose ``linear(x[7:7+m])`` differs from the same rows of one big call."""
    full = linear(x)
    return [m for m in counts if not torch.equal(linear(x[7 : 7 + m]), full[7 : 7 + m])]


@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
def test_token_linear_rows_do_not_depend_on_the_row_count(threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    counts = list(range(1, 25)) + [127, 401]
    for k, n, bias in [(96, 288, False), (132, 96, True)]:
        for dtype in (torch.float32, torch.bfloat16):
            lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
            tok = TokenLinear(k, n, bias=bias).to(dtype)
            tok.load_state_dict(lin.state_dict())
            x = torch.randn(1000, k).to(dtype)
            assert torch.equal(tok(x), lin(x))  # a multiple of 4 rows: one plain call
            assert _rows_differ(tok, x, counts) == [], (k, n, dtype)
            with row_guard(False):
                assert torch.equal(tok(x[:5]), lin(x[:5]))


@torch.no_grad()
def test_without_the_guard_this_blas_gives_small_calls_other_bits():
    """The failure the guard removes exists here: fp32 rows of a 1-3 row call differ in the last bits."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 288)
    bad = _rows_differ(lin, torch.randn(1000, 96), range(1, 2 * ROW_BLOCK + 1))
    if not bad:
        pytest.skip("this BLAS gives every row count the same bits; the guard is not needed here")
    assert set(bad) <= {1, 2, 3}, bad  # one thread: only calls of fewer than 4 rows


def test_linear_rows_keeps_autograd():
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(7, 6, requires_grad=True)
    linear_rows(x, w).sum().backward()
    assert torch.allclose(w.grad, x.detach().sum(0).expand(8, 6)) and torch.allclose(x.grad, w.detach().sum(0).expand(7, 6))
    assert torch.allclose(linear_rows(x[:2], w), F.linear(x[:2], w))


def test_one_row_rank_breaks_bitwise_equality_without_the_guard(clusters):
    """SP=4 on ONE_ROW puts the 1-token window alone on a rank: without the guard its GEMMs run on 1 row."""
    spec = RunSpec("tiny", ONE_ROW, 4)
    ref = single(spec, guard=False)
    unguarded = clusters(4).run(forward_specs, [spec], False)[0][0]
    guarded = clusters(4).run(forward_specs, [spec], True)[0][0]
    if torch.equal(unguarded, ref):
        pytest.skip("this BLAS gives 1-row calls the same bits; nothing to guard here")
    assert torch.equal(guarded, single(spec))
