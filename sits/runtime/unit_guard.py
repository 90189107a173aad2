"""What every kind of unit does with its SLA breaker, local instances or a remote endpoint: admit a
request (itself, its fallback, or a fast 503), report the breaker's moves, and turn one request's
stream into the breaker's one outcome."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sits.runtime.sla import BreakerState, SlaBreaker, SlaBreakerOpenError

if TYPE_CHECKING:
    from sits.runtime.dispatcher import StreamProgress
    from sits.runtime.unit_spec import UnitSpec

log = logging.getLogger("sits.runtime")


class FallbackGuard:
    """The breaker side of a unit: needs ``name``, ``spec``, ``breaker``, ``host`` and ``fallbacks``."""

    name: str
    spec: "UnitSpec"
    breaker: SlaBreaker
    host: object
    fallbacks: int

    def _breaker_moved(self, frm: BreakerState, to: BreakerState, why: str) -> None:
        self.host.record(self.name, "breaker", {"from": frm.value, "to": to.value, "reason": why})
        (log.warning if to is BreakerState.OPEN else log.info)("unit %s: SLA breaker %s -> %s (%s)",
                                                                self.name, frm.value, to.value, why)

    def admit(self):
        """This unit if its breaker lets the request through, else its fallback unit, else a fast 503."""
        if self.breaker.admits():
            return self
        self.breaker.rejected += 1
        fb = self.host.unit(self.spec.fallback) if self.spec.fallback else None
        if fb is not None and fb is not self and fb.breaker.admits():
            self.fallbacks += 1
            return fb
        err = SlaBreakerOpenError(
            f"unit {self.name} is shedding load: its SLA breaker is open (success rate below "
            f"{self.spec.sla.success_rate:g} over the last {self.spec.sla.window_s:g}s)"
            + ("" if not self.spec.fallback else f" and its fallback {self.spec.fallback!r} cannot take it"),
            param="model")
        err.retry_after_s = self.breaker.retry_after_s()
        raise err


def record_outcome(breaker: SlaBreaker, slo_ttft_ms: float, progress: "StreamProgress", error_code: str | None,
                   probe) -> None:
    """One request's one outcome: its gateway-seen TTFT or its server-side error; a stream abandoned
    or cut short counts only once it waited past the SLO."""
    waited_ms = progress.gateway_ttft_ms
    if waited_ms is None:
        waited_ms = (time.monotonic() - progress.request.arrival_time) * 1e3
    if progress.finished or error_code is not None:
        breaker.record(breaker.classify(progress.gateway_ttft_ms, error_code), probe=probe)
    elif waited_ms > slo_ttft_ms:
        breaker.record(breaker.classify(waited_ms, None), probe=probe)
    else:
        breaker.probe_cancelled(probe)
