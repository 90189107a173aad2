"""Trace-driven pre-warming: learn which unit follows which, and start the next one ahead.

Calls that share a chain key (the session, else the trace) within ``window_s`` are consecutive
steps of one workflow. For each unit A the prefetcher counts its calls and, per unit B, how often
B came next: P(B | A) = count(A → B) / count(A). Repeated calls of one unit in a chain (a
conversation) are one step. When A is called, every B with P(B | A) ≥
``threshold`` (default 0.85, after ``min_observations`` calls of A) is returned, for the gateway to
start if it has no instance and its budget allows.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict


class Prefetcher:
    def __init__(self, *, window_s: float = 60.0, threshold: float = 0.85, min_observations: int = 3,
                 max_chains: int = 100_000, clock=time.monotonic):
        self.window_s = window_s
        self.threshold = threshold
        self.min_observations = min_observations
        self.max_chains = max_chains
        self.clock = clock
        self._last: OrderedDict[str, tuple[str, float]] = OrderedDict()    # chain -> (unit, time)
        self.calls: Counter[str] = Counter()
        self.next: dict[str, Counter[str]] = {}

    def probability(self, a: str, b: str) -> float:
        n = self.calls.get(a, 0)
        return self.next.get(a, Counter()).get(b, 0) / n if n else 0.0

    def observe(self, unit: str, chain_key: str | None) -> list[tuple[str, float]]:
        """Record a call; return the units likely to be called next in this chain, with P(B | unit)."""
        if chain_key is None:
            return []
        now = self.clock()
        prev = self._last.get(chain_key)
        self._last[chain_key] = (unit, now)
        self._last.move_to_end(chain_key)
        if prev is not None and now - prev[1] <= self.window_s:
            if prev[0] == unit:
                return []        # the workflow is still in this unit (a conversation): not a new step
            self.next.setdefault(prev[0], Counter())[unit] += 1
        while len(self._last) > self.max_chains:
            self._last.popitem(last=False)
        self.calls[unit] += 1
        if self.calls[unit] <= self.min_observations:
            return []
        return [(b, p) for b in self.next.get(unit, {}) if b != unit
                and (p := self.probability(unit, b)) >= self.threshold]
