"""Fair share between tenants: a virtual token counter per tenant (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024; AIBrix routes by the same counter).

Each tenant's counter grows by the tokens computed for it (a decode token counts twice a prefill
token, as in the paper), divided by its weight. A tenant that becomes active again starts at the
lowest counter among the active ones, so idle time banks no credit. The scheduler ranks requests by
their tenant's lead over the least-served active tenant (in steps' worth of tokens) before their
RAAP score: a tenant that floods the queue waits behind the others' requests, not in front of them.
Requests without a tenant form one group of their own.
"""

from __future__ import annotations

DECODE_WEIGHT = 2.0       # a generated token costs the tenant as much as two prompt tokens


class FairShare:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.active: dict[str, int] = {}          # tenant -> its sequences waiting or running
        self._floor: float | None = None          # min counter over active tenants (cached per change)

    def arrived(self, tenant: str) -> None:
        if not self.active.get(tenant):
            lowest = self.floor()
            current = self.counters.get(tenant, 0.0)
            self.counters[tenant] = current if lowest is None else max(current, lowest)
        self.active[tenant] = self.active.get(tenant, 0) + 1
        self._floor = None

    def left(self, tenant: str) -> None:
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        else:
            self.active.pop(tenant, None)
        self._floor = None

    def charge(self, tenant: str, prefill_tokens: int, decode_tokens: int, weight: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            (prefill_tokens + DECODE_WEIGHT * decode_tokens) / max(weight, 1e-6)
        self._floor = None

    def floor(self) -> float | None:
        if self._floor is None and self.active:
            self._floor = min(self.counters.get(t, 0.0) for t in self.active)
        return self._floor

    def lead(self, tenant: str) -> float:
        """Weighted tokens this tenant has been served beyond the least-served active tenant."""
        lowest = self.floor()
        return 0.0 if lowest is None else self.counters.get(tenant, 0.0) - lowest
