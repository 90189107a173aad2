"""An instance's memory-time (its weights and KV pool × how long it lives), apportioned to the
tenants it served by their share of its busy time (request-seconds on it).

The gateway closes an interval now and then and when the instance stops; an interval in which
nobody was served is carried into the next one, and one still unserved when the instance stops is
charged to no tenant (the operator's own keep-alive).
"""

from __future__ import annotations

from collections import defaultdict


class InstanceMeter:
    def __init__(self, footprint_bytes: int, started_at: float):
        self.footprint_bytes = footprint_bytes
        self.since = started_at
        self.busy: dict[str | None, float] = defaultdict(float)

    def served(self, tenant: str | None, seconds: float) -> None:
        self.busy[tenant] += max(seconds, 0.0)

    def close(self, now: float, final: bool = False) -> list[tuple[str | None, float]]:
        """(tenant, GB-hours) for the time since the last close; empty while nobody was served
        (unless ``final``)."""
        total = sum(self.busy.values())
        if total <= 0 and not final:
            return []
        gb_hours = self.footprint_bytes / 1e9 * max(now - self.since, 0.0) / 3600.0
        shares = [(None, gb_hours)] if total <= 0 else [(t, gb_hours * s / total) for t, s in self.busy.items()]
        self.since = now
        self.busy.clear()
        return shares
