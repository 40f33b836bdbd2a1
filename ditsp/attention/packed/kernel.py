"""Per-document block attention with a real log-sum-exp, THD layout, fp32 compute.

One block is the queries of one document segment against the keys of one
(other or same) segment of the *same* document, with positions inside the
document so a causal mask is exact wherever the two segments sit. Partial
results over several key blocks merge exactly by LSE (:func:`merge`); the
backward is the flash-attention one (final output and LSE saved, every block's
gradients independent), so K/V blocks can be re-fetched in backward.

Layouts: ``q`` [Sq, H, D], ``k``/``v`` [Sk, Hkv, D] with ``H % Hkv == 0``
(query heads grouped contiguously onto their K/V head).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[S, Hkv, D] -> [H, S, D] fp32 (each K/V head repeated for its query group)."""
    hk = x.shape[1]
    if heads % max(hk, 1):
        raise ValueError(f"{heads} query heads do not group onto {hk} K/V heads")
    x = x.float().transpose(0, 1)
    return x if hk == heads else x.repeat_interleave(heads // hk, dim=0)


def _mask(q_pos: int, sq: int, k_pos: int, sk: int, causal: bool, device) -> torch.Tensor | None:
    """True where the key is hidden (causal: key position after query position); None if nothing is."""
    if not causal or k_pos + sk - 1 <= q_pos:
        return None
    qp = torch.arange(q_pos, q_pos + sq, device=device)
    kp = torch.arange(k_pos, k_pos + sk, device=device)
    return kp[None, :] > qp[:, None]


def block_visible(q_pos: int, sq: int, k_pos: int, sk: int, causal: bool) -> bool:
    """Whether any query of the block sees any key (False: skip transfer and compute)."""
    return sq > 0 and sk > 0 and (not causal or k_pos <= q_pos + sq - 1)


def block_fwd(q, k, v, scale: float, q_pos: int = 0, k_pos: int = 0, causal: bool = False):
    """fp32 ``(out [Sq,H,Dv], lse [Sq,H])``; rows that see no key get out 0, lse -inf."""
    h = q.shape[1]
    qf = q.float().transpose(0, 1)
    s = torch.matmul(qf, _expand_kv(k, h).transpose(-1, -2)) * scale
    m = _mask(q_pos, q.shape[0], k_pos, k.shape[0], causal, q.device)
    if m is not None:
        s = s.masked_fill(m, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    out = torch.matmul(p, _expand_kv(v, h))
    return out.transpose(0, 1), lse.transpose(0, 1)


def block_bwd(q, k, v, lse, delta, dout, scale: float, q_pos: int = 0, k_pos: int = 0, causal: bool = False):
    """fp32 ``(dq, dk, dv)`` of one block given the *final* ``lse`` [Sq,H] and ``delta = rowsum(dout*out)``."""
    h, hk = q.shape[1], k.shape[1]
    qf = q.float().transpose(0, 1)
    kf, vf = _expand_kv(k, h), _expand_kv(v, h)
    do = dout.float().transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    m = _mask(q_pos, q.shape[0], k_pos, k.shape[0], causal, q.device)
    lse_t = lse.float().transpose(0, 1)
    safe = torch.where(torch.isinf(lse_t), torch.zeros_like(lse_t), lse_t)
    p = torch.exp(s - safe.unsqueeze(-1))
    if m is not None:
        p = p.masked_fill(m, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - delta.float().transpose(0, 1).unsqueeze(-1)) * scale
    dq = torch.matmul(ds, kf)
    dk = torch.matmul(ds.transpose(-1, -2), qf)
    if hk != h:
        g = h // hk
        dk = dk.view(hk, g, *dk.shape[1:]).sum(1)
        dv = dv.view(hk, g, *dv.shape[1:]).sum(1)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def merge(out, lse, blk_out, blk_lse):
    """Fold one block's ``(out, lse)`` into a running fp32 pair (rows with -inf LSE are safe)."""
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(blk_lse - safe).unsqueeze(-1)
    return out * a + blk_out * b, new
