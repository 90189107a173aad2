"""The OpenAI dialect: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

A request is validated and tokenized completely before anything is queued, so bad input is a 4xx
with the OpenAI error body. A streamed response starts once the first token exists: its headers
then carry a true ``server-timing`` (validate, queue, prefill), and an engine error before the first
token is still a proper 4xx instead of a broken stream. After that, chunks follow the OpenAI wire
format exactly (role chunk, deltas, finish chunk, optional usage chunk, ``data: [DONE]``).
``X-SITS-Stream-Meta: 1`` adds ``"sits": {"seq", "stage", "delay_us"}`` to every chunk.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.backend import Backend
from sits.api.context import accepted_at, context_of, new_request_id
from sits.api.errors import error_docs, error_response, sits_error_as_dict
from sits.api.generation import ChoiceResult, Generation
from sits.api.openai.structured import Guidance, ToolCallStream, assistant_message, chat_guidance
from sits.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                               CompletionResponse, ModelCard, ModelList)
from sits.api.retrieval import last_user_text, recall, with_context
from sits.api.session_routes import SessionTurn
from sits.api.sse import SSE_DONE, ClientDisconnected, SSEResponse, sse_data, until_disconnect
from sits.engine.errors import ContextLengthExceededError, InvalidRequestError, SitsError
from sits.engine.messages import TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.engine.tool_format import ToolSpec
from sits.observe import genai, tracing

router = APIRouter()

ERRORS = error_docs({
    400: "invalid request (OpenAI error body)",
    401: "missing or wrong API key",
    404: "unknown model",
    409: "conflict",
    413: "request body too large",
    503: "not ready or shutting down",
})
STREAM_DOC = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                                "description": "with stream=true: SSE chunks, then data: [DONE]"}}}


# -- request -> engine jobs -------------------------------------------------------------------------
def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None, grammar: str | None = None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, grammar=grammar)


def default_max_tokens(backend: Backend, prompt_len: int) -> int:
    """What ``max_tokens: null`` means: the rest of the context (and of the KV pool)."""
    room = min(backend.max_model_len, backend.kv_capacity_tokens) - prompt_len
    if room < 1:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {backend.max_model_len} tokens and the prompt has "
            f"{prompt_len}: no room is left for output", param="messages")
    return room


MAX_SEQUENCES_PER_REQUEST = 256     # prompts x n: one request cannot flood the engine queue


def completion_prompts(req: CompletionRequest, backend: Backend) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if len(p) * req.n > MAX_SEQUENCES_PER_REQUEST:
        raise InvalidRequestError(f"{len(p)} prompts x n={req.n} is {len(p) * req.n} sequences; at most "
                                  f"{MAX_SEQUENCES_PER_REQUEST} per request", param="prompt",
                                  code="too_many_sequences")
    if all(isinstance(x, str) for x in p):
        return list(p)
    return [list(x) for x in p]


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    return [m.as_dict() for m in req.messages]


def chat_prompt_ids(messages: list[dict], backend: Backend, add_generation_prompt: bool = True,
                    tools: list[ToolSpec] | None = None) -> list[int]:
    if len(messages) > backend.max_model_len:     # every message renders to a token at least
        raise ContextLengthExceededError(f"{len(messages)} messages cannot fit in this model's "
                                         f"{backend.max_model_len} tokens", param="messages")
    text = backend.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    ids = backend.tokenizer.encode(text, max_tokens=backend.max_model_len)
    if not ids:
        raise InvalidRequestError("the rendered conversation is empty", param="messages", code="empty_prompt")
    return ids


# -- headers --------------------------------------------------------------------------------------
def response_headers(gen: Generation, warning: str | None) -> dict[str, str]:
    t = gen.timings_ms()
    parts = [f"{k};dur={v}" for k in ("validate", "queue", "prefill", "decode", "total")
             if (v := t.get(k)) is not None]
    h = {"server-timing": ", ".join(parts)}
    if warning:
        h["warning"] = warning
    return h


def wants_stream_meta(request: Request) -> bool:
    return request.headers.get("x-sits-stream-meta", "").strip().lower() in ("1", "true", "yes", "on")


# -- logprobs -------------------------------------------------------------------------------------
def _token_text(backend: Backend, tid: int) -> str:
    return backend.tokenizer.decode([tid], skip_special_tokens=False)


def completion_logprobs(backend: Backend, ch: ChoiceResult, start: int = 0, offset0: int = 0,
                        events: list[TokenEvent] | None = None) -> dict[str, Any]:
    ids = ch.token_ids[start:]
    lps = ch.logprobs[start:]
    tops = ch.top_logprobs[start:]
    tokens = [_token_text(backend, t) for t in ids]
    offsets, pos = [], offset0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = None
    if any(t is not None for t in tops):
        top = [None if t is None else {_token_text(backend, i): lp for i, lp in t} for t in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(backend: Backend, ch: ChoiceResult, start: int = 0) -> dict[str, Any]:
    content = []
    for tid, lp, top in zip(ch.token_ids[start:], ch.logprobs[start:], ch.top_logprobs[start:]):
        tok = _token_text(backend, tid)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": (tt := _token_text(backend, i)), "logprob": v,
                                          "bytes": list(tt.encode())} for i, v in (top or [])]})
    return {"content": content}


# -- routes ---------------------------------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList, tags=["openai"], responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    reg = context_of(request).registry
    return ModelList(data=[ModelCard(id=b.name, created=b.created, max_model_len=b.max_model_len, root=b.root)
                           for b in reg.all()])


@router.post("/v1/completions", response_model=CompletionResponse, tags=["openai"],
             responses={**ERRORS, 200: STREAM_DOC})
async def create_completion(body: CompletionRequest, request: Request):
    ctx = context_of(request)
    backend = ctx.registry.get(body.model)
    max_tokens = body.max_tokens
    prompts = completion_prompts(body, backend)
    jobs = []
    for p in prompts:
        if max_tokens is None and isinstance(p, str):
            p = backend.tokenizer.encode(p)      # tokenized once: its length sets the default max_tokens
        mt = max_tokens if max_tokens is not None else default_max_tokens(backend, len(p))
        jobs.append((p, sampling_params(body, mt, body.logprobs)))
    rid = new_request_id()
    gen = Generation(backend, ctx.metrics, ctx.inflight, rid, jobs, n=body.n, priority=body.priority,
                     interactive=True, accepted_at=accepted_at(request))
    return await _respond(request, gen, _CompletionChunks(f"cmpl-{rid}", backend, gen, body))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"],
             responses={**ERRORS, 200: STREAM_DOC})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    ctx = context_of(request)
    backend = ctx.registry.get(body.model)
    messages = chat_messages(body)
    turn = SessionTurn.of(ctx)
    if turn is not None:            # X-Session-ID: the stored conversation goes in front
        messages = await turn.conversation(messages)
    rid = new_request_id()
    citations: list[dict] = []
    set_name = body.memory_ref or backend.features.memory_set    # a RAG unit retrieves by itself
    if set_name is not None:             # retrieved context first
        citations, context = await recall(ctx, set_name, last_user_text(messages), f"chatcmpl-{rid}",
                                          backend.features.memory_top_k,
                                          required=body.memory_ref is not None)
        if context:
            messages = with_context(messages, context)
    guidance = chat_guidance(body)
    ids = chat_prompt_ids(messages, backend, body.add_generation_prompt, guidance.tools or None)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens(backend, len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs",
                                  code="invalid_parameter")
    params = sampling_params(body, max_tokens, logprobs, guidance.grammar)
    try:
        gen = Generation(backend, ctx.metrics, ctx.inflight, rid, [(ids, params)],
                         n=body.n, priority=body.priority, interactive=True, accepted_at=accepted_at(request))
    except InvalidRequestError as e:
        if e.code == "invalid_grammar":      # the grammar is ours; what the client sent is its source
            e.param = "tools" if guidance.calls_tools else "response_format"
        raise
    chunks = _ChatChunks(f"chatcmpl-{rid}", backend, gen, body, guidance)
    chunks.citations = citations
    return await _respond(request, gen, chunks, turn)


# -- running ----------------------------------------------------------------------------------------
def _trace_request(gen: Generation, chunks: "_Chunks") -> None:
    if tracing.current_scope.get() is None:
        return
    body = chunks.body
    tracing.annotate({genai.OPERATION: "chat" if isinstance(body, ChatCompletionRequest) else "text_completion",
                      genai.PROVIDER_NAME: genai.PROVIDER, genai.REQUEST_MODEL: body.model or chunks.backend.name,
                      genai.REQUEST_MAX_TOKENS: gen.seqs[0].params.max_tokens, genai.REQUEST_TEMPERATURE: body.temperature,
                      genai.REQUEST_TOP_P: body.top_p, genai.REQUEST_SEED: body.seed,
                      genai.REQUEST_CHOICES: body.n if body.n != 1 else None,
                      genai.LEVEL: "L1" if body.stream else "L2", "sits.stream": bool(body.stream)})


def _trace_response(gen: Generation, chunks: "_Chunks") -> None:
    if tracing.current_scope.get() is None:
        return
    tracing.annotate({genai.RESPONSE_ID: chunks.cid, genai.RESPONSE_MODEL: chunks.backend.name,
                      genai.USAGE_INPUT: gen.prompt_tokens, genai.USAGE_OUTPUT: gen.completion_tokens,
                      genai.RESPONSE_FINISH_REASONS: [c.finish_reason or "abort" for c in gen.choices]})


async def _remember(turn: SessionTurn | None, gen: Generation) -> None:
    """A finished answer joins the session (choice 0: the conversation goes on from one answer)."""
    ch = gen.choices[0]
    if turn is not None and ch.finish_reason is not None:
        instance = gen.backend.session_instance(turn.session_id)
        await turn.remember("".join(ch.text), unit=gen.backend.name, instance=instance)


async def _respond(request: Request, gen: Generation, chunks: "_Chunks", turn: SessionTurn | None = None):
    """Stream the generation as SSE, or run it to the end and answer one JSON body."""
    warning = chunks.body.warning_header()
    _trace_request(gen, chunks)
    if chunks.body.stream:
        return await _stream(request, gen, chunks, warning, turn)
    await _run(request, gen)
    _trace_response(gen, chunks)
    await _remember(turn, gen)
    out = {"id": chunks.cid, "object": chunks.response_object, "created": int(time.time()),
           "model": chunks.backend.name, "choices": [chunks.final_choice(ch) for ch in gen.choices],
           "usage": gen.usage()}
    if chunks.citations:
        out["citations"] = chunks.citations
    return JSONResponse(out, headers=response_headers(gen, warning) | (turn.headers() if turn else {}))


async def _run(request: Request, gen: Generation) -> None:
    """A non-streamed request: run to the end, aborting it if the client goes away meanwhile."""
    try:
        await until_disconnect(request, gen.run())
    except ClientDisconnected:
        raise _Gone("the client disconnected before the response was ready") from None


class _Gone(SitsError):
    """Client disconnected; nobody reads the answer (499 in the access log)."""

    code = "client_disconnected"
    http_status = 499


class _Chunks(ABC):
    """One dialect's shapes: streamed chunks from merged (choice, event) pairs, and the final choices."""

    obj = ""                 # the "object" of a streamed chunk
    response_object = ""     # ... and of the non-streamed response

    def __init__(self, cid: str, backend: Backend, gen: Generation, body):
        self.cid, self.backend, self.gen, self.body = cid, backend, gen, body
        self.citations: list[dict] = []      # a RAG unit's retrieved memories (an extra field clients ignore)
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def base(self, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.cid, "object": self.obj, "created": self.created, "model": self.backend.name,
                "choices": choices}

    def opening(self) -> list[dict]:
        return []

    @abstractmethod
    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        """The chunk for one event of choice ``i``, or None when it carries nothing to show."""

    @abstractmethod
    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        """One choice of the non-streamed response."""

    def usage(self) -> dict:
        out = self.base([])
        out["usage"] = self.gen.usage()
        return out


class _CompletionChunks(_Chunks):
    obj = response_object = "text_completion"

    def __init__(self, *a):
        super().__init__(*a)
        self.offsets = [0] * len(self.gen.choices)

    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        return {"index": ch.index, "text": "".join(ch.text), "finish_reason": ch.finish_reason,
                "logprobs": completion_logprobs(self.backend, ch) if self.body.logprobs is not None else None}

    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished:
            return None
        ch = self.gen.choices[i]
        c: dict[str, Any] = {"index": i, "text": ev.text, "logprobs": None,
                             "finish_reason": ev.finish_reason if ev.finished else None}
        if self.body.logprobs is not None and ev.token_id is not None:
            c["logprobs"] = completion_logprobs(self.backend, ch, start=len(ch.token_ids) - 1,
                                                offset0=self.offsets[i])
        self.offsets[i] += len(ev.text)
        return self.base([c])


class _ChatChunks(_Chunks):
    obj = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, cid: str, backend: Backend, gen: Generation, body, guidance: Guidance):
        super().__init__(cid, backend, gen, body)
        self.guidance = guidance
        self.calls = [ToolCallStream(guidance) for _ in gen.choices] if guidance.calls_tools else None

    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        message, finish_reason, errors = assistant_message(self.guidance, "".join(ch.text), ch.finish_reason)
        out = {"index": ch.index, "message": message, "finish_reason": finish_reason,
               "logprobs": chat_logprobs(self.backend, ch) if self.body.logprobs else None}
        if errors:
            out["tool_call_errors"] = errors
        return out

    def opening(self) -> list[dict]:
        out = [self.base([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]) for c in self.gen.choices]
        if self.citations:
            out[0]["citations"] = self.citations
        return out

    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished:
            return None
        ch = self.gen.choices[i]
        text, finish_reason, delta, errors = ev.text, ev.finish_reason if ev.finished else None, {}, []
        if self.calls is not None:       # prose streams; calls are read whole at the end
            text = self.calls[i].feed(ev.text)
            if ev.finished:
                rest, calls, errors = self.calls[i].finish()
                text += rest
                if calls:
                    delta["tool_calls"] = calls
                    if finish_reason != "length":     # cut off by max_tokens stays "length"
                        finish_reason = "tool_calls"
            if not text and not delta and not ev.finished:
                return None
        if text:
            delta = {"content": text, **delta}
        c: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if errors:
            c["tool_call_errors"] = errors
        if self.body.logprobs and ev.token_id is not None:
            c["logprobs"] = chat_logprobs(self.backend, ch, start=len(ch.token_ids) - 1)
        return self.base([c])


class _Meta:
    """``"sits": {...}`` per chunk: which stage the time before this chunk went to, and how long."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.seq = 0
        self.prev: float | None = None

    def tag(self, chunk: dict, stage: str, delay_s: float, **extra: Any) -> dict:
        chunk["sits"] = {"seq": self.seq, "stage": stage, "delay_us": max(0, round(delay_s * 1e6)), **extra}
        self.seq += 1
        return chunk


async def _stream(request: Request, gen: Generation, chunks: _Chunks, ignored: str | None,
                  turn: SessionTurn | None = None) -> SSEResponse:
    events = gen.events()
    try:
        first = await until_disconnect(request, events.__anext__())
    except ClientDisconnected:
        await events.aclose()
        raise _Gone("the client disconnected before the response was ready") from None
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    meta = _Meta(gen) if wants_stream_meta(request) else None
    headers = response_headers(gen, ignored) | (turn.headers() if turn else {})
    return SSEResponse(_sse_body(gen, events, first, chunks, meta, turn), headers=headers)


async def _sse_body(gen: Generation, events: AsyncIterator[tuple[int, TokenEvent]],
                    first: tuple[int, TokenEvent] | None, chunks: _Chunks, meta: _Meta | None,
                    turn: SessionTurn | None = None) -> AsyncIterator[bytes]:
    prev_time: dict[int, float] = {}
    started = time.monotonic()
    error: str | None = None
    head = b""
    try:
        opening = chunks.opening()
        if meta is not None and first is not None:
            ev = first[1]
            sched = ev.first_scheduled_time or ev.arrival_time
            if not opening:   # completions have no role chunk: an empty one carries the queue stage
                opening = [chunks.base([{"index": 0, "text": "", "logprobs": None, "finish_reason": None}])]
            opening = [meta.tag(opening[0], "queue", sched - gen.accepted_at,
                                validate_us=round((gen.prepared_at - gen.accepted_at) * 1e6))] + [
                meta.tag(c, "queue", 0.0) for c in opening[1:]]
        # the opening chunks leave with the first token's (one write, one read for the client)
        head = b"".join(sse_data(c) for c in opening)
        pending = [first] if first is not None else []

        async def all_events():
            for item in pending:
                yield item
            async for item in events:
                yield item

        async for i, ev in all_events():
            c = chunks.delta(i, ev)
            if c is None:      # e.g. half a UTF-8 character, or a held tool call: nothing to show yet
                if head:       # ... but the client hears from the server now
                    yield head
                    head = b""
                continue
            if meta is not None:
                if i not in prev_time:
                    # the first visible token of this choice: its time since scheduling, and the engine's
                    # own time to it (the baseline a client subtracts to get the server's overhead)
                    sched = ev.first_scheduled_time or ev.arrival_time
                    meta.tag(c, "prefill", ev.time - sched, engine_ttft_us=round((ev.time - ev.arrival_time) * 1e6))
                else:
                    meta.tag(c, "decode", ev.time - prev_time[i])
            prev_time[i] = ev.time
            if head:
                yield head + sse_data(c)
                head = b""
            else:
                yield sse_data(c)
        if head:
            yield head
        if chunks.include_usage:
            u = chunks.usage()
            if meta is not None:
                meta.tag(u, "decode", 0.0)
            yield sse_data(u)
        await _remember(turn, gen)
    except SitsError as e:  # e.g. the server is draining: tell the client why the stream ends
        error = e.code
        yield head + sse_data({"error": sits_error_as_dict(e)})
    finally:
        await events.aclose()
        _trace_response(gen, chunks)
        tracing.stage("stream_out", started, time.monotonic(), level="L2", async_mechanism="stream", error=error,
                      attributes={"sits.chunks": meta.seq if meta is not None else None})
        if error is not None:
            tracing.mark_failed(error)
    yield SSE_DONE


__all__ = ["router", "error_response"]
