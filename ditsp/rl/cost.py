"""What a run costs: every worker-second held, at the on-demand price for reserved workers and a fraction of it
for spot workers.

The figures are assumptions, stated once here and printed with every report:

- the unit is one device-hour at the on-demand price (a run's cost reads as "on-demand device-hours"), so no
  dollar price is assumed;
- spot capacity costs :data:`SPOT_FRACTION` of on-demand: the large clouds advertise spot GPU discounts of
  roughly 60-90 % off on-demand, varying by region, device and hour; 0.3x is a middle figure of that range,
  an assumption and not a quote.

A worker is paid for from the moment it joins to the moment it leaves (or the run ends), busy or idle, as a
cloud bills it: a reserved worker for the whole run, a spot worker for each stretch the trace gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("reserved", "spot")
SPOT_FRACTION = 0.3  # spot price / on-demand price (assumption, module doc)


@dataclass(frozen=True)
class Prices:
    """Price per device-second of each kind of worker, in on-demand device-hours."""

    spot_fraction: float = SPOT_FRACTION

    def per_second(self, kind: str) -> float:
        if kind not in KINDS:
            raise ValueError(f"a worker is one of {', '.join(KINDS)}, got {kind!r}")
        return (1.0 if kind == "reserved" else self.spot_fraction) / 3600.0

    def describe(self) -> str:
        return (f"reserved at the on-demand price, spot at {self.spot_fraction:g}x on-demand (assumed); "
                f"unit: one device-hour on demand")


@dataclass
class CostLedger:
    """Each worker's paid stretches: opened when it joins, closed when it leaves."""

    prices: Prices = field(default_factory=Prices)
    stretches: list[tuple[str, str, float, float | None]] = field(default_factory=list)  # (worker, kind, start, end)

    def join(self, worker: str, kind: str, at: float) -> None:
        self.prices.per_second(kind)  # checks the kind
        if any(w == worker and end is None for w, _, _, end in self.stretches):
            raise ValueError(f"worker {worker} joined twice without leaving")
        self.stretches.append((worker, kind, at, None))

    def leave(self, worker: str, at: float) -> None:
        for i, (w, kind, start, end) in enumerate(self.stretches):
            if w == worker and end is None:
                self.stretches[i] = (w, kind, start, max(at, start))
                return
        raise ValueError(f"worker {worker} left without having joined")

    def seconds(self, until: float, since: float | None = None) -> dict[str, float]:
        """Device-seconds held per kind up to ``until`` (open stretches counted to it), from ``since`` if given."""
        out = {k: 0.0 for k in KINDS}
        for _, kind, start, end in self.stretches:
            start = start if since is None else max(start, since)
            out[kind] += max(0.0, (until if end is None else min(end, until)) - start)
        return out

    def report(self, until: float, since: float | None = None) -> dict:
        """Seconds per kind, the cost in on-demand device-hours, and the prices it assumed."""
        secs = self.seconds(until, since)
        cost = sum(self.prices.per_second(k) * s for k, s in secs.items())
        return {"reserved_s": secs["reserved"], "spot_s": secs["spot"], "cost_device_hours": cost,
                "spot_fraction": self.prices.spot_fraction, "prices": self.prices.describe()}
