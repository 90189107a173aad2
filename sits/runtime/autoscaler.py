"""The scaling policy: a pure function from a unit's metrics and spec to an instance count.

As in Ray Serve, the policy holds no threads and does no I/O, so it is tested by feeding it
metrics and a clock. Scale up fast (as soon as the trigger or the SLO health has held for
``upscale_delay_s``, one instance at a time, never while one is still starting), down slowly (one
instance per ``downscale_delay_s`` of calm), to zero only after ``keep_alive_s`` without traffic, and
always within ``[min_instances, max_instances]``. Every decision carries its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.runtime.trigger import Trigger, parse_trigger
from sits.runtime.unit_metrics import UnitMetrics
from sits.runtime.unit_spec import ScaleSpec, SloSpec

W_TTFT, W_ITL, W_TPS = 0.4, 0.3, 0.3


def slo_health(m: UnitMetrics, slo: SloSpec) -> float | None:
    """0.4·TTFT + 0.3·ITL + 0.3·TPS, each in [0, 1] against the SLO (1 = met); None without data.

    TTFT and ITL score ``slo / observed p95`` (capped at 1). TPS scores ``observed / slo`` only while
    requests are queueing: a unit that serves all its demand is not short of throughput.
    """
    if m.ttft_p95 is None and m.itl_p95 is None:
        return None
    ttft = 1.0 if not m.ttft_p95 else min(1.0, slo.ttft_ms / m.ttft_p95)
    itl = 1.0 if not m.itl_p95 else min(1.0, slo.itl_ms / m.itl_p95)
    tps = 1.0 if m.queue_depth == 0 else min(1.0, m.tps / slo.tps)
    return W_TTFT * ttft + W_ITL * itl + W_TPS * tps


@dataclass(slots=True)
class ScaleDecision:
    current: int
    target: int
    reason: str
    health: float | None = None

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


@dataclass(slots=True)
class AutoscalerState:
    """What the policy remembers between ticks (one per unit)."""

    pressure_since: float | None = None
    calm_since: float | None = None


class Autoscaler:
    def __init__(self, scale: ScaleSpec, slo: SloSpec):
        self.scale = scale
        self.slo = slo
        self.trigger: Trigger | None = parse_trigger(scale.trigger) if scale.trigger else None
        self.state = AutoscalerState()

    def decide(self, m: UnitMetrics, *, current: int, starting: int, now: float,
               idle_since: float | None) -> ScaleDecision:
        """``current``: instances wanted so far (starting ones included); ``starting``: not yet READY;
        ``idle_since``: when the unit last had a request or a running one (None: busy now)."""
        sc, st = self.scale, self.state
        health = slo_health(m, self.slo)
        lo, hi = sc.min_instances, sc.max_instances
        if current < lo:
            return ScaleDecision(current, lo, f"below min_instances={lo}", health)
        if current > hi:
            return ScaleDecision(current, hi, f"above max_instances={hi}", health)
        if current == 0:
            if m.queue_depth > 0:
                return ScaleDecision(0, 1, f"{m.queue_depth} request(s) waiting for a unit with no instance", health)
            return ScaleDecision(0, 0, "no traffic", health)

        reasons = []
        if self.trigger is not None and self.trigger.evaluate(m.trigger_inputs(health)):
            reasons.append(f"trigger holds: {self.trigger.source}")
        if health is not None and health < self.slo.target_health:
            reasons.append(f"slo_health {health:.2f} < target {self.slo.target_health:.2f}")
        if reasons:
            st.calm_since = None
            if st.pressure_since is None:
                st.pressure_since = now
            if starting:
                return ScaleDecision(current, current, f"{'; '.join(reasons)}; waiting for {starting} starting "
                                                       "instance(s)", health)
            if current >= hi:
                return ScaleDecision(current, current, f"{'; '.join(reasons)}; at max_instances={hi}", health)
            if now - st.pressure_since >= sc.upscale_delay_s:
                st.pressure_since = now
                return ScaleDecision(current, current + 1, "; ".join(reasons), health)
            return ScaleDecision(current, current, f"{'; '.join(reasons)} for "
                                                   f"{now - st.pressure_since:.1f}s < upscale_delay_s", health)

        st.pressure_since = None
        if st.calm_since is None:
            st.calm_since = now
        if lo == 0 and idle_since is not None and now - idle_since >= sc.keep_alive_s:
            return ScaleDecision(current, 0, f"idle for {now - idle_since:.0f}s >= keep_alive_s={sc.keep_alive_s:g}",
                                 health)
        floor = max(lo, 1)
        if current > floor and now - st.calm_since >= sc.downscale_delay_s:
            st.calm_since = now
            return ScaleDecision(current, current - 1, f"calm for {sc.downscale_delay_s:g}s (downscale_delay_s)",
                                 health)
        return ScaleDecision(current, current, "within SLO", health)
