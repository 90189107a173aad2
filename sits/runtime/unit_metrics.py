"""A unit's recent behaviour over a sliding window: what the autoscaler and the trigger read.

Observations are kept with their time and dropped once older than the window, so every figure
(p95s, request rate, token rate) describes the last ``window_s`` seconds only.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """cpu_util of a set of processes: CPU seconds used since the last reading / (wall seconds × cores)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: dict[int, tuple[float, float]] = {}

    def read(self, pids: list[int]) -> float | None:
        now, used, span = self.clock(), 0.0, 0.0
        seen = {}
        for pid in pids:
            cpu = process_cpu_seconds(pid)
            if cpu is None:
                continue
            seen[pid] = (now, cpu)
            prev = self._last.get(pid)
            if prev is not None and now > prev[0]:
                used += cpu - prev[1]
                span = max(span, now - prev[0])
        self._last = seen
        if span <= 0:
            return None
        return min(1.0, used / (span * (os.cpu_count() or 1)))


def _p95(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


@dataclass(slots=True)
class UnitMetrics:
    """A snapshot; times in ms, utilisations as fractions, None where there is no data."""

    ttft_p95: float | None = None
    itl_p95: float | None = None
    latency_p95: float | None = None
    queue_depth: int = 0            # requests waiting for an instance or for admission
    inflight: int = 0               # requests being served
    kv_util: float | None = None
    rps: float = 0.0
    tps: float = 0.0                # output tokens per second
    cpu_util: float | None = None
    gpu_util: float | None = None

    def trigger_inputs(self, slo_health: float | None) -> dict[str, float | None]:
        return {"ttft_p95": self.ttft_p95, "itl_p95": self.itl_p95, "latency_p95": self.latency_p95,
                "queue_depth": float(self.queue_depth), "kv_util": self.kv_util, "rps": self.rps,
                "cpu_util": self.cpu_util, "gpu_util": self.gpu_util, "slo_health": slo_health}


class MetricsWindow:
    def __init__(self, window_s: float = 30.0, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._requests: deque[tuple[float, float | None, float, int]] = deque()   # (t, ttft_ms, e2e_ms, tokens)
        self._itl: deque[tuple[float, float]] = deque()
        self.last_request_at: float | None = None

    def _trim(self, now: float) -> None:
        cut = now - self.window_s
        while self._requests and self._requests[0][0] < cut:
            self._requests.popleft()
        while self._itl and self._itl[0][0] < cut:
            self._itl.popleft()

    def arrival(self) -> None:
        self.last_request_at = self.clock()

    def finished(self, ttft_ms: float | None, e2e_ms: float, output_tokens: int, itls_ms: list[float]) -> None:
        now = self.clock()
        self.last_request_at = now
        self._requests.append((now, ttft_ms, e2e_ms, output_tokens))
        self._itl.extend((now, x) for x in itls_ms)
        self._trim(now)

    def snapshot(self, *, queue_depth: int = 0, inflight: int = 0, kv_util: float | None = None,
                 cpu_util: float | None = None, gpu_util: float | None = None) -> UnitMetrics:
        now = self.clock()
        self._trim(now)
        reqs = list(self._requests)
        span = min(self.window_s, max(1e-3, now - reqs[0][0])) if reqs else self.window_s
        return UnitMetrics(
            ttft_p95=_p95([r[1] for r in reqs if r[1] is not None]), itl_p95=_p95([x for _, x in self._itl]),
            latency_p95=_p95([r[2] for r in reqs]), queue_depth=queue_depth, inflight=inflight, kv_util=kv_util,
            rps=len(reqs) / span if reqs else 0.0, tps=sum(r[3] for r in reqs) / span if reqs else 0.0,
            cpu_util=cpu_util, gpu_util=gpu_util)
