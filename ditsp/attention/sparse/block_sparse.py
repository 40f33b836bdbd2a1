"""Block-sparse attention: only the selected (query block, key block) pairs are computed.

Blocked layout (see :mod:`.blocks`): ``q``, ``k``, ``v`` are ``[..., nb, block, D]``,
``mask`` is ``[..., nb, nb]`` bool, ``valid`` ``[nb, block]`` marks real tokens
(pad slots never act as keys; pad query rows give ignored output).

CPU path (pure torch): the query blocks of all heads are flattened into rows
and sorted by how many key blocks they keep, so rows processed together need
about the same work. A step takes ``rows_per_step`` rows and gathers their
selected K/V blocks into dense ``[rows, blocks * block, D]`` tensors
(``index_select`` of whole blocks), then

- ``impl="sdpa"`` (default): one fused SDPA call per step (torch's CPU flash
  kernel: online softmax, fp32 accumulation), a key mask only where a step
  holds pad slots;
- ``impl="online"``: our own online softmax over ``kv_blocks_per_step`` key
  blocks at a time, batched matmuls, fp32 accumulation.

Work is proportional to the selected pairs (plus padding to the step's
longest row), not to ``nb**2``; a full mask gives dense attention.

CUDA path: ``torch.nn.attention.flex_attention`` with a block mask, when
importable. It is guarded and documented here, but it was not run on this
project's CPU-only test machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sorted_selection(mask: torch.Tensor):
    """Per row, selected column ids first (ascending), and the count selected."""
    counts = mask.sum(-1)
    cols = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return cols, counts


def sparse_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kvalid: torch.Tensor, mask: torch.Tensor,
                base: torch.Tensor, scale: float, rows_per_step: int = 64, kv_blocks_per_step: int = 16,
                impl: str = "sdpa") -> torch.Tensor:
    """The core: ``q`` [R, b, D] query blocks; ``k``/``v`` [M, b, D] key blocks, ``kvalid`` [M, b].

    Row r attends key blocks ``base[r] + j`` for every ``j`` with ``mask[r, j]``
    (``mask`` [R, n]). Returns ``[R, b, D]`` in ``q``'s dtype.
    """
    R, b, D = q.shape
    out = torch.empty_like(q)
    if R == 0:
        return out
    M = k.shape[0]
    # A zero block with no valid key stands for "no block" in padded selections.
    kp = torch.cat([k, k.new_zeros(1, b, D)])
    vp = torch.cat([v, v.new_zeros(1, b, D)])
    validp = torch.cat([kvalid, kvalid.new_zeros(1, b)])
    cols, counts = _sorted_selection(mask)
    order = torch.argsort(counts, stable=True)
    f32 = torch.float32
    for s0 in range(0, R, rows_per_step):
        rows = order[s0 : s0 + rows_per_step]
        n = rows.numel()
        S = int(counts[rows].max())
        sel = cols[rows, :S] + base[rows, None]
        sel = torch.where(torch.arange(S, device=sel.device) < counts[rows, None], sel, torch.full_like(sel, M))
        if impl == "sdpa":
            flat = sel.reshape(-1)
            kk = kp.index_select(0, flat).view(n, 1, S * b, D)
            vv = vp.index_select(0, flat).view(n, 1, S * b, D)
            kv_ok = validp.index_select(0, flat)
            am = None if bool(kv_ok.all()) else kv_ok.view(n, 1, 1, S * b)
            o = F.scaled_dot_product_attention(q.index_select(0, rows)[:, None], kk, vv, attn_mask=am, scale=scale)
            out[rows] = o[:, 0]
            continue
        qc = q[rows].to(f32) * scale
        m = torch.full((n, b, 1), float("-inf"), dtype=f32, device=q.device)
        l = torch.zeros((n, b, 1), dtype=f32, device=q.device)
        acc = torch.zeros((n, b, D), dtype=f32, device=q.device)
        for j0 in range(0, S, kv_blocks_per_step):
            ids = sel[:, j0 : j0 + kv_blocks_per_step]
            st = ids.shape[1]
            kk = kp[ids].reshape(n, st * b, D).to(f32)
            vv = vp[ids].reshape(n, st * b, D).to(f32)
            sc = torch.bmm(qc, kk.transpose(1, 2))
            sc.masked_fill_(~validp[ids].reshape(n, 1, st * b), float("-inf"))
            mnew = torch.maximum(m, sc.amax(-1, keepdim=True))
            p = torch.exp(sc - mnew)
            corr = torch.exp(m - mnew)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = torch.baddbmm(acc * corr, p, vv)
            m = mnew
        out[rows] = (acc / l).to(q.dtype)
    return out


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           valid: torch.Tensor, scale: float, rows_per_step: int = 64,
                           kv_blocks_per_step: int = 16, impl: str = "sdpa") -> torch.Tensor:
    """Blocked ``[..., nb, b, D]`` q/k/v, ``mask`` ``[..., nb, nb]``, ``valid`` ``[nb, b]`` -> ``[..., nb, b, D]``."""
    if impl not in ("sdpa", "online"):
        raise ValueError(f"impl must be 'sdpa' or 'online', got {impl!r}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise RuntimeError("block-sparse attention is forward-only (inference); run it under torch.no_grad()")
    lead, (nb, b, D) = q.shape[:-3], q.shape[-3:]
    if q.is_cuda and _flex is not None:  # pragma: no cover - not run on CPU-only machines
        return _flex_attention(q, k, v, mask, valid, scale)
    G = int(torch.tensor(lead).prod()) if lead else 1
    qf, kf, vf = (x.reshape(G * nb, b, D) for x in (q, k, v))
    base = (torch.arange(G, device=q.device) * nb).repeat_interleave(nb)
    o = sparse_rows(qf, kf, vf, valid.repeat(G, 1), mask.reshape(G * nb, nb), base, scale,
                    rows_per_step, kv_blocks_per_step, impl)
    return o.view(q.shape)


try:  # CUDA kernel where one is installed
    from torch.nn.attention.flex_attention import BlockMask, flex_attention as _flex  # noqa: F401
except Exception:  # pragma: no cover
    _flex = None


def _flex_attention(q, k, v, mask, valid, scale):  # pragma: no cover - CUDA only, not run here
    """flex_attention over the blocked layout: its KV block size is our block, pads masked by ``mask_mod``."""
    # local: a heavy optional package, loaded only when this runs
    from torch.nn.attention.flex_attention import create_block_mask

    lead, (nb, b, D) = q.shape[:-3], q.shape[-3:]
    G = int(torch.tensor(lead).prod()) if lead else 1
    qf, kf, vf = (x.reshape(1, G, nb * b, D) for x in (q, k, v))
    m = mask.reshape(G, nb, nb)
    vflat = valid.reshape(-1).to(q.device)

    def mask_mod(bi, h, qi, ki):
        return m[h, qi // b, ki // b] & vflat[ki]

    bm = create_block_mask(mask_mod, 1, G, nb * b, nb * b, device=q.device, BLOCK_SIZE=b)
    o = _flex(qf, kf, vf, block_mask=bm, scale=scale)
    return o.reshape(q.shape)
