"""One focused test per reference quirk the port reproduces on purpose (seedvr2-facts §3-4)."""

import math

import pytest
import torch

from ditsp.attention.window import WindowPack, window_attention
from ditsp.models.seedvr2.nadit import TINY, NaDiT
from ditsp.models.seedvr2.nadit.blocks import ATTN, MLP, AdaSingle, WindowMMAttention, emb_slots, rms_norm
from ditsp.models.seedvr2.nadit.model import build_model, random_inputs
from ditsp.models.seedvr2.nadit.rope import MMRope3d
from ditsp.models.seedvr2.parallelize import single_runtime

GRID = (5, 20, 36)


def test_ada_reads_the_stride6_interleaved_embedding_without_implicit_one():
    D = 4
    ada = AdaSingle(D)
    with torch.no_grad():
        for name, p in ada.named_parameters():
            p.zero_()  # scale param 0: the only +1 is the learned one, so x * (0 + emb_scale)
    e = emb_slots(torch.arange(6 * D, dtype=torch.float32))
    c = torch.arange(D, dtype=torch.float32)
    x = torch.full((2, D), 2.0)
    assert torch.equal(ada.mod_in(x, e, ATTN)[0], 2 * (6 * c + 1) + (6 * c + 0))
    assert torch.equal(ada.residual(x, x, e, ATTN)[0], 2 * (6 * c + 2) + 2)
    assert torch.equal(ada.mod_in(x, e, MLP)[0], 2 * (6 * c + 4) + (6 * c + 3))
    assert torch.equal(ada.residual(x, x, e, MLP)[0], 2 * (6 * c + 5) + 2)


def _capture(model, vid, txt):
    """Run a forward; record block inputs, proj_qkv inputs per block and the vid_out.proj input."""
    rec = {"block_in": {}, "block_out": {}, "qkv": {}, "mlp_rows": {}}
    hooks = []
    for i, blk in enumerate(model.blocks):
        hooks.append(blk.register_forward_pre_hook(lambda m, a, i=i: rec["block_in"].__setitem__(i, a[:2])))
        hooks.append(blk.register_forward_hook(lambda m, a, o, i=i: rec["block_out"].__setitem__(i, o)))
        for b, mod in blk.attn.proj_qkv.items():
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, i=i, b=b: rec["qkv"].setdefault(i, []).append((b, a[0]))))
        for b, mod in blk.mlp.items():
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, i=i: rec["mlp_rows"].setdefault(i, []).append(a[0].shape[0])))
    hooks.append(model.vid_out.proj.register_forward_pre_hook(lambda m, a: rec.__setitem__("final", a[0])))
    with torch.no_grad():
        rec["emb"] = model.emb_in(torch.tensor([1000.0]), torch.float32)[0]
        rec["out"] = model(vid, txt, 1000.0, runtime=single_runtime(model.cfg, model.grid_of(vid.shape)))
    for h in hooks:
        h.remove()
    return rec


@pytest.fixture(scope="module")
def run():
    model = build_model(TINY, seed=5)
    vid, txt = random_inputs(TINY, GRID, seed=5)
    return model, _capture(model, vid, txt)


def test_last_block_leaves_text_unmodulated_and_skips_the_text_mlp(run):
    model, rec = run
    last = TINY.num_layers - 1
    e = emb_slots(rec["emb"])
    # block 0: text enters its qkv modulated; last block: plain RMSNorm(text) through the shared `all` qkv
    _, txt0 = rec["block_in"][0]
    txt_qkv0 = next(x for b, x in rec["qkv"][0] if b == "txt")
    expect0 = model.blocks[0].ada["txt"].mod_in(rms_norm(txt0, None, TINY.norm_eps), e, ATTN)
    assert torch.equal(txt_qkv0, expect0)
    _, txt_last = rec["block_in"][last]
    calls = rec["qkv"][last]
    assert [b for b, _ in calls] == ["all", "all"]  # vid rows, then text rows
    assert torch.equal(calls[1][1], rms_norm(txt_last, None, TINY.norm_eps))
    assert rec["mlp_rows"][last] == [math.prod(GRID)]  # the MLP ran on video rows only
    assert rec["block_out"][last][1] is txt_last  # the text path of the last block is not computed


def test_final_modulation_uses_the_block_attn_slot(run):
    model, rec = run
    e = emb_slots(rec["emb"])
    x = rec["block_out"][TINY.num_layers - 1][0]
    y = rms_norm(x, model.vid_out_norm.weight, TINY.norm_eps)
    ada = model.vid_out_ada
    expect = y * (e[:, ATTN, 1] + ada.out_scale) + (e[:, ATTN, 0] + ada.out_shift)
    assert torch.allclose(rec["final"], expect, rtol=0, atol=1e-6)
    mlp_slot = y * (e[:, MLP, 1] + ada.out_scale) + (e[:, MLP, 0] + ada.out_shift)
    assert (rec["final"] - mlp_slot).abs().max() > 1e-2


def naive_window_attention(q, k, v, tq, tk, tv, shapes, rope: MMRope3d):
    """Per window: explicit softmax over [window video, text], one window at a time."""
    outs, txt_outs, start = [], [], 0
    L = tk.shape[0]
    for s in shapes:
        n = math.prod(s)
        qw, kw = (rope.video(t[start:start + n][None], s, L)[0] for t in (q, k))
        Q, K, V = torch.cat([qw, tq]), torch.cat([kw, tk]), torch.cat([v[start:start + n], tv])
        a = torch.softmax(torch.einsum("ihd,jhd->hij", Q, K) / math.sqrt(q.shape[-1]), -1)
        o = torch.einsum("hij,jhd->ihd", a, V)
        outs.append(o[:n]), txt_outs.append(o[n:])
        start += n
    return torch.cat(outs), torch.stack(txt_outs)


@torch.no_grad()
def test_text_output_is_the_unweighted_mean_over_windows():
    from ditsp.sp import WindowRuntime

    torch.manual_seed(0)
    attn = WindowMMAttention(TINY, shared=False)
    for p in attn.parameters():
        p.normal_(0, 0.3)
    rt = WindowRuntime.single((5, 20, 36), ["shifted"])
    shapes = rt.local_window_shapes(0)
    assert len({math.prod(s) for s in shapes}) > 1  # ragged windows
    vid, txt = torch.randn(math.prod((5, 20, 36)), TINY.vid_dim), torch.randn(7, TINY.vid_dim)
    vid = rt.scatter(vid, 0)
    out_v, out_t = attn(vid, txt, WindowPack.build(shapes), rt, 0)
    q, k, v = attn._qkv(vid, "vid")
    tq, tk, tv = attn._qkv(txt, "txt")
    ref_v, per_win = naive_window_attention(q, k, v, attn.rope.text(tq), attn.rope.text(tk), tv, shapes, attn.rope)
    assert torch.allclose(out_v, attn.proj_out["vid"](ref_v.flatten(1)), atol=1e-5)
    plain = attn.proj_out["txt"](per_win.mean(0).flatten(1))
    assert torch.allclose(out_t, plain, atol=1e-5)
    w = torch.tensor([math.prod(s) for s in shapes], dtype=torch.float32)[:, None, None, None]
    weighted = attn.proj_out["txt"](((per_win * w).sum(0) / w.sum()).flatten(1))
    assert (out_t - weighted).abs().max() > 1e-3  # the check can tell the two means apart


WINDOW_SHAPES = [(2, 3, 4), (1, 3, 4), (2, 3, 4), (2, 2, 4)]


def window_case(seed: int):
    """Random video/text q, k, v for WINDOW_SHAPES (3 heads of 32, 5 text tokens), a RoPE and the pack."""
    torch.manual_seed(seed)
    n, H, D, L = sum(math.prod(s) for s in WINDOW_SHAPES), 3, 32, 5
    q, k, v = (torch.randn(n, H, D) for _ in range(3))
    tq, tk, tv = (torch.randn(L, H, D) for _ in range(3))
    rope = MMRope3d(32)
    return WINDOW_SHAPES, (q, k, v, tq, tk, tv), rope, (lambda x, s: rope.video(x, s, L)), WindowPack.build(WINDOW_SHAPES)


@torch.no_grad()
def test_grouped_sdpa_video_only_queries_match():
    """The last block asks for no text queries: the video output must not change."""
    shapes, (q, k, v, tq, tk, tv), rope, fn, pack = window_case(1)
    assert len(pack.groups) == 3  # equal shapes batched together
    out, txt = window_attention(q, k, v, tq, tk, tv, pack, fn, backend="sdpa")
    out2, none = window_attention(q, k, v, None, tk, tv, pack, fn, backend="sdpa")
    ref, per_win = naive_window_attention(q, k, v, tq, tk, tv, shapes, rope)
    assert none is None and torch.allclose(out, out2, atol=1e-6)
    assert txt.dtype == torch.float64  # summed in fp64: the same whatever rank holds which window
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(txt.float(), per_win.sum(0), atol=1e-5)


def naive_rope(x, pos, rope_dim, theta=10000.0):
    """x (D,) at axial position pos=(pt, ph, pw): interleaved-pair rotation, written per channel."""
    d = rope_dim // 3
    f = [1.0 / theta ** (2 * k / d) for k in range(d // 2)]
    out = x.double().clone()
    for axis in range(3):
        for k in range(d // 2):
            c = axis * d + 2 * k
            a = pos[axis] * f[k]
            x0, x1 = x[c].double(), x[c + 1].double()
            out[c], out[c + 1] = x0 * math.cos(a) - x1 * math.sin(a), x1 * math.cos(a) + x0 * math.sin(a)
    return out


@pytest.mark.parametrize("rope_dim,head_dim", [(32, 32), (128, 128)])
def test_rope_window_local_positions_with_text_offset(rope_dim, head_dim):
    torch.manual_seed(2)
    rope, L, shape = MMRope3d(rope_dim), 11, (2, 3, 4)
    x = torch.randn(1, math.prod(shape), 1, head_dim)
    got = rope.video(x, shape, L)[0, :, 0]
    for i, (dt, dh, dw) in enumerate((a, b, c) for a in range(2) for b in range(3) for c in range(4)):
        want = naive_rope(x[0, i, 0], (L + dt, dh, dw), rope_dim)
        assert torch.allclose(got[i].double(), want, atol=2e-5), (dt, dh, dw)
    rot = 3 * (rope_dim // 3)  # 30 of 32, 126 of 128: the rest pass through
    assert torch.equal(got[:, rot:], x[0, :, 0, rot:])
    t = torch.randn(L, 1, head_dim)
    got_t = rope.text(t)[:, 0]
    for j in range(L):
        assert torch.allclose(got_t[j].double(), naive_rope(t[j, 0], (j, j, j), rope_dim), atol=2e-5)


def test_rope_runs_in_fp32_for_bf16_inputs():
    rope = MMRope3d(128)
    x = torch.randn(2, 6, 2, 128).to(torch.bfloat16)
    got = rope.video(x, (1, 2, 3), 58)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, rope.video(x.float(), (1, 2, 3), 58).to(torch.bfloat16))


def test_rope_uses_analytic_fp32_frequencies_after_a_dtype_change():
    model = NaDiT(TINY).to(torch.bfloat16)
    assert model.vid_in.proj.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn.rope.freqs.dtype == torch.float32  # the buffer is never rounded
    assert torch.equal(model.blocks[0].attn.rope.freqs, MMRope3d(32).analytic_freqs())
    x = torch.randn(1, 6, 1, 32)
    assert torch.equal(model.blocks[0].attn.rope.video(x, (1, 2, 3), 11), MMRope3d(32).video(x, (1, 2, 3), 11))


def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
    """flash_attn_varlen_func's contract in plain torch: one attention per cu_seqlens segment."""
    assert not causal and cu_q.dtype == cu_k.dtype == torch.int32
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = []
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1))
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@torch.no_grad()
def test_packed_varlen_path_matches_grouped_sdpa(monkeypatch):
    """The flash-attn packing ([window video, text] segments, cu_seqlens), checked on CPU with a stand-in kernel."""
    import ditsp.attention.window as window

    monkeypatch.setattr(window, "flash_attn_varlen_func", fake_varlen)
    shapes, (q, k, v, tq, tk, tv), rope, fn, pack = window_case(3)
    ref, ref_t = window_attention(q, k, v, tq, tk, tv, pack, fn, backend="sdpa")
    out, txt = window_attention(q, k, v, tq, tk, tv, pack, fn, backend="varlen")
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(txt, ref_t, atol=1e-5)
    out2, none = window_attention(q, k, v, None, tk, tv, pack, fn, backend="varlen")
    assert none is None and torch.allclose(out2, ref, atol=1e-5)
    assert window.backend_for(q) == "sdpa"  # CPU tensors never take the flash path
