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
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.backend import Backend
from sits.api.context import accepted_at, context_of, new_request_id
from sits.api.errors import ModelNotFoundError, clip, error_docs, error_response, sits_error_as_dict
from sits.api.generation import Generation
from sits.api.openai.chunks import ChatChunks, Chunks, CompletionChunks
from sits.api.openai.structured import chat_guidance
from sits.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                               CompletionResponse, ModelCard, ModelList)
from sits.api.session import SessionTurn
from sits.api.shaping import default_max_tokens, sampling_params, shape_chat
from sits.api.sse import SSE_DONE, ClientDisconnected, SSEResponse, sse_data, until_disconnect
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.messages import TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.runtime.message_unit import MessagePrompt, estimate_tokens
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


def _sampling(backend: Backend, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
              logprobs: int | None, grammar: str | None = None) -> SamplingParams:
    return sampling_params(max_tokens, defaults=backend.sampling_defaults, temperature=body.temperature,
                           top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                           stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                           logprobs=logprobs, grammar=grammar)


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


# -- routes ---------------------------------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList, tags=["openai"], responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_cards(context_of(request).registry))


def _cards(reg) -> list[ModelCard]:
    """The models the caller may call, each followed by its LoRA adapters (``<parent>:<adapter>``)."""
    visible = set(reg.visible())
    out = []
    for b in reg.all():
        if b.name not in visible:
            continue
        out.append(ModelCard(id=b.name, created=b.created, max_model_len=b.max_model_len, root=b.root))
        out += [ModelCard(id=f"{b.name}:{a['name']}", created=b.created, max_model_len=b.max_model_len,
                          root=a["path"], parent=b.name) for a in getattr(b, "adapters", None) or []]
    return out


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"], responses=ERRORS)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    cards = _cards(context_of(request).registry)
    for card in cards:
        if card.id == model_id:
            return card
    raise ModelNotFoundError(f"the model {clip(model_id)} does not exist; served: "
                             f"{', '.join(c.id for c in cards) or 'none'}", param="model")


@router.post("/v1/completions", response_model=CompletionResponse, tags=["openai"],
             responses={**ERRORS, 200: STREAM_DOC})
async def create_completion(body: CompletionRequest, request: Request):
    ctx = context_of(request)
    backend = ctx.registry.get(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError(
            f"best_of ({body.best_of}) must be at least n ({body.n})" if body.best_of < body.n else
            f"best_of > n is not supported (best_of={body.best_of}, n={body.n}): ask for n choices instead",
            param="best_of", code="invalid_parameter" if body.best_of < body.n else "unsupported_parameter")
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs would need the prompt's logprobs, which SITS does not "
                                  "compute; ask for one or the other", param="echo", code="unsupported_parameter")
    max_tokens = body.max_tokens
    prompts = completion_prompts(body, backend)
    remote = backend.features.message_prompts
    if remote and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequestError(f"{backend.name} takes text prompts, not token ids: the model it reaches has a "
                                  "vocabulary of its own", param="prompt", code="token_prompt_unsupported")
    echo = [p if isinstance(p, str) else backend.tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts] if body.echo else None
    jobs = []
    for p in prompts:
        if max_tokens is None and isinstance(p, str) and not remote:
            # tokenized once: its length sets the default max_tokens
            p = backend.tokenizer.encode(p, add_special_tokens=body.add_special_tokens,
                                         max_tokens=backend.max_model_len)
        mt = max_tokens if max_tokens is not None else \
            default_max_tokens(backend, estimate_tokens(p) if remote else len(p))
        jobs.append((p, _sampling(backend, body, mt, body.logprobs)))
    rid = new_request_id()
    gen = Generation(backend, ctx.metrics, ctx.inflight, rid, jobs, n=body.n, priority=body.priority,
                     interactive=True, accepted_at=accepted_at(request), add_special_tokens=body.add_special_tokens)
    return await _respond(request, gen, CompletionChunks(f"cmpl-{rid}", backend, gen, body, echo=echo))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"],
             responses={**ERRORS, 200: STREAM_DOC})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    ctx = context_of(request)
    backend = ctx.registry.get(body.model)
    turn = SessionTurn.of(ctx)          # X-Session-ID: the stored conversation goes in front
    rid = new_request_id()
    guidance = chat_guidance(body)
    shaped = await shape_chat(ctx, backend, [m.as_dict() for m in body.messages], turn=turn,
                              memory_ref=body.memory_ref, response_id=f"chatcmpl-{rid}",
                              tools=guidance.tools or None, add_generation_prompt=body.add_generation_prompt,
                              add_special_tokens=body.add_special_tokens)
    ids = shaped.prompt
    if isinstance(ids, MessagePrompt):      # the endpoint enforces tools and the answer's format itself
        fmt = body.response_format
        ids = ids.with_guidance(guidance.choice if guidance.tools else None,
                                fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else None,
                                body.parallel_tool_calls)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens(backend, len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs",
                                  code="invalid_parameter")
    params = _sampling(backend, body, max_tokens, logprobs, guidance.grammar)
    try:
        gen = Generation(backend, ctx.metrics, ctx.inflight, rid, [(ids, params)],
                         n=body.n, priority=body.priority, interactive=True, accepted_at=accepted_at(request))
    except InvalidRequestError as e:
        if e.code == "invalid_grammar":      # the grammar is ours; what the client sent is its source
            e.param = "tools" if guidance.calls_tools else "response_format"
        raise
    chunks = ChatChunks(f"chatcmpl-{rid}", backend, gen, body, guidance)
    chunks.citations = shaped.citations
    return await _respond(request, gen, chunks, turn)


# -- running ----------------------------------------------------------------------------------------
def _trace_request(gen: Generation, chunks: Chunks) -> None:
    if tracing.current_scope.get() is None:
        return
    body = chunks.body
    tracing.annotate({genai.OPERATION: "chat" if isinstance(body, ChatCompletionRequest) else "text_completion",
                      genai.PROVIDER_NAME: genai.PROVIDER, genai.REQUEST_MODEL: body.model or chunks.backend.name,
                      genai.REQUEST_MAX_TOKENS: gen.seqs[0].params.max_tokens, genai.REQUEST_TEMPERATURE: body.temperature,
                      genai.REQUEST_TOP_P: body.top_p, genai.REQUEST_SEED: body.seed,
                      genai.REQUEST_CHOICES: body.n if body.n != 1 else None,
                      genai.LEVEL: "L1" if body.stream else "L2", "sits.stream": bool(body.stream)})


def _trace_response(gen: Generation, chunks: Chunks) -> None:
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


async def _respond(request: Request, gen: Generation, chunks: Chunks, turn: SessionTurn | None = None):
    """Stream the generation as SSE, or run it to the end and answer one JSON body."""
    warning = chunks.body.warning_header()
    _trace_request(gen, chunks)
    if chunks.body.stream:
        return await _stream(request, gen, chunks, warning, turn)
    await run_to_end(request, gen)
    _trace_response(gen, chunks)
    await _remember(turn, gen)
    out = {"id": chunks.cid, "object": chunks.response_object, "created": int(time.time()),
           "model": chunks.backend.name, "choices": [chunks.final_choice(ch) for ch in gen.choices],
           "usage": gen.usage()}
    if chunks.citations:
        out["citations"] = chunks.citations
    return JSONResponse(out, headers=response_headers(gen, warning) | (turn.headers() if turn else {}))


async def run_to_end(request: Request, gen: Generation) -> None:
    """A non-streamed request: run to the end, aborting it if the client goes away meanwhile."""
    try:
        await until_disconnect(request, gen.run())
    except ClientDisconnected:
        raise _Gone("the client disconnected before the response was ready") from None


class _Gone(SitsError):
    """Client disconnected; nobody reads the answer (499 in the access log)."""

    code = "client_disconnected"
    http_status = 499


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


async def open_events(request: Request, gen: Generation) -> tuple[AsyncIterator[tuple[int, TokenEvent]],
                                                                  tuple[int, TokenEvent] | None]:
    """The generation's events and its first one: a stream answers once its first token exists, so an
    error before it is still a proper 4xx/5xx rather than a broken stream."""
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
    return events, first


async def from_first(first: tuple[int, TokenEvent] | None, events: AsyncIterator[tuple[int, TokenEvent]],
                     ) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events ``open_events`` opened, its first one again in front."""
    if first is not None:
        yield first
    async for item in events:
        yield item


async def _stream(request: Request, gen: Generation, chunks: Chunks, ignored: str | None,
                  turn: SessionTurn | None = None) -> SSEResponse:
    events, first = await open_events(request, gen)
    meta = _Meta(gen) if wants_stream_meta(request) else None
    headers = response_headers(gen, ignored) | (turn.headers() if turn else {})
    return SSEResponse(_sse_body(gen, events, first, chunks, meta, turn), headers=headers)


async def _sse_body(gen: Generation, events: AsyncIterator[tuple[int, TokenEvent]],
                    first: tuple[int, TokenEvent] | None, chunks: Chunks, meta: _Meta | None,
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
        async for i, ev in from_first(first, events):
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
