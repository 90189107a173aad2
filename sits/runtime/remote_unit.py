"""A remote unit: one whose model runs behind an OpenAI-compatible endpoint (another SITS, a vLLM
cluster, a cloud API), under the gateway's features like a local unit.

The gateway does what it does for every unit (SLA breaker and fallback, metrics, tracing, request
faults, sessions, retrieved memories, the tool loop, tenants' limits and usage); the endpoint
renders its own chat template and enforces tools and ``response_format`` itself. So a chat request
crosses as messages (a ``MessagePrompt``), not token ids, and the endpoint's stream comes back as the
``TokenEvent``s every backend yields: one per text delta, tool calls written out in the tool-call
text format the API layer reads back, and a finished event carrying the endpoint's own token counts.
Before it runs, a request's prompt length is an estimate (what limits and tenant reservations
count); what is settled is what the endpoint reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sits.engine.errors import InvalidRequestError, RequestAbortedError, SitsError
from sits.engine.messages import EngineRequest, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.engine.tool_format import render_call
from sits.observe import tracing
from sits.runtime.hints import RequestHints
from sits.runtime.message_unit import EstimatedRequest, MessagePrompt, MessageUnit, estimate_tokens
from sits.runtime.openai_endpoint import OpenAIEndpoint, RemoteError
from sits.runtime.unit_spec import UnitSpec

if TYPE_CHECKING:
    from sits.runtime.gateway import UnitHost

REMOTE_TOKEN = -1     # the token id of a remote endpoint's text delta: its vocabulary is not known here


@dataclass(frozen=True, slots=True)
class RemoteRequest(EstimatedRequest):
    """A request prepared for the endpoint: its path and JSON body."""

    path: str = "/chat/completions"
    body: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Call:
    """One request on its way to the endpoint: where its events go, and the task reading them."""

    queue: asyncio.Queue
    task: asyncio.Task | None = None


_END = object()


class RemoteUnit(MessageUnit):
    """A unit behind an OpenAI-compatible endpoint (``backend:`` in its YAML), behind the ``Backend``
    API like a local unit."""

    kind = "remote"

    def __init__(self, spec: UnitSpec, host: "UnitHost"):
        b = spec.backend
        if b is None:
            raise ValueError(f"unit {spec.name} has no backend: it is a local unit")
        super().__init__(spec, host, b.openai)
        self.remote_model = b.model or spec.name
        self.max_model_len = b.max_context
        self.kv_capacity_tokens = b.max_context
        api_key = None
        if b.api_key_env is not None:
            api_key = os.environ.get(b.api_key_env)
            if not api_key:
                raise InvalidRequestError(f"unit {spec.name}: the environment variable {b.api_key_env} "
                                          "(backend.api_key_env) is not set in the gateway's environment",
                                          param="backend.api_key_env", code="remote_api_key_missing")
        self.endpoint = OpenAIEndpoint(b.openai, api_key, connect_timeout_s=b.connect_timeout_s,
                                       read_timeout_s=b.read_timeout_s, max_connections=b.max_connections,
                                       name=f"unit {spec.name}'s endpoint")
        self.sampling_defaults = {"max_tokens": b.max_tokens} | self.sampling_defaults
        self._calls: dict[str, _Call] = {}

    # -- the Backend API ------------------------------------------------------------------------------
    def prepare(self, prompt: MessagePrompt | str | list[int], params: SamplingParams, *, request_id: str,
                priority: int = 0, interactive: bool = True, add_special_tokens: bool = True,
                lora: str | None = None) -> RemoteRequest:
        self.check_prompt(prompt, params, request_id, lora, self._calls)
        if isinstance(prompt, MessagePrompt):
            path, body, estimate = "/chat/completions", self._chat_body(prompt, params), len(prompt)
        else:
            path, estimate = "/completions", estimate_tokens(prompt)
            body = {"model": self.remote_model, "prompt": prompt, "max_tokens": params.max_tokens}
        body |= _sampling_fields(params)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        return RemoteRequest(request_id, [], params, priority, interactive, path=path, body=body,
                             estimated_prompt_tokens=estimate)

    def _chat_body(self, prompt: MessagePrompt, params: SamplingParams) -> dict:
        body: dict = {"model": self.remote_model, "messages": prompt.messages,
                      "max_completion_tokens": params.max_tokens}
        if prompt.tools:
            body["tools"] = [t.openai() for t in prompt.tools]
            choice = prompt.tool_choice or "auto"
            body["tool_choice"] = choice if choice in ("auto", "required", "none") else \
                {"type": "function", "function": {"name": choice}}
            if prompt.parallel_tool_calls is False:
                body["parallel_tool_calls"] = False
        if prompt.response_format is not None:
            body["response_format"] = prompt.response_format
        return body

    def stream(self, seq: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        """The endpoint's events for ``seq``, with this unit's request faults on the way."""
        if not isinstance(seq, RemoteRequest):
            raise TypeError("a remote unit streams requests it prepared")
        hints = hints or RequestHints()
        faults = self.faults
        events = self._call(seq, faults.queue_lag_s(hints.path) if faults.active else 0.0)
        if faults.active:
            events = faults.delayed(events, hints.path, hold_first_s=faults.first_frame_s(hints.path))
        return self.guarded(seq, hints, events)

    async def _call(self, seq: RemoteRequest, lag_s: float) -> AsyncIterator[TokenEvent]:
        """Events as a reader task puts them on a queue, so ``abort`` can end the stream at once."""
        call = _Call(asyncio.Queue())
        self._calls[seq.request_id] = call
        call.task = asyncio.get_running_loop().create_task(self._read(seq, call.queue, lag_s))
        try:
            while True:
                item = await call.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._calls.pop(seq.request_id, None)
            call.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call.task

    async def _read(self, seq: RemoteRequest, queue: asyncio.Queue, lag_s: float) -> None:
        try:
            if lag_s:
                await asyncio.sleep(lag_s)      # fault: held in the gateway's queue
            async for ev in self._events(seq):
                queue.put_nowait(ev)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the stream's reader, which raises it
            queue.put_nowait(e)

    async def _events(self, seq: RemoteRequest) -> AsyncIterator[TokenEvent]:
        rid = seq.request_id
        sent_at = time.monotonic()
        scope = tracing.current_scope.get()
        headers = {"traceparent": scope.traceparent} if scope is not None and scope.traceparent else None
        first: float | None = None
        index = 0
        marker = 0       # 1 once an empty first-token event stood for a tool call's start
        finish: str | None = None
        usage: dict = {}
        calls: dict[int, dict] = {}       # tool calls by their index, arguments accumulated
        error: str | None = None
        try:
            async for chunk in self.endpoint.stream(seq.path, seq.body, headers):
                try:
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        text = delta.get("content") if "delta" in choice else choice.get("text")
                        for tc in delta.get("tool_calls") or []:
                            if not calls and first is None:      # the answer has begun: its first token is here
                                first = time.monotonic()
                                marker = 1
                                yield TokenEvent(rid, REMOTE_TOKEN, "", index, arrival_time=seq.arrival_time,
                                                 first_scheduled_time=sent_at, first_token_time=first, time=first,
                                                 num_prompt_tokens=seq.prompt_len, num_output_tokens=index + 1)
                                index += 1
                            _add_call_delta(calls, tc)
                        if choice.get("finish_reason"):
                            finish = str(choice["finish_reason"])
                        if text:
                            if not isinstance(text, str):
                                raise TypeError(f"content is a {type(text).__name__}")
                            now = time.monotonic()
                            first = first or now
                            yield TokenEvent(rid, REMOTE_TOKEN, text, index, arrival_time=seq.arrival_time,
                                             first_scheduled_time=sent_at, first_token_time=first, time=now,
                                             num_prompt_tokens=seq.prompt_len, num_output_tokens=index + 1)
                            index += 1
                except (AttributeError, TypeError, ValueError, KeyError) as e:
                    raise RemoteError(f"unit {self.name}'s endpoint sent a chunk that is not a completion chunk "
                                      f"({type(e).__name__}: {e})", code="remote_bad_response") from None
        except SitsError as e:
            error = e.code
            raise
        finally:
            tracing.stage("remote.call", sent_at, time.monotonic(), level="L2", error=error,
                          attributes={"server.address": self.endpoint.base_url, "sits.unit": self.name,
                                      "gen_ai.request.model": self.remote_model, "sits.remote.path": seq.path})
        now = time.monotonic()
        if calls:        # written as the model would have, so the API layer reads them back as for a local unit
            first = first or now
            text = "\n".join(render_call({"function": calls[i]}) for i in sorted(calls))
            yield TokenEvent(rid, REMOTE_TOKEN, text, index, arrival_time=seq.arrival_time,
                             first_scheduled_time=sent_at, first_token_time=first, time=now,
                             num_prompt_tokens=seq.prompt_len, num_output_tokens=index + 1)
            index += 1
        details = usage.get("prompt_tokens_details") or {}
        yield TokenEvent(rid, None, "", index, finished=True,
                         finish_reason="stop" if finish in (None, "tool_calls", "function_call") else finish,
                         num_prompt_tokens=_count(usage.get("prompt_tokens"), seq.prompt_len),
                         num_output_tokens=_count(usage.get("completion_tokens"), index - marker),
                         num_cached_tokens=_count(details.get("cached_tokens"), 0) if isinstance(details, dict) else 0,
                         arrival_time=seq.arrival_time, first_scheduled_time=sent_at,
                         first_token_time=first or now, time=now)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.queue.put_nowait(error or RequestAbortedError(f"request {request_id} was aborted"))
            if call.task is not None:
                call.task.cancel()

    def predicted_ttft_ms(self) -> float:
        """The recent TTFT p95 (0 before the first answer): the endpoint's queue is not visible here."""
        return self.window.snapshot().ttft_p95 or 0.0

    # -- the gateway's side ---------------------------------------------------------------------------
    async def close(self, error: SitsError | None = None) -> None:
        for rid in list(self._calls):
            self.abort(rid, error)
        await self.endpoint.aclose()

    def view(self) -> dict:
        b = self.spec.backend
        return super().view() | {"model": self.remote_model, "backend": {
            "openai": b.openai, "model": self.remote_model, "api_key_env": b.api_key_env}}


def _count(value, default: int) -> int:
    """A usage count as the endpoint reported it, if it is a sane one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40 else default


def _add_call_delta(calls: dict[int, dict], tc: dict) -> None:
    """Merge one streamed ``tool_calls`` delta (the name comes once, the arguments in pieces)."""
    slot = calls.setdefault(int(tc.get("index") or 0), {"name": "", "arguments": ""})
    fn = tc.get("function") or {}
    if fn.get("name"):
        slot["name"] += fn["name"]
    if fn.get("arguments"):
        args = fn["arguments"]
        slot["arguments"] += args if isinstance(args, str) else json.dumps(args)


def _sampling_fields(p: SamplingParams) -> dict:
    """The sampling parameters in the OpenAI API's names; the ones beyond it (vLLM's and SITS's) only
    when they differ from their neutral value, so an endpoint that does not know them is not sent them."""
    out: dict = {"temperature": p.temperature}
    if p.top_p != 1.0:
        out["top_p"] = p.top_p
    if p.seed is not None:
        out["seed"] = p.seed
    if p.stop:
        out["stop"] = list(p.stop)
    if p.presence_penalty:
        out["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        out["frequency_penalty"] = p.frequency_penalty
    if p.top_k:
        out["top_k"] = p.top_k
    if p.min_p:
        out["min_p"] = p.min_p
    if p.repetition_penalty != 1.0:
        out["repetition_penalty"] = p.repetition_penalty
    if p.ignore_eos:
        out["ignore_eos"] = True
    return out
