"""What a unit without instances of its own shares, a remote endpoint's or a mesh's: prompts that
cross as messages or text (``BackendFeatures.message_prompts``), the requests such a unit refuses
(token ids, logprobs, token-id stops, LoRA adapters, embeddings), and one guarded stream per
request: its metrics window, its SLA breaker's outcome, its in-flight count and its error counts,
as a local unit's dispatcher keeps them."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from collections.abc import AsyncIterator, Container
from typing import TYPE_CHECKING

from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.messages import EngineRequest, EngineStats, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.engine.tool_format import ToolSpec
from sits.faults import FaultInjector, FaultsSpec
from sits.runtime.features import DEFAULT_MEMORY_TOP_K, BackendFeatures
from sits.runtime.hints import RequestHints
from sits.runtime.sla import NOT_OUTCOMES, SlaBreaker
from sits.runtime.unit_guard import FallbackGuard, record_outcome
from sits.runtime.unit_metrics import MetricsWindow
from sits.runtime.unit_spec import UnitSpec

if TYPE_CHECKING:
    from sits.runtime.gateway import UnitHost

BYTES_PER_TOKEN = 4   # the usual rule of thumb for English text and BPE vocabularies


def estimate_tokens(text: str) -> int:
    return len(text.encode("utf-8", "replace")) // BYTES_PER_TOKEN + 1


@dataclass(frozen=True, slots=True)
class MessagePrompt:
    """A conversation as a unit with ``message_prompts`` takes it: messages (history and retrieved
    context already in), the tools offered and how the answer must be shaped."""

    messages: list[dict]
    tools: list[ToolSpec] | None = None
    tool_choice: str | None = None          # auto / required / none / a function's name
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def __len__(self) -> int:
        """Estimated prompt tokens (each message's text, plus a few for its role and separators)."""
        n = sum(estimate_tokens(_text_of(m.get("content"))) + 4 for m in self.messages)
        for m in self.messages:
            for call in m.get("tool_calls") or []:
                n += estimate_tokens(str(call))
        return n + sum(estimate_tokens(str(t.parameters)) + 8 for t in self.tools or [])

    def with_guidance(self, tool_choice: str | None, response_format: dict | None,
                      parallel_tool_calls: bool | None = None) -> "MessagePrompt":
        return MessagePrompt(self.messages, self.tools, tool_choice, parallel_tool_calls, response_format)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass(frozen=True, slots=True)
class EstimatedRequest(EngineRequest):
    """A request whose prompt crosses as messages or text: its length is an estimate until the model
    that runs it reports its own count (in the finished event)."""

    estimated_prompt_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return self.estimated_prompt_tokens


class MessageUnit(FallbackGuard):
    kind = ""           # "remote" or "mesh": what its errors and views call it

    def __init__(self, spec: UnitSpec, host: "UnitHost", root: str):
        self.spec = spec
        self.name = spec.name
        self.host = host
        self.root = root
        self.created = int(time.time())
        self.tokenizer = None          # the model it reaches has its own vocabulary
        self.features = BackendFeatures(
            ttft_slo_ms=spec.slo.ttft_ms, tools=tuple(spec.tools), tool_dirs=dict(spec.tool_dirs),
            python_tools=spec.python_tools, memory_set=spec.memory.set if spec.memory else None,
            memory_top_k=spec.memory.top_k if spec.memory else DEFAULT_MEMORY_TOP_K, pricing=spec.pricing,
            message_prompts=True)
        self.sampling_defaults: dict = spec.sampling.overrides()
        self.window = MetricsWindow(spec.scale.window_s)
        self.breaker = SlaBreaker(spec.sla, spec.slo.ttft_ms, on_transition=self._breaker_moved)
        self.fallbacks = 0
        self.faults = FaultInjector(spec.faults or FaultsSpec())
        self.inflight = 0
        self.requests = 0
        self.errors: collections.Counter = collections.Counter()
        self.ingested: dict | None = None
        self.last_decision = None

    # -- the Backend API's common part ----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return True

    @property
    def fault_hits(self) -> collections.Counter:
        return self.faults.hits

    def check_prompt(self, prompt, params: SamplingParams, request_id: str, lora: str | None,
                     in_use: Container[str]) -> None:
        """Refuse what cannot cross as messages or text (a typed 400, before anything runs)."""
        what = f"{self.name} ({self.kind} unit)"
        if lora is not None:
            raise InvalidRequestError(f"{what} serves no LoRA adapter {lora!r}", param="model",
                                      code="adapter_not_found")
        if isinstance(prompt, list):
            raise InvalidRequestError(f"{what} takes text prompts, not token ids: the model it reaches has a "
                                      "vocabulary of its own", param="prompt", code="token_prompt_unsupported")
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
        if params.logprobs is not None:
            raise InvalidRequestError(f"{what}: logprobs are not passed through", param="logprobs",
                                      code="unsupported_parameter")
        if params.stop_token_ids:
            raise InvalidRequestError(f"{what}: the token ids of the model it reaches are not known here; use "
                                      "stop strings", param="stop_token_ids", code="unsupported_parameter")
        if request_id in in_use:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id",
                                      code="duplicate_request_id")

    async def guarded(self, seq: EngineRequest, hints: RequestHints,
                      events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        """``events`` of one request, counted: the metrics window, the breaker's one outcome (for the
        request's first sequence), in-flight and error counts."""
        from sits.runtime.dispatcher import StreamProgress

        self.window.arrival()
        self.requests += 1
        self.host.observe_call(self.name, hints)
        primary = seq.request_id.endswith("-0")
        probe = self.breaker.probe_started() if primary else None
        progress = StreamProgress(seq)
        error_code: str | None = None
        self.inflight += 1
        try:
            async for ev in events:
                ev = progress.took(ev, 0)
                if ev.finished:
                    self.window.finished(progress.ttft_ms, (ev.time - ev.arrival_time) * 1e3, ev.num_output_tokens,
                                         progress.itls)
                yield ev
        except SitsError as e:
            self.errors[e.code] += 1
            if e.http_status >= 500 and e.code not in NOT_OUTCOMES:
                error_code = e.code
            raise
        finally:
            await events.aclose()
            self.inflight -= 1
            if primary:
                record_outcome(self.breaker, self.spec.slo.ttft_ms, progress, error_code, probe)

    def stats(self) -> EngineStats:
        return EngineStats(0, self.inflight, 0.0, 0, 0, 0, 0, 0.0, 0, 0, self.kind)

    def session_instance(self, session_id: str) -> None:
        return None

    async def embed(self, inputs: list[list[int]]):
        raise InvalidRequestError(f"{self.name} ({self.kind} unit) serves no embeddings", param="model",
                                  code="embeddings_unsupported")

    # -- the gateway's side ---------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Nothing to scale: what it reaches scales itself."""

    def view(self) -> dict:
        m = self.window.snapshot(inflight=self.inflight)
        return {
            "name": self.name, "kind": self.kind, "model": self.root, "desired": 0, "instances": [], "waiting": 0,
            "inflight": self.inflight, "requests": self.requests, "errors": dict(self.errors),
            "metrics": {"ttft_p95_ms": m.ttft_p95, "itl_p95_ms": m.itl_p95, "rps": round(m.rps, 3),
                        "tps": round(m.tps, 3)},
            "slo_health": None, "last_decision": None, "cold_start": {},
            "memory": None if self.spec.memory is None else {**self.spec.memory.model_dump(), "ingested": self.ingested},
            "sla": self.breaker.view() | {"fallback": self.spec.fallback, "fallbacks": self.fallbacks},
            "faults": self.faults.view() if self.faults.spec.inject else None,
            "spec": self.spec.model_dump(),
        }
