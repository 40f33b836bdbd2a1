"""SP runtimes: what a model talks to when its tokens are split across ranks.

Every runtime implements :class:`~ditsp.sp.protocol.SPRuntime`. Implementations
sit side by side, one per file:

- :mod:`ditsp.sp.window_aligned`: window-aligned SP ("Plan A": whole windows
  per rank, all heads on every rank, the full activation re-sharded at each
  window-layout change);
- :mod:`ditsp.sp.ulysses_window`: the baseline that keeps tokens in contiguous
  shards and moves heads with all-to-alls around window attention.
"""

from .protocol import SPRuntime, check_request
from .ulysses_window import UlyssesWindowRuntime
from .window_aligned import WindowRuntime

__all__ = ["SPRuntime", "check_request", "UlyssesWindowRuntime", "WindowRuntime"]
