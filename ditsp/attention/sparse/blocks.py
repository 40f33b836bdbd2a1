"""Video-aware block organisation: a cached permutation that makes every block a (t, h, w) cube.

Attention of a video DiT is local in space and time, so a block of
consecutive canonical tokens (a thin strip of one row) is a poor unit: its
tokens have different neighbours. Here the per-head sequence ``[text; video]``
(video in canonical order ``(t*H + h)*W + w``) is cut into

- text blocks: the text tokens, ``block`` at a time (the last one partial);
- video blocks: one per cube of ``cube = (ct, ch, cw)`` grid cells, tokens in
  row-major order inside the cube. Cubes at the grid's edge are partial.

Every block is stored padded to ``block`` slots; a pad slot points at a zero
row and is masked out as a key. ``counts[i]`` (the valid tokens of block i)
weights block i in routing and in the cost model. The layout depends only on
(grid, cube, text length) and is cached.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class BlockLayout:
    grid: tuple[int, int, int]
    cube: tuple[int, int, int]
    text_len: int
    block: int
    idx: torch.Tensor  # [nb, block] token index in [text; video] per slot, ``tokens`` for a pad
    counts: torch.Tensor  # [nb] valid tokens per block (int64)
    is_text: torch.Tensor  # [nb] bool
    pos: torch.Tensor  # [tokens] flat slot (block * block_size + slot) of every token

    @property
    def tokens(self) -> int:
        return self.text_len + math.prod(self.grid)

    @property
    def nblocks(self) -> int:
        return int(self.idx.shape[0])

    @property
    def text_blocks(self) -> int:
        return int(self.is_text.sum())

    @property
    def valid(self) -> torch.Tensor:
        """[nb, block] bool: real tokens (False for pad slots)."""
        return self.idx < self.tokens

    def pair_costs(self) -> torch.Tensor:
        """[nb, nb] token pairs of every (query block, key block) pair: the cost model's unit."""
        c = self.counts.to(torch.float64)
        return c[:, None] * c[None, :]

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., tokens, D]`` -> ``[..., nb, block, D]`` (pads are zeros)."""
        if x.shape[-2] != self.tokens:
            raise ValueError(f"layout of {self.tokens} tokens got {x.shape[-2]}")
        xp = torch.cat([x, x.new_zeros(x.shape[:-2] + (1, x.shape[-1]))], -2)
        out = xp.index_select(-2, self.idx.reshape(-1))
        return out.view(x.shape[:-2] + (self.nblocks, self.block, x.shape[-1]))

    def from_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_blocks` (pad slots dropped)."""
        flat = xb.reshape(xb.shape[:-3] + (self.nblocks * self.block, xb.shape[-1]))
        return flat.index_select(-2, self.pos)


def block_layout(grid, cube, text_len: int = 0) -> BlockLayout:
    """The (cached) layout of a ``grid = (T, H, W)`` video plus ``text_len`` text tokens."""
    return _layout(tuple(int(g) for g in grid), tuple(int(c) for c in cube), int(text_len))


@functools.lru_cache(maxsize=64)
def _layout(grid, cube, text_len) -> BlockLayout:
    T, H, W = grid
    ct, ch, cw = cube
    if min(grid) < 1:
        raise ValueError(f"grid must be positive, got {grid}")
    b = ct * ch * cw
    nt, nh, nw = -(-T // ct), -(-H // ch), -(-W // cw)
    n_text = -(-text_len // b)
    nb = n_text + nt * nh * nw
    tokens = text_len + T * H * W
    idx = np.full((nb, b), tokens, dtype=np.int64)
    tt = np.arange(text_len)
    idx.reshape(-1)[: text_len] = tt  # text blocks are filled front to back
    t, h, w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    t, h, w = t.reshape(-1), h.reshape(-1), w.reshape(-1)
    canon = (t * H + h) * W + w
    cube_id = n_text + ((t // ct) * nh + h // ch) * nw + w // cw
    slot = ((t % ct) * ch + h % ch) * cw + w % cw
    idx[cube_id, slot] = text_len + canon
    # Partial edge cubes: pack their valid tokens to the front (keeps the order inside the cube).
    order = np.argsort(idx == tokens, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    counts = (idx < tokens).sum(1)
    flat = idx.reshape(-1)
    pos = np.empty(tokens, dtype=np.int64)
    keep = flat < tokens
    pos[flat[keep]] = np.nonzero(keep)[0]
    is_text = np.zeros(nb, dtype=bool)
    is_text[:n_text] = True
    return BlockLayout(grid, cube, text_len, b, torch.from_numpy(idx), torch.from_numpy(counts),
                       torch.from_numpy(is_text), torch.from_numpy(pos))
