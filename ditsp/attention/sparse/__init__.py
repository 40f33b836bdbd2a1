"""Adaptive block-sparse attention for video DiTs under Ulysses, with runtime head-migration load balancing.

One idea per file: :mod:`.config` (the knobs), :mod:`.blocks` (video-aware
cube blocks), :mod:`.routing` (Top-p + Top-k floor masks, slack filling),
:mod:`.block_sparse` (the kernel), :mod:`.balance` (migration plan, slack),
:mod:`.ulysses_sparse` (the SP strategy). Forward only.
"""

from .balance import MigrationPlan, Move, imbalance, plan_migrations
from .block_sparse import block_sparse_attention
from .blocks import BlockLayout, block_layout
from .config import SparseConfig
from .routing import Routing, augment, route, top_p_mask
from .ulysses_sparse import SparseUlysses

__all__ = ["SparseConfig", "BlockLayout", "block_layout", "Routing", "route", "top_p_mask", "augment",
           "block_sparse_attention", "Move", "MigrationPlan", "plan_migrations", "imbalance", "SparseUlysses"]
