"""Fault injection: the five ways SITS is broken on purpose to prove it keeps serving.

``FaultsSpec`` is what a unit's YAML (``faults:``) or the admin endpoint declares; ``FaultInjector``
turns it into delays and instance directives from one seeded random stream, so a test run is
repeatable. Cross-cutting: the runtime consults it, the engine never sees it (an instance only
receives plain directives: a step-time floor and whether to answer health checks).
"""

from sits.faults.injector import FaultInjector, InstanceDirectives
from sits.faults.spec import (FaultSpec, FaultsSpec, FirstFrameBlock, HeartbeatTimeout, LinkJitter, QueueLag,
                              StepDegradation)

__all__ = ["FaultInjector", "FaultSpec", "FaultsSpec", "FirstFrameBlock", "HeartbeatTimeout", "InstanceDirectives",
           "LinkJitter", "QueueLag", "StepDegradation"]
