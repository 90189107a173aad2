"""The engine's seam: the typed messages a driver sends an ``EngineCore`` and the outputs it gets back.

Every way of driving an engine (the in-process thread of ``AsyncEngine``, an instance process behind
a Unix socket, a resumed stream after failover) speaks these and nothing else, the way vLLM v1's
``EngineCoreRequest`` / ``EngineCoreOutputs`` are the one contract between its front ends and its
core. Inputs are frozen: a request is described once, in the front end, and the core builds its
own mutable ``Sequence`` from it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from sits.engine.errors import SitsError
from sits.engine.sampling_params import SamplingParams


# -- limits ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine can take: the numbers a request is validated against, once, in its front end.

    A front end in another process learns them from the instance's ``Ready``; a gateway plans them
    from the unit's config before any instance runs (``request_validator.plan_limits``, the same
    function the engine sizes itself with) and checks each instance's ``Ready`` against them.
    """

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int

    @property
    def kv_capacity_tokens(self) -> int:
        """Prompt plus output of one request can never exceed this (the whole KV pool)."""
        return self.block_size * self.num_kv_blocks


# -- inputs ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated, tokenized request (``prompt_token_ids`` is never mutated after this point)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0                 # explicit; higher is served sooner
    interactive: bool = True          # a user is watching the stream (vs a batch job)
    arrival_time: float = field(default_factory=time.monotonic)
    tenant: str | None = None         # the fair-share group it is charged to (None: not ranked by it)
    tenant_weight: float = 1.0        # that group's share relative to the others
    lora: str | None = None           # the LoRA adapter it runs with (None: the base model)

    @property
    def prompt_len(self) -> int:
        """Prompt tokens, as far as they are known before it runs (a request to a remote endpoint
        holds an estimate; its finished event carries the count the endpoint reported)."""
        return len(self.prompt_token_ids)

    def resumed(self, sent: list[int]) -> "EngineRequest":
        """The same request continued after ``sent`` output tokens (failover to another instance): the
        tokens join the prompt, ``max_tokens`` shrinks by as many, and a grammar replays them."""
        p = self.params
        params = replace(p, max_tokens=p.max_tokens - len(sent),
                         grammar_prefix=p.grammar_prefix + sent if p.grammar else [])
        return replace(self, prompt_token_ids=self.prompt_token_ids + sent, params=params)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request now and free its KV blocks (unknown or finished ids are ignored)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """Mean-pooled final hidden states of token-id lists, computed between two steps."""

    request_id: str
    inputs: list[list[int]]


@dataclass(frozen=True, slots=True)
class Ping:
    """A health check, answered with ``Pong(seq)`` between steps."""

    seq: int


@dataclass(frozen=True, slots=True)
class FaultDirectives:
    """Injected faults the core obeys (sits.faults decides them): every step takes at least the
    current stage's time; pings go unanswered while ``drop_pings``."""

    step_stages_ms: tuple[float, ...] = ()
    stage_s: float = 0.0
    drop_pings: bool = False


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The driver stops (an instance process exits)."""


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """Serve the LoRA adapter in the PEFT folder ``path`` as ``name`` (between steps)."""

    request_id: str
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    request_id: str
    name: str


EngineInput = EngineRequest | AbortRequest | EmbedRequest | Ping | FaultDirectives | Shutdown | LoadAdapter | UnloadAdapter


# -- outputs --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TokenEvent:
    """One step's news for one request: a token (with its text delta), or the end of the request."""

    request_id: str
    token_id: int | None
    text: str
    index: int                              # position of this token in the output (0-based)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0               # time.monotonic() clock
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time: float = 0.0                       # when this event was produced

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request the core ended with an error (refused when added, or failed in a step)."""

    request_id: str
    code: str
    message: str
    param: str | None
    http_status: int

    @classmethod
    def of(cls, request_id: str, error: SitsError) -> "RequestError":
        return cls(request_id, error.code, error.message, error.param, error.http_status)

    def to_exception(self) -> SitsError:
        err = SitsError(self.message, param=self.param, code=self.code)
        err.http_status = self.http_status
        return err


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced: token events, and requests that ended with an error."""

    events: list[TokenEvent]
    errors: list[RequestError] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    num_preemptions: int
    num_steps: int
    policy: str
    cold_start: dict = field(default_factory=dict)
    gpu_util: float | None = None          # the device's utilisation (0..1) where a GPU exists and NVML answers
    device_memory_mb: float | None = None  # device memory this engine holds (CUDA's caching allocator); None on a CPU

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Embedded:
    request_id: str
    vectors: np.ndarray


@dataclass(frozen=True, slots=True)
class Pong:
    seq: int


@dataclass(frozen=True, slots=True)
class AdaptersChanged:
    """The answer to ``LoadAdapter`` / ``UnloadAdapter``: the adapters served now (``AdapterManager.view``)."""

    request_id: str
    adapters: list[dict]


EngineOutput = StepOutput | RequestError | EngineStats | Embedded | Pong | AdaptersChanged


# -- an instance process's start-up handshake ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """The process is up and listening; the model loads next."""

    pid: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is loaded: the limits a front end validates requests against, and the cold start."""

    pid: int
    limits: EngineLimits
    cold_start: dict
    inherited_weights: bool
    adapters: list[dict] = field(default_factory=list)     # LoRA adapters loaded at start


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine could not start (the process exits)."""

    code: str
    message: str
