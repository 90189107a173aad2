"""The fault declarations, as they appear under a unit's ``faults:`` key or in an admin PUT.

    faults:
      seed: 7
      inject:
        - {kind: link_jitter, distribution: uniform, min_ms: 10, max_ms: 500}
        - {kind: step_degradation, stages_ms: [50, 200, 1200], stage_s: 5}
        - {kind: queue_lag, min_ms: 100, max_ms: 300, routes: [/v1/chat/completions]}
        - {kind: first_frame_block, block_ms: 800}
        - {kind: heartbeat_timeout, instances: 1}

Every fault may name ``routes`` (request paths it applies to; default all) and a ``probability``
(the share of requests or frames it hits).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    routes: list[str] | None = Field(None, description="request paths this fault applies to (default: all)")
    probability: float = Field(1.0, ge=0, le=1, description="share of requests (or frames) it hits")

    def applies_to(self, path: str | None) -> bool:
        return self.routes is None or (path is not None and path in self.routes)


class LinkJitter(_Fault):
    """Delay on every frame of the gateway <-> instance path (the request going out, each event back)."""

    kind: Literal["link_jitter"]
    distribution: Literal["uniform", "normal"] = "uniform"
    min_ms: float = Field(10.0, ge=0)
    max_ms: float = Field(500.0, ge=0)
    mean_ms: float | None = Field(None, ge=0, description="normal: the mean (default: midpoint of min/max)")
    std_ms: float | None = Field(None, ge=0, description="normal: the deviation (default: a sixth of the range)")

    @model_validator(mode="after")
    def _range(self) -> "LinkJitter":
        if self.min_ms > self.max_ms:
            raise ValueError(f"min_ms ({self.min_ms}) exceeds max_ms ({self.max_ms})")
        return self


class _InstanceFault(_Fault):
    """Acts on whole instances, not on requests: routes and probability do not apply."""

    @model_validator(mode="after")
    def _per_instance(self):
        if self.routes is not None or self.probability != 1.0:
            raise ValueError(f"{self.kind} acts on whole instances: use 'instances', not routes or probability")
        return self


class StepDegradation(_InstanceFault):
    """An instance whose engine step takes at least stages_ms[i], i growing every stage_s seconds."""

    kind: Literal["step_degradation"]
    stages_ms: list[float] = Field(default_factory=lambda: [50.0, 200.0, 1200.0], min_length=1)
    stage_s: float = Field(5.0, gt=0, description="how long each stage lasts (the last one stays)")
    instances: int = Field(1, ge=1, description="how many instances degrade")

    @model_validator(mode="after")
    def _positive(self) -> "StepDegradation":
        if any(s < 0 for s in self.stages_ms):
            raise ValueError("stages_ms are non-negative milliseconds")
        return self


class QueueLag(_Fault):
    """Requests held in the gateway queue before routing, as behind a lagging consumer."""

    kind: Literal["queue_lag"]
    min_ms: float = Field(100.0, ge=0)
    max_ms: float = Field(300.0, ge=0)

    @model_validator(mode="after")
    def _range(self) -> "QueueLag":
        if self.min_ms > self.max_ms:
            raise ValueError(f"min_ms ({self.min_ms}) exceeds max_ms ({self.max_ms})")
        return self


class FirstFrameBlock(_Fault):
    """The first frame of a response (its headers and first chunk) held back; the rest untouched."""

    kind: Literal["first_frame_block"]
    block_ms: float = Field(1000.0, ge=0)


class HeartbeatTimeout(_InstanceFault):
    """Instances that stop answering health checks while alive (and keep serving what they have)."""

    kind: Literal["heartbeat_timeout"]
    instances: int = Field(1, ge=1, description="how many instances go silent (each one only once)")


FaultSpec = Annotated[LinkJitter | StepDegradation | QueueLag | FirstFrameBlock | HeartbeatTimeout,
                      Field(discriminator="kind")]


class FaultsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = Field(0, description="seeds the random stream of every delay, so a run is repeatable")
    enabled: bool = True
    inject: list[FaultSpec] = Field(default_factory=list)
