"""Turns a unit's FaultsSpec into delays (gateway side) and directives (instance side).

All randomness comes from one ``random.Random(seed)`` per injector, drawn in the order the runtime
asks, so the same requests in the same order see the same delays. Instance faults (step
degradation, heartbeat timeout) are assigned to instances as they become READY, each fault to at
most ``instances`` of them over the injector's life: a heartbeat loss that gets its instance
replaced does not follow it to the replacement.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from sits.faults.spec import (FaultsSpec, FirstFrameBlock, HeartbeatTimeout, LinkJitter, QueueLag,
                              StepDegradation)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class InstanceDirectives:
    """What an instance process is told: a floor on its step time, staged, and whether to ignore pings."""

    step_stages_ms: tuple[float, ...] = ()
    stage_s: float = 0.0
    drop_pings: bool = False

    def to_dict(self) -> dict:
        return {"step_stages_ms": list(self.step_stages_ms), "stage_s": self.stage_s, "drop_pings": self.drop_pings}

    @property
    def empty(self) -> bool:
        return not self.step_stages_ms and not self.drop_pings


@dataclass
class FaultInjector:
    spec: FaultsSpec = field(default_factory=FaultsSpec)
    set_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.spec.seed)
        self.hits: collections.Counter = collections.Counter()      # kind -> times it acted
        self._assigned: dict[int, list[str]] = collections.defaultdict(list)   # fault index -> instance ids

    @property
    def active(self) -> bool:
        return self.spec.enabled and bool(self.spec.inject)

    def _faults(self, cls, path: str | None):
        if not self.spec.enabled:
            return []
        return [f for f in self.spec.inject if isinstance(f, cls) and f.applies_to(path)]

    def _hit(self, f) -> bool:
        return f.probability >= 1.0 or self.rng.random() < f.probability

    # -- gateway-side delays (seconds) ----------------------------------------------------------------
    def link_delay_s(self, path: str | None) -> float:
        total = 0.0
        for f in self._faults(LinkJitter, path):
            if not self._hit(f):
                continue
            if f.distribution == "uniform":
                ms = self.rng.uniform(f.min_ms, f.max_ms)
            else:
                mean = f.mean_ms if f.mean_ms is not None else (f.min_ms + f.max_ms) / 2
                std = f.std_ms if f.std_ms is not None else (f.max_ms - f.min_ms) / 6
                ms = min(max(self.rng.gauss(mean, std), f.min_ms), f.max_ms)
            self.hits["link_jitter"] += 1
            total += ms / 1e3
        return total

    def queue_lag_s(self, path: str | None) -> float:
        total = 0.0
        for f in self._faults(QueueLag, path):
            if self._hit(f):
                self.hits["queue_lag"] += 1
                total += self.rng.uniform(f.min_ms, f.max_ms) / 1e3
        return total

    def first_frame_s(self, path: str | None) -> float:
        total = 0.0
        for f in self._faults(FirstFrameBlock, path):
            if self._hit(f):
                self.hits["first_frame_block"] += 1
                total += f.block_ms / 1e3
        return total

    async def delayed(self, events: AsyncIterator[T], path: str | None, hold_first_s: float = 0.0) -> AsyncIterator[T]:
        """``events`` as a faulty link delivers them: the request's own frame is late too (its delay joins
        the first event's, so the instance already has the stream and an abort meanwhile reaches it),
        every event's frame is late, and the first one is held back ``hold_first_s`` more. Closing this
        closes ``events``."""
        async with contextlib.aclosing(events):
            uplink = self.link_delay_s(path)
            async for ev in events:
                if d := self.link_delay_s(path) + uplink:
                    uplink = 0.0
                    await asyncio.sleep(d)
                if hold_first_s:
                    await asyncio.sleep(hold_first_s)
                    hold_first_s = 0.0
                yield ev

    # -- instance-side directives ---------------------------------------------------------------------
    def directives_for(self, instance_id: str) -> InstanceDirectives:
        """The directives of one READY instance; assigns it unassigned instance faults (in order)."""
        stages: tuple[float, ...] = ()
        stage_s = 0.0
        drop = False
        if not self.spec.enabled:
            return InstanceDirectives()
        for idx, f in enumerate(self.spec.inject):
            if not isinstance(f, (StepDegradation, HeartbeatTimeout)):
                continue
            owners = self._assigned[idx]
            if instance_id not in owners:
                if len(owners) >= f.instances:
                    continue
                owners.append(instance_id)
                self.hits[f.kind] += 1
            if isinstance(f, StepDegradation):
                stages, stage_s = tuple(f.stages_ms), f.stage_s
            else:
                drop = True
        return InstanceDirectives(stages, stage_s, drop)

    def view(self) -> dict:
        return {"enabled": self.spec.enabled, "seed": self.spec.seed, "set_at": self.set_at,
                "inject": [f.model_dump() for f in self.spec.inject], "hits": dict(self.hits),
                "assigned": {self.spec.inject[i].kind: ids for i, ids in self._assigned.items() if ids}}
