"""NaDiT structure (3B on meta), single device vs window SP (fp32, bf16), run configuration."""


import pytest
import torch

from ditsp.config import ParallelConfig, ParallelConfigError
from ditsp.models.seedvr2.nadit import SEEDVR2_3B, TINY, NaDiT, x0_from_v
from ditsp.models.seedvr2.parallelize import parallelize, single_runtime
from ditsp.models.seedvr2.nadit.model import build_model, patchify, random_inputs, unpatchify
from ditsp.windows.geometry import window_layout

GRID = (5, 20, 36)  # 12 regular + 12 shifted windows, ragged
BF16_TOL = 1e-2  # bf16 SP vs bf16 single device, x max|out|: text sums are fp32, so measured 0; one bf16 rounding flip is ~4e-3


# ------------------------------------------------------------------ structure


def expected_3b_shapes(cfg=SEEDVR2_3B) -> dict:
    """State-dict names and shapes, written out from seedvr2-facts §5 (port RoPE name)."""
    D, inner, hd, hid = cfg.vid_dim, cfg.heads * cfg.head_dim, cfg.head_dim, cfg.mlp_hidden
    s = {
        "vid_in.proj.weight": (D, 132), "vid_in.proj.bias": (D,), "txt_in.weight": (D, 5120), "txt_in.bias": (D,),
        "emb_in.proj_in.weight": (D, 256), "emb_in.proj_in.bias": (D,), "emb_in.proj_hid.weight": (D, D),
        "emb_in.proj_hid.bias": (D,), "emb_in.proj_out.weight": (6 * D, D), "emb_in.proj_out.bias": (6 * D,),
        "vid_out.proj.weight": (64, D), "vid_out.proj.bias": (64,), "vid_out_norm.weight": (D,),
        "vid_out_ada.out_shift": (D,), "vid_out_ada.out_scale": (D,),
    }
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        s[p + "attn.rope.freqs"] = (cfg.rope_dim // 3 // 2,)
        for b in (["vid", "txt"] if i < cfg.mm_layers else ["all"]):
            s.update({
                f"{p}attn.proj_qkv.{b}.weight": (3 * inner, D), f"{p}attn.proj_out.{b}.weight": (D, inner),
                f"{p}attn.proj_out.{b}.bias": (D,), f"{p}attn.norm_q.{b}.weight": (hd,),
                f"{p}attn.norm_k.{b}.weight": (hd,), f"{p}mlp.{b}.proj_in_gate.weight": (hid, D),
                f"{p}mlp.{b}.proj_in.weight": (hid, D), f"{p}mlp.{b}.proj_out.weight": (D, hid),
            })
            s.update({f"{p}ada.{b}.{l}_{g}": (D,) for l in ("attn", "mlp") for g in ("shift", "scale", "gate")})
    return s


def test_seedvr2_3b_on_meta_has_the_reference_state_dict():
    with torch.device("meta"):
        model = NaDiT(SEEDVR2_3B)
    sd = model.state_dict()
    assert len(sd) == 635
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_3b_shapes()
    assert sum(p.numel() for p in model.parameters()) == 3_391_475_776
    assert SEEDVR2_3B.mlp_hidden == 6912 and SEEDVR2_3B.emb_dim == 15360


def test_tiny_matches_the_vectors_structure():
    assert {k: tuple(v.shape) for k, v in NaDiT(TINY).state_dict().items()} == expected_3b_shapes(TINY)


def test_truncated_config_last_block_is_vid_only():
    cfg = TINY.with_layers(2)  # mm_layers 2: the last block keeps separate weights, without a text ada/mlp
    keys = NaDiT(cfg).state_dict()
    assert "blocks.1.ada.vid.attn_shift" in keys and "blocks.1.attn.proj_qkv.txt.weight" in keys
    assert not any(k.startswith(("blocks.1.ada.txt.", "blocks.1.mlp.txt.")) for k in keys)


def test_patchify_order_and_round_trip():
    vid = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).view(2, 4, 6, 3)
    rows = patchify(vid, (1, 2, 2))
    assert rows.shape == (2 * 2 * 3, 12)
    # token (0, 0, 1) holds pixels (dy, dx) in {0,1} x {2,3}, channels fastest
    assert rows[1].tolist() == vid[0, 0:2, 2:4].reshape(-1).tolist()
    assert torch.equal(unpatchify(rows, (2, 2, 3), (1, 2, 2)), vid)


def test_x0_from_v():
    noise, v = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(x0_from_v(noise, v), noise - v)


# ------------------------------------------------------------------ runtime configuration


def test_build_runtime_validates_for_seedvr2():
    rt = parallelize(TINY, ParallelConfig(window_path="window"), GRID)
    assert rt.world_size == 1 and rt.report(heads=TINY.heads) == (
        "window-aligned Plan A, planner lpt, SP=1, 3 heads on every rank")
    for bad in (dict(ring_degree=2), dict(use_allgather=True), dict(advanced_uaa=True),
                dict(ulysses_a2a_stacked=True)):
        with pytest.raises(ParallelConfigError, match="window"):
            parallelize(TINY, ParallelConfig(**bad), GRID)
    with pytest.raises(ParallelConfigError, match="needs an SP group of 2"):
        parallelize(TINY, ParallelConfig(ulysses_degree=2), GRID)


def test_forward_rejects_a_runtime_for_another_grid():
    model = build_model(TINY)
    vid, txt = random_inputs(TINY, GRID)
    with pytest.raises(ValueError, match="runtime planned grid"):
        model(vid, txt, 1000.0, runtime=parallelize(TINY, None, (5, 20, 38)))


def test_forward_needs_a_runtime_built_outside_the_model():
    """The model never builds its own runtime: a forward without one names the function that builds it."""
    model = build_model(TINY)
    vid, txt = random_inputs(TINY, GRID)
    assert not hasattr(model, "single_runtime")
    with pytest.raises(TypeError, match="parallelize.single_runtime"):
        model(vid, txt, 1000.0)


# ------------------------------------------------------------------ single device vs window SP


@torch.no_grad()
def sp_vs_single(ctx, grid, dtype_name, seed=3):
    dtype = getattr(torch, dtype_name)
    model = build_model(TINY, seed=seed, dtype=dtype)
    vid, txt = random_inputs(TINY, grid, seed=seed)
    single = model(vid, txt, 1000.0, runtime=single_runtime(TINY, grid))
    rt = parallelize(TINY, ParallelConfig.window(ctx.world_size, window_path="window"), grid, ctx.group)
    out = model(vid, txt, 1000.0, runtime=rt)
    return ((out.float() - single.float()).abs().max() / single.float().abs().max()).item(), \
        rt.plan(0).rank_windows[ctx.rank]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_window_sp_matches_single_device_fp32(clusters, world):
    errs = [e for e, _ in clusters(world).run(sp_vs_single, GRID, "float32")]
    assert max(errs) <= 1e-5, errs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grid,world", [((1, 8, 8), 3), ((2, 8, 8), 4)])
def test_more_ranks_than_windows(clusters, grid, world):
    assert len(window_layout(grid, "regular")) < world
    results = clusters(world).run(sp_vs_single, grid, "float32")
    assert any(not ws for _, ws in results), "some rank holds no window"
    assert max(e for e, _ in results) <= 1e-5


@pytest.mark.timeout(120)
def test_window_sp_matches_single_device_bf16(clusters):
    errs = [e for e, _ in clusters(3).run(sp_vs_single, GRID, "bfloat16")]
    assert max(errs) <= BF16_TOL, errs


@torch.no_grad()
def test_bf16_stays_close_to_fp32():
    vid, txt = random_inputs(TINY, GRID, seed=3)
    one = single_runtime(TINY, GRID)
    ref = build_model(TINY, seed=3)(vid, txt, 1000.0, runtime=one)
    out = build_model(TINY, seed=3, dtype=torch.bfloat16)(vid, txt, 1000.0, runtime=one)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() <= 3e-2  # measured 9e-3
