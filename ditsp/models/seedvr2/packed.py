"""Packed NaDiT forward: several restoration requests in one SP forward, single-request code untouched.

:func:`packed_forward` runs a 3B NaDiT's own modules (patch embedding, blocks'
sub-modules, head) over the packed rows of several requests, on a
:class:`~ditsp.sp.packed_window.PackedWindowRuntime`. What differs per
request is handled here, not in the model:

- time embedding: one per request; the AdaSingle shift/scale/gate vectors are
  formed per request exactly as the single-request block forms them, then
  picked per row, so every row sees the same values (and the same bits);
- text: each request's text stream is projected, normalised, modulated and
  updated on its own (the same calls on the same rows as alone), attends with
  its request's windows only and is averaged over its own windows;
- RoPE: video RoPE offsets by the request's own text length.

Each request's output is the one it gets alone (bitwise on the CPU path the
single-request window SP is bitwise on). The 7B family is not covered yet.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...distributed.comm import Comm
from ...fixed_shape import DEFAULT_DETERMINISTIC, shapes_for
from ...fixed_shape import use as use_kernel_shapes
from ...sp.packed_window import PackedWindowRuntime
from .nadit.blocks import ATTN, GATE, MLP, SCALE, SHIFT, emb_slots, rms_norm
from .nadit.model import patchify, unpatchify


def _vec(ada, es, slot: int, part: int, name: str) -> torch.Tensor:
    """(requests, D): the learned parameter plus each request's embedding slot, as the block adds them."""
    p = getattr(ada, f"{ada.layers[slot]}_{name}")
    return torch.stack([p + e[:, slot, part] for e in es])


def _mod_in(ada, x, es, slot, rid):
    return (x * _vec(ada, es, slot, SCALE, "scale")[rid]).add_(_vec(ada, es, slot, SHIFT, "shift")[rid])


def _mod_out(ada, x, es, slot, rid):
    return x * _vec(ada, es, slot, GATE, "gate")[rid]


def _attn(attn, vid, txts, rt: PackedWindowRuntime, layer: int, txt_out: bool):
    q, k, v = attn._qkv(vid, "vid")
    tqs, tks, tvs, ropes = [], [], [], []
    for txt in txts:
        tq, tk, tv = attn._qkv(txt, "txt")
        tqs.append(attn.rope.text(tq))
        tks.append(attn.rope.text(tk))
        tvs.append(tv)
        ropes.append(lambda x, shape, L=txt.shape[0]: attn.rope.video(x, shape, L))
    pack = rt.window_pack(layer, vid.device)
    out, tsum = rt.attend(q, k, v, torch.cat(tqs) if txt_out else None, torch.cat(tks), torch.cat(tvs), pack, ropes)
    vid = attn.proj_out.get("vid")(out.flatten(1))
    if not txt_out:
        return vid, None
    tmean = rt.reduce_text(tsum.to(rt.dtype), layer)
    to = rt.text_offsets
    return vid, [attn.proj_out.get("txt")(tmean[to[r]:to[r + 1]].to(t.dtype).flatten(1)) for r, t in enumerate(txts)]


def _block(block, vid, txts, embs, rt: PackedWindowRuntime, layer: int):
    """One 3B ``mmdit_sr`` block over packed rows (mirrors ``NaMMSRBlock.forward``)."""
    es = [emb_slots(e) for e in embs]
    rid = rt.local_request_ids(layer, vid.device)
    ada_v = block.ada.get("vid")
    a = _mod_in(ada_v, rms_norm(vid, None, block.eps), es, ATTN, rid)
    ats = [rms_norm(t, None, block.eps) for t in txts]
    if not block.last:
        ats = [block.ada.get("txt").mod_in(at, e, ATTN) for at, e in zip(ats, es)]
    a, ats = _attn(block.attn, a, ats, rt, layer, txt_out=not block.last)
    vid = _mod_out(ada_v, a, es, ATTN, rid).add_(vid)
    m = _mod_in(ada_v, rms_norm(vid, None, block.eps), es, MLP, rid)
    vid = _mod_out(ada_v, block.mlp.get("vid")(m), es, MLP, rid).add_(vid)
    if block.last:
        return vid, txts
    ada_t, out = block.ada.get("txt"), []
    for txt, at, e in zip(txts, ats, es):
        txt = ada_t.residual(txt, at, e, ATTN)
        m = ada_t.mod_in(rms_norm(txt, None, block.eps), e, MLP)
        out.append(ada_t.residual(txt, block.mlp.get("txt")(m), e, MLP))
    return vid, out


def packed_runtime(model, grids: Sequence[Sequence[int]], text_lens: Sequence[int], comm: Comm | None = None,
                   planner: str = "lpt", deterministic: bool = DEFAULT_DETERMINISTIC) -> PackedWindowRuntime:
    """The packed runtime for ``model``'s schedule on ``comm`` (None: one rank); ``deterministic``: fixed-shape
    kernel calls, so each output equals the request's one-device forward bit for bit."""
    cfg = model.cfg
    rt = PackedWindowRuntime(grids, cfg.window_methods, comm or Comm.single(), text_lens, planner,
                             cfg.num_windows, torch.float64)
    rt.kernel_shapes = shapes_for(deterministic)
    return rt


@torch.no_grad()
def packed_forward(model, requests: Sequence[tuple[torch.Tensor, torch.Tensor, object]],
                   runtime: PackedWindowRuntime | None = None, planner: str = "lpt",
                   deterministic: bool = DEFAULT_DETERMINISTIC) -> list[torch.Tensor]:
    """``requests``: (vid latent (T,H,W,33), txt (L, txt_in_dim), timestep) each -> one v (T,H,W,16) each.

    Every rank of the runtime's group passes the same requests and gets every output.
    """
    cfg, dtype = model.cfg, model.dtype
    if cfg.variant != "3b":
        raise NotImplementedError(f"packed forward covers the 3B family; {cfg.name} is {cfg.variant}")
    grids = [model.grid_of(vid.shape) for vid, _, _ in requests]
    rt = runtime or packed_runtime(model, grids, [t.shape[0] for _, t, _ in requests], None, planner, deterministic)
    if [tuple(g) for g in rt.grids] != [tuple(g) for g in grids] or tuple(rt.layer_methods) != tuple(cfg.window_methods):
        raise ValueError(f"runtime planned {rt.grids}; the requests have grids {grids}")
    if list(rt.text_lens) != [t.shape[0] for _, t, _ in requests]:
        raise ValueError(f"runtime planned text lengths {rt.text_lens}")
    with use_kernel_shapes(rt.kernel_shapes):
        return _packed_forward(model, requests, rt, grids)


def _packed_forward(model, requests, rt: PackedWindowRuntime, grids) -> list[torch.Tensor]:
    cfg, dtype = model.cfg, model.dtype
    embs, rows, txts = [], [], []
    for vid, txt, timestep in requests:
        t = torch.as_tensor(timestep, dtype=torch.float32, device=vid.device).reshape(-1)[:1]
        embs.append(model.emb_in(t, dtype)[0])
        rows.append(patchify(vid.to(dtype), cfg.patch_size))
        txts.append(model.txt_in(txt.to(dtype)))
    x = model.vid_in.proj(rt.scatter(torch.cat(rows), 0))
    for i, block in enumerate(model.blocks):
        x = rt.enter_layer(x, i)
        x, txts = _block(block, x, txts, embs, rt, i)
    rid = rt.local_request_ids(None, x.device)
    es = [emb_slots(e) for e in embs]
    y = rms_norm(x, model.vid_out_norm.weight, cfg.norm_eps)
    ada = model.vid_out_ada
    scale = torch.stack([e[:, ATTN, SCALE] + ada.out_scale for e in es])[rid]
    shift = torch.stack([e[:, ATTN, SHIFT] + ada.out_shift for e in es])[rid]
    y = model.vid_out.proj(y * scale + shift)
    return [unpatchify(p, g, cfg.patch_size) for p, g in zip(rt.split(rt.gather(y)), grids)]
