"""Memory as a resource the gateway's units share: what each instance holds, against a budget.

An instance's start reserves its share first: the unit's weights once (instances forked from the
zygote share them) and its own KV pool. A start that does not fit evicts idle instances of other
units (none in flight, least recently used unit first: the unit scales down by one, as a keep-alive
expiry would) and waits while the memory is being freed; with nothing idle to evict it waits until
an instance stops. A running instance is never what pays for a start: no start is allowed to push
the host past its budget (the kernel's OOM killer would pick a victim by itself). Scale to zero
gives the memory back. This is for CPU instances; a GPU's memory is not measured here (that needs
the device, which the gateway does not touch).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

MIB = 2**20


@dataclass(slots=True)
class _Holding:
    unit: str
    nbytes: int


@dataclass
class MemoryLedger:
    capacity: int                                   # bytes the instances may hold together
    _held: dict[str, _Holding] = field(default_factory=dict)       # instance id -> its reservation
    _freed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def reserved(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def need(self, unit: str, weights: int, kv: int) -> int:
        """An instance of ``unit``: its KV pool, and the weights if no instance of the unit holds them."""
        return kv + (0 if any(h.unit == unit for h in self._held.values()) else weights)

    def reserve(self, instance: str, unit: str, weights: int, kv: int) -> bool:
        n = self.need(unit, weights, kv)
        if self.reserved + n > self.capacity:
            return False
        self._held[instance] = _Holding(unit, n)
        return True

    def release(self, instance: str) -> None:
        h = self._held.pop(instance, None)
        if h is None:
            return
        others = [k for k, o in self._held.items() if o.unit == h.unit]
        if others and h.nbytes > (kv := min(self._held[k].nbytes for k in others)):
            self._held[others[0]].nbytes += h.nbytes - kv     # the weights stay with the unit's next instance
        self._freed.set()

    async def freed(self, timeout_s: float) -> None:
        """Until some memory is given back (or ``timeout_s``)."""
        self._freed.clear()
        try:
            await asyncio.wait_for(self._freed.wait(), timeout_s)
        except TimeoutError:
            pass

    def holds(self, instance: str) -> bool:
        return instance in self._held

    def by_unit(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self._held.values():
            out[h.unit] = out.get(h.unit, 0) + h.nbytes
        return out

    def view(self) -> dict:
        return {"capacity_mb": round(self.capacity / MIB, 1), "reserved_mb": round(self.reserved / MIB, 1),
                "by_unit_mb": {u: round(b / MIB, 1) for u, b in self.by_unit().items()}}
