"""ParallelConfig: one SP configuration shared by every model family.

``ulysses_degree * ring_degree`` ranks form an SP group; inside it, Ulysses
sub-groups are contiguous ranks and Ring sub-groups stride across them (the
USP 2D mesh). SeedVR2 (window attention) takes only the SP degree
(``ParallelConfig.window(sp_degree)``, stored in the vllm-omni-compatible
``ulysses_degree`` field) and runs window-aligned SP on the whole SP group
instead of head-sharded Ulysses.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fixed_shape import DEFAULT_DETERMINISTIC

WINDOW_FAMILIES = {"seedvr2", "nadit"}


class ParallelConfigError(ValueError):
    """An SP configuration that cannot run on this model or world."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to parallelise one request.

    - ``ulysses_degree``: ranks that shard heads (global attention) or, for
      SeedVR2, the window-aligned SP degree.
    - ``ring_degree``: ranks that pass K/V blocks around a ring (global only).
    - ``use_allgather``: AllGather-KV instead of the ring on the outer axis.
    - ``advanced_uaa``: uneven Ulysses all-to-all, i.e. head counts that do not
      divide by ``ulysses_degree`` (uneven head shards). Off is the strict mode.
    - ``ulysses_a2a_stacked``: Ulysses transport variant: Q, K and V travel in one
      stacked all-to-all (1 call) instead of one each (3 calls, the default: a send
      stage of one tensor at a time, the lower peak); same results, same bytes
      (see ditsp.attention.ulysses).
    - ``window_planner``: the window planner of window-aligned SP (Plan A); ``None``: ``lpt``, or under
      ``window_path="auto"`` whichever planner the cost model picks. A named planner under ``auto``
      means Plan A with it.
    - ``window_path``: the SP runtime of a window model: ``window`` (Plan A,
      planner above), ``halo`` (Plan B), ``ulysses`` (baseline) or ``auto``
      (the cheapest by :mod:`ditsp.sp.choice`'s cost model, agreed by every rank).
    - ``a2a_policy``: the transport policy of every all-to-all (Ulysses codec, window and halo
      exchanges, handoffs; :mod:`ditsp.distributed.transport`): ``off`` (one all-to-all), ``chunked``
      (staging bounded by the capacity) or ``auto``; ``None`` reads ``DITSP_A2A_POLICY`` (default ``auto``).
    - ``a2a_long_training``: ``auto`` keeps grad-tracked operands above the
      per-plane threshold on the original transport; ``chunked`` opts them in; ``None``
      reads ``DITSP_A2A_LONG_TRAINING`` (default ``auto``).
    - ``a2a_capacity_bytes``: per-rank transport staging capacity; ``None`` reads
      ``DITSP_A2A_CAPACITY_BYTES`` (default 1 GiB).
    - ``a2a_agree``: when the ranks agree on an all-to-all's plan: ``key`` once per caller key (cached),
      ``every`` before every call (a check that costs one small all-gather per call); ``None`` reads
      ``DITSP_A2A_AGREE`` (default ``key``).

    The ``a2a_*`` fields were ``ulysses_a2a`` / ``ulysses_a2a_long_training`` (environment
    ``DITSP_ULYSSES_A2A*``) before they named the policy of every all-to-all; the vllm-omni-compatible
    fields are ``ulysses_degree``, ``ring_degree``, ``use_allgather``, ``advanced_uaa`` and the Ulysses
    codec's own ``ulysses_a2a_stacked`` (Q/K/V in one all-to-all), which keep their names.
    - ``deterministic``: every kernel call on the SP path gets a shape that does not
      depend on the SP degree or the plan (:mod:`ditsp.fixed_shape`), so the output
      equals one device's bit for bit on any CPU; ``False`` (the default,
      :data:`ditsp.fixed_shape.DEFAULT_DETERMINISTIC`) runs plain calls, equal within
      tolerance and faster (docs/determinism.md has the measured cost).
    - ``cfg_degree``: classifier-free guidance parallel (1 or 2): the conditional and unconditional
      passes on two groups of ``sp_degree`` ranks each (``ditsp.integrations.diffusers.cfg``).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    use_allgather: bool = False
    advanced_uaa: bool = False
    ulysses_a2a_stacked: bool = False
    window_planner: str | None = None
    window_path: str = "auto"
    a2a_policy: str | None = None
    a2a_long_training: str | None = None
    a2a_capacity_bytes: int | None = None
    a2a_agree: str | None = None
    deterministic: bool = DEFAULT_DETERMINISTIC
    cfg_degree: int = 1

    def __post_init__(self):
        if self.cfg_degree not in (1, 2) or isinstance(self.cfg_degree, bool):
            raise ParallelConfigError(f"cfg_degree must be 1 or 2, got {self.cfg_degree!r}")
        for name in ("ulysses_degree", "ring_degree"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {v!r}")
        for name, valid in (("a2a_policy", ("off", "auto", "chunked")),
                            ("a2a_long_training", ("auto", "chunked")), ("a2a_agree", ("key", "every"))):
            v = getattr(self, name)
            if v is not None and v not in valid:
                raise ParallelConfigError(f"{name} must be one of {', '.join(valid)} (or None), got {v!r}")
        if not isinstance(self.deterministic, bool):
            raise ParallelConfigError(f"deterministic must be True or False, got {self.deterministic!r}")
        v = self.a2a_capacity_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ParallelConfigError(f"a2a_capacity_bytes must be a positive integer (or None), got {v!r}")

    @property
    def sp_degree(self) -> int:
        """Ranks that share one request: the window-aligned SP degree of a window model, ulysses x ring else."""
        return self.ulysses_degree * self.ring_degree

    @classmethod
    def window(cls, sp_degree: int, **kw) -> "ParallelConfig":
        """The config of window-aligned SP on ``sp_degree`` ranks. The one place the window degree maps onto
        the field the vllm-omni-compatible config names ``ulysses_degree`` (ditsp code says ``sp_degree``)."""
        return cls(ulysses_degree=sp_degree, **kw)

    def validate(self, family: str, world_size: int, heads: int | None = None) -> None:
        """Raise :class:`ParallelConfigError` with the valid choices, or return."""
        if world_size % self.sp_degree:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ParallelConfigError(
                f"SP degree {self.sp_degree} (ulysses {self.ulysses_degree} x ring {self.ring_degree}) "
                f"does not divide the world size {world_size}; valid SP degrees: {divisors}"
            )
        if family.lower() in WINDOW_FAMILIES:
            self._validate_window(family)
        elif heads is not None and not self.advanced_uaa and heads % self.ulysses_degree:
            valid = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ParallelConfigError(
                f"{heads} heads do not divide by ulysses_degree {self.ulysses_degree} in strict mode "
                f"(advanced_uaa=False); valid degrees: {valid}, or set advanced_uaa=True for uneven head shards"
            )

    def _validate_window(self, family: str) -> None:
        fix = f"use ParallelConfig.window({self.sp_degree}) for window-aligned SP"
        rejected = {
            "ring_degree > 1": self.ring_degree > 1,
            "use_allgather": self.use_allgather,
            "advanced_uaa": self.advanced_uaa,
            "ulysses_a2a_stacked": self.ulysses_a2a_stacked,
        }
        for what, bad in rejected.items():
            if bad:
                raise ParallelConfigError(
                    f"{family} has window attention only and runs window-aligned SP with all heads on "
                    f"every rank; {what} applies to global-attention SP only: {fix}"
                )
