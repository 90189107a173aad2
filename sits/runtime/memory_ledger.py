"""Memory as a resource the gateway's units share: what this host's instances and the zygote hold,
against a budget.

A deployed CPU unit's weights are held once while the zygote keeps them preloaded (every fork
shares them, and so does every unit of the same model, dtype and layout: one *weights group*); an
instance's start then reserves its KV pool only. An instance started without the zygote loads its
own copy, so it reserves its weights too. A start that does not fit evicts idle instances of other
units (none in flight, never below a unit's ``min_instances``, least recently used unit first: the
unit scales down by one, as a keep-alive expiry would) and waits while the memory is being given
back; with nothing idle to evict it waits until an instance stops. No start is allowed to push the
host past its budget (the kernel's OOM killer would pick a victim by itself). Scale to zero gives
the KV pools back. The gateway keeps one ledger for the host's memory (CPU instances) and one per
GPU (its instances' weights, KV pools, activation reserves and CUDA contexts, and the standby
processes' contexts; instances on a GPU share no weights), budgeted from NVML without a CUDA context
(``device_memory``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

MIB = 2**20


@dataclass(slots=True)
class _Holding:
    unit: str               # for views: whose it is ("(zygote)" for preloaded weights)
    group: str | None       # the weights group it belongs to (None: nothing shared)
    nbytes: int


@dataclass
class MemoryLedger:
    capacity: int                                   # bytes the instances and the zygote may hold together
    _held: dict[str, _Holding] = field(default_factory=dict)       # key (instance id, or a group's) -> holding
    _freed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def reserved(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def need(self, group: str | None, weights: int, kv: int) -> int:
        """An instance's share: its KV pool, and the weights unless its group holds them already."""
        if group is not None and any(h.group == group for h in self._held.values()):
            return kv
        return kv + weights

    def reserve(self, instance: str, unit: str, group: str | None, weights: int, kv: int) -> bool:
        n = self.need(group, weights, kv)
        if self.reserved + n > self.capacity:
            return False
        self._held[instance] = _Holding(unit, group, n)
        return True

    def hold(self, key: str, group: str | None, nbytes: int, owner: str = "(zygote)") -> None:
        """Memory the zygote keeps (a weights group's weights, standby processes' contexts) for as long as
        it keeps it (``release(key)``), fitting or not (it keeps it either way; starts wait until
        instances give enough back)."""
        if key not in self._held:
            self._held[key] = _Holding(owner, group, nbytes)

    def kept_by(self, owner: str) -> int:
        return sum(h.nbytes for h in self._held.values() if h.unit == owner)

    @property
    def kept(self) -> int:
        """What the zygote keeps, whatever instances run: preloaded weights, standby processes."""
        return sum(h.nbytes for h in self._held.values() if h.unit in ("(zygote)", "(standby)"))

    def release(self, key: str) -> None:
        h = self._held.pop(key, None)
        if h is None:
            return
        if h.group is not None:       # weights an instance carried stay with the group's next holder
            others = [k for k, o in self._held.items() if o.group == h.group]
            if others:
                kv = min(self._held[k].nbytes for k in others)
                if h.nbytes > kv:
                    self._held[others[0]].nbytes += h.nbytes - kv
        self._freed.set()

    async def freed(self, timeout_s: float) -> None:
        """Until some memory is given back (or ``timeout_s``)."""
        self._freed.clear()
        try:
            await asyncio.wait_for(self._freed.wait(), timeout_s)
        except TimeoutError:
            pass

    def holds(self, key: str) -> bool:
        return key in self._held

    def held(self, key: str) -> int:
        h = self._held.get(key)
        return 0 if h is None else h.nbytes

    def by_unit(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self._held.values():
            out[h.unit] = out.get(h.unit, 0) + h.nbytes
        return out

    def view(self) -> dict:
        return {"capacity_mb": round(self.capacity / MIB, 1), "reserved_mb": round(self.reserved / MIB, 1),
                "by_unit_mb": {u: round(b / MIB, 1) for u, b in self.by_unit().items()}}
