"""Locality-aware window planner (``planner="locality"``).

LPT balances each layout on its own and ignores where tokens are, so at a
regular <-> shifted change almost every token changes rank. This planner
assigns the windows of all layouts of a schedule *together*, as one balanced
graph partition:

* vertices are the windows of every layout, each weighted by its token count
  in its own layout (one balance constraint per layout);
* an edge joins two windows of different layouts and weighs the tokens they
  share. A token changes rank at a transition exactly when the two windows
  holding it sit on different ranks, so the edge cut *is* the number of tokens
  moved per transition.

The partition is built deterministically:

1. **Starts.** (a) Recursive coordinate bisection of the first layout's windows:
   at each node the windows are ordered along an axis (ties by the two other
   axes, ascending or descending, so a partial slab becomes a staircase) and
   cut at the prefix nearest the rank split's token share; of all orders and
   the prefixes within a small slack, the cut splitting the fewest tokens of
   the other layouts wins. (b) Angular sectors around the (h, w) centre at
   8 rotations: every sector runs through all of t and touches the border, so
   ranks get similar boundary lengths and a low per-rank peak. Cutting t is
   avoided because the shifted layout moves the temporal cuts by half a window
   too, and a diagonal (staircase) boundary costs no more than its longer leg.
2. The windows of the other layouts go to the rank holding most of their
   tokens; a **balance repair** moves the cheapest windows off any rank above
   its cap (falling back to an affinity-aware LPT, then to a pure packing).
3. **Multi-constraint k-way Fiduccia-Mattheyses** (moves with hill climbing
   and rollback, never breaking a cap; first under caps relaxed by 6% and 3%
   of a share, then the real ones) minimises the tokens moved; a greedy pass
   then lowers the largest per-rank send+receive without raising the total.
4. The best start by (largest per-rank send+recv, tokens moved) gets a short
   iterated local search (fixed-seed LCG perturbations of boundary windows,
   re-refined, improvements kept).

Balance is a hard cap per layout: ``max/mean <= 1.03``, or, where no
assignment reaches 1.03 (more ranks than windows, coarse windows such as
720p at SP=6), the balance of a packing search (LPT plus moves and swaps),
which is never worse than LPT. Pure numpy/Python integer arithmetic: the same
request always gets the same plan, on every rank.

The steps live one per module: ``graph`` (problem and state), ``starts``,
``balance``, ``refine``, ``search`` (the entry point :func:`locality_assign`);
``params`` holds the tuning constants.
"""

from .graph import Graph, overlap_pairs
from .balance import layout_caps
from .params import MAX_IMBALANCE, VERSION
from .search import locality_assign

__all__ = ["locality_assign", "overlap_pairs", "layout_caps", "Graph", "MAX_IMBALANCE", "VERSION"]
