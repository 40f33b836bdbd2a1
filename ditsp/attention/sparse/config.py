"""The knobs of adaptive block-sparse attention, in one object every SP rank must share.

Routing (per head, per row of query blocks):

- ``cube``: the (t, h, w) extent of one video block; a block holds ``t*h*w``
  tokens (edge cubes hold fewer and are weighted by their valid count).
- ``top_p``: keep the highest-probability key blocks of a row until the kept
  mass reaches ``top_p`` (the block that crosses it is kept).
- ``k_min``: the Top-k floor, at least this many key blocks per row.
- ``keep_diagonal``: a query block always sees its own block.
- ``keep_text``: text key blocks are sinks every row keeps, and text query
  rows attend every block (text is short; its rows stay dense).

Runtime, under Ulysses:

- ``balance``: migrate work from the critical rank to the lightest one.
- ``max_moves``: at most this many migrations per layer.
- ``split_heads``: a migration may take a contiguous range of a head's query
  rows instead of the whole head (finer grain, needed when a rank holds few heads).
- ``min_gain``: a move is made only when it shortens the pair's longer path by
  more than this fraction of the mean rank load (tiny moves cost more P2P than they save).
- ``slack``: ranks below the critical path add their next-best blocks up to it.

Kernel (CPU): ``impl`` ``"sdpa"`` (gathered K/V, fused SDPA per step) or
``"online"`` (our own online softmax); ``rows_per_step`` query blocks and
``kv_blocks_per_step`` key blocks are processed at once (memory bound of a step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SparseConfig:
    cube: tuple[int, int, int] = (4, 4, 4)
    top_p: float = 0.9
    k_min: int = 4
    keep_diagonal: bool = True
    keep_text: bool = True
    balance: bool = True
    max_moves: int = 8
    split_heads: bool = True
    min_gain: float = 0.005
    slack: bool = True
    rows_per_step: int = 32
    kv_blocks_per_step: int = 16
    impl: str = "sdpa"

    def __post_init__(self):
        cube = tuple(int(c) for c in self.cube)
        if len(cube) != 3 or min(cube) < 1:
            raise ValueError(f"cube must be three positive extents (t, h, w), got {self.cube!r}")
        object.__setattr__(self, "cube", cube)
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.k_min) < 0:
            raise ValueError(f"k_min must be >= 0, got {self.k_min}")
        if int(self.max_moves) < 0:
            raise ValueError(f"max_moves must be >= 0, got {self.max_moves}")
        if float(self.min_gain) < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.impl not in ("sdpa", "online"):
            raise ValueError(f"impl must be 'sdpa' or 'online', got {self.impl!r}")
        if int(self.rows_per_step) < 1 or int(self.kv_blocks_per_step) < 1:
            raise ValueError("rows_per_step and kv_blocks_per_step must be >= 1")

    @property
    def block(self) -> int:
        """Tokens per (full) block."""
        t, h, w = self.cube
        return t * h * w

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cube"] = list(self.cube)
        return d
