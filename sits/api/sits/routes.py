"""The SITS dialect: ``/v1/requests`` — submit now, follow the state machine, read the result later.

``POST`` answers ``202 PENDING`` at once; a background task then moves the request through
VALIDATING (unit, tools, memory, context length) and EXECUTING (the engine) to RESOLVED or
REJECTED. Type errors in the body are a synchronous 400 (nothing accepted); everything decided
after acceptance is a REJECTED state with a machine-readable code, never a lost request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.backend import Backend
from sits.api.context import ServerContext, accepted_at, context_of, new_request_id
from sits.api.errors import ConflictError, ModelNotFoundError, RequestNotFoundError, clip, error_docs
from sits.api.generation import Generation
from sits.api.metering import current_account
from sits.api.protocol import SitsRequest, SitsRequestView
from sits.api.retrieval import last_user_text
from sits.api.session import SessionTurn
from sits.api.shaping import sampling_params, shape_chat, shape_text
from sits.api.sits.lifecycle import RequestState
from sits.api.sits.request_store import RequestStore, TrackedRequest
from sits.api.sits.tool_loop import ToolLoop
from sits.api.sits.webhooks import WebhookDispatcher, validate_callback_url
from sits.api.sse import SSE_KEEPALIVE, SSEResponse, sse_event
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.sampling_params import SamplingParams
from sits.memory.vectors import off_loop
from sits.tenancy.accounts import RateLimitedError
from sits.tenancy.principal import current_principal, scoped
from sits.tools import ToolError
from sits.observe import genai, tracing

log = logging.getLogger("sits.api")
router = APIRouter(tags=["sits"])

ERRORS = error_docs({
    400: "invalid request body",
    401: "missing or wrong API key",
    404: "no such request",
    409: "the request is already terminal",
    413: "request body too large",
    429: "too many unfinished requests",
})


def _store(request: Request) -> RequestStore:
    return context_of(request).store  # type: ignore[return-value]


def _dispatcher(request: Request) -> WebhookDispatcher:
    return request.app.state.webhooks


@router.post("/v1/requests", status_code=202, response_model=SitsRequestView, responses=ERRORS)
async def submit(body: SitsRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of prompt or messages", param="prompt",
                                  code="invalid_parameter")
    if body.prompt is not None and not body.prompt:
        raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
    if body.unit is None and not ctx.registry.loading:
        body.unit = _default_unit(ctx)
    subscribers = [ctx.metrics.on_transition]
    rid = f"req_{new_request_id()}"
    t0 = accepted_at(request)
    # the work goes on after the 202: one live span across that boundary, every transition an event on it
    if tracing.current_scope.get() is not None:
        tracing.annotate({genai.LEVEL: "L3", genai.OPERATION: "chat" if body.messages is not None else "text_completion",
                          genai.REQUEST_MODEL: body.unit, genai.REQUEST_MAX_TOKENS: body.constraints.max_tokens,
                          "sits.request_id": rid})
    if body.callback_url is not None:
        validate_callback_url(body.callback_url, allow_private=ctx.settings.allow_private_callbacks)
    if body.remember and current_principal.get().tenant is not None and body.memory_ref is None:
        raise InvalidRequestError("remember with a tenant's key needs a memory_ref (a set of the tenant's own): "
                                  "a unit's shared set is not written by tenants", param="memory_ref",
                                  code="memory_ref_required")
    if (account := current_account.get()) is not None:     # a budget or limit already spent: 429 before the 202
        p = account.principal
        await account.tenancy.check(p, body.constraints.max_tokens)
        for kind, limit in account.tenancy.queue_limits(p):   # unfinished async requests wait in a queue too
            n = _store(request).unfinished_of(p.tenant, p.key_id if kind == "key" else None)
            if n >= limit:
                err = RateLimitedError(f"{kind} has {n} unfinished requests (max_queued {limit})",
                                       code="queue_limit_exceeded")
                err.retry_after_s = 1
                raise err
    # opened only once nothing can refuse the request any more (an unended span would hold its trace)
    execution = tracing.open_child("request.execute", t0, level="L3", async_mechanism="queue",
                                   attributes={"sits.request_id": rid, genai.REQUEST_MODEL: body.unit})
    if execution is not None:
        subscribers.append(lambda ev: execution.span.add_event(ev.state.value,
                                                               timestamp=tracing.wall_ns(time.monotonic())))
    if body.callback_url is not None:
        subscribers.append(_dispatcher(request).subscriber(
            rid, body.callback_url, trace=execution, traceparent=request.scope.get("state", {}).get("sits_traceparent")))
    try:
        tr = _store(request).create(rid, body.unit, subscribers)
    except BaseException:
        tracing.close(execution)          # refused (e.g. 429): the root span says why
        raise
    tr.trace = execution
    tr.task = asyncio.get_running_loop().create_task(_execute(ctx, tr, body, t0), name=f"sits-request-{rid}")
    headers = {"location": f"/v1/requests/{rid}"}
    if (warning := body.warning_header()) is not None:
        headers["warning"] = warning
    return JSONResponse(tr.view(), status_code=202, headers=headers)


@router.get("/v1/requests/{request_id}", response_model=SitsRequestView, responses=ERRORS)
async def get_request(request_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_store(request).get(request_id).view())


@router.get("/v1/requests/{request_id}/events", responses={
    **ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                    "description": "SSE: `event: state` (transitions) and `event: delta` (tokens), "
                                   "each with an `id:`; resumable with Last-Event-ID"}})
async def follow_request(request_id: str, request: Request, last_event_id: int | None = None):
    tr = _store(request).get(request_id)
    header = request.headers.get("last-event-id")
    after = last_event_id or 0
    if header is not None:
        try:
            after = int(header.strip())
        except ValueError:
            raise InvalidRequestError("Last-Event-ID must be an event id (an integer)", param="Last-Event-ID",
                                      code="invalid_parameter") from None

    async def body():
        async for ev in tr.follow(after):
            yield SSE_KEEPALIVE if ev is None else sse_event(ev.data, event_id=ev.id, event=ev.kind)

    return SSEResponse(body())


@router.delete("/v1/requests/{request_id}", response_model=SitsRequestView, responses=ERRORS)
async def cancel_request(request_id: str, request: Request) -> JSONResponse:
    tr = _store(request).get(request_id)
    if tr.lifecycle.terminal:
        raise ConflictError(f"request {request_id} is already {tr.state.value}; nothing to cancel",
                            param="id", code="request_terminal")
    tr.cancel_reason = ("cancelled", "cancelled by the client (DELETE)")
    if tr.task is not None:
        tr.task.cancel()
        await asyncio.wait([tr.task])
    tr.lifecycle.reject(*tr.cancel_reason)
    return JSONResponse(tr.view())


def _default_unit(ctx: ServerContext) -> str:
    """The unit a request that names none runs on, decided before the 202: a request that could run
    nowhere is refused now, not REJECTED once polled (the OpenAI dialect answers ``model`` at once too)."""
    try:
        return ctx.registry.default_name()
    except InvalidRequestError:
        served = sorted(ctx.registry.visible())
        raise InvalidRequestError(f"name a unit: this server runs {len(served)} ({', '.join(served)}) and cannot "
                                  "pick one" if served else "name a unit: no unit is deployed", param="unit",
                                  code="unit_required") from None


# -- execution ------------------------------------------------------------------------------------
def _sampling(backend: Backend, body: SitsRequest, max_tokens: int) -> SamplingParams:
    return sampling_params(max_tokens, defaults=backend.sampling_defaults, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed, stop=body.stop)


@dataclass(slots=True)
class _Plan:
    """What VALIDATING decided: where the request runs and what the model reads."""

    backend: Backend
    prompt: str | list[int]                 # with a tool loop: its first step's prompt
    messages: list[dict] | None
    params: SamplingParams
    citations: list[dict]
    tools: ToolLoop | None = None
    tool_choice: str = "auto"


async def _validate(ctx: ServerContext, body: SitsRequest, turn: SessionTurn | None, tr: TrackedRequest,
                    t0: float) -> _Plan:
    """VALIDATING: unit, tools, memory, context. Raises SitsError (-> REJECTED with its code).
    With a session, the stored conversation goes in front (a bare prompt is then a user turn); with
    a ``memory_ref``, the set's closest memories go in front of the question, recorded as retrieved;
    with ``allowed_tools``, the runtime's tool loop will run the model's calls."""
    rid = tr.id
    try:
        backend = ctx.registry.get(body.unit)
    except ModelNotFoundError as e:
        raise InvalidRequestError(e.message, param="unit", code="unit_not_found") from None
    loop, choice = None, body.tool_choice
    if body.allowed_tools:
        unit_tools = list(backend.features.tools)
        if not unit_tools:
            raise InvalidRequestError(f"unit {backend.name!r} declares no tools; requested: "
                                      f"{clip(', '.join(body.allowed_tools), 200)}", param="allowed_tools",
                                      code="tool_not_allowed")
        try:
            contracts = ctx.tools.allowed(body.allowed_tools, unit_tools)
            loop = ToolLoop(ctx, backend, contracts, tr, priority=body.constraints.priority,
                            interactive=body.interactive, accepted_at=t0)
            choice = loop.first_choice(body.tool_choice)
        except ToolError as e:
            raise InvalidRequestError(f"unit {backend.name!r}: {e.message}", param="allowed_tools",
                                      code=e.code) from None
    params = _sampling(backend, body, body.constraints.max_tokens)
    if body.messages is None and turn is None and loop is None:
        shaped = await shape_text(ctx, backend, body.prompt or "", memory_ref=body.memory_ref, response_id=rid)
        return _Plan(backend, shaped.prompt, None, params, shaped.citations)
    messages = ([m.as_dict() for m in body.messages] if body.messages is not None
                else [{"role": "user", "content": body.prompt or ""}])
    shaped = await shape_chat(ctx, backend, messages, turn=turn, memory_ref=body.memory_ref, response_id=rid,
                              tools=loop.specs if loop else None)
    if loop is not None:     # the first step's prompt must fit; later steps are checked as they come
        backend.prepare(shaped.prompt, params, request_id=f"{rid}.check", priority=body.constraints.priority)
    return _Plan(backend, shaped.prompt, shaped.messages, params, shaped.citations, loop, choice)


async def _execute(ctx: ServerContext, tr: TrackedRequest, body: SitsRequest, t0: float) -> None:
    tracing.current_scope.set(tr.trace)       # this task's stages are children of the execution span
    try:
        await _run_request(ctx, tr, body, t0)
    finally:
        if tr.trace is not None:
            err = tr.error or {}
            code = err.get("code") if tr.lifecycle.state is RequestState.REJECTED else None
            if code is not None:
                tr.trace.span.set_attribute("sits.rejected_code", code)
            server_side = code is not None and code not in ("cancelled", "unit_not_found", "tool_not_allowed",
                                                             "memory_not_found") and not code.startswith("invalid")
            tracing.annotate({genai.USAGE_INPUT: (tr.usage or {}).get("prompt_tokens"),
                              genai.USAGE_OUTPUT: (tr.usage or {}).get("completion_tokens"),
                              genai.RESPONSE_FINISH_REASONS: [tr.finish_reason] if tr.finish_reason else None,
                              "sits.state": tr.lifecycle.state.value}, tr.trace)
            tracing.close(tr.trace, error=code if server_side else None)


async def _run_request(ctx: ServerContext, tr: TrackedRequest, body: SitsRequest, t0: float) -> None:
    lc = tr.lifecycle
    timeout_ms = body.constraints.timeout_ms
    deadline = None if timeout_ms is None else t0 + timeout_ms / 1e3
    gen: Generation | None = None
    plan: _Plan | None = None
    try:
        async with asyncio.timeout(None if deadline is None else deadline - time.monotonic()):
            lc.advance(RequestState.VALIDATING)
            turn = SessionTurn.of(ctx)
            plan = await _validate(ctx, body, turn, tr, t0)
            backend = plan.backend
            tr.citations = plan.citations
            if plan.tools is not None:
                lc.advance(RequestState.EXECUTING)
                answer = await plan.tools.run(plan.messages, plan.params, plan.tool_choice, body.max_tool_steps,
                                              first_ids=plan.prompt)
                gen = plan.tools.last
                tr.finish_reason = answer.finish_reason
                tr.usage = dict(plan.tools.usage)
            else:
                gen = Generation(backend, ctx.metrics, ctx.inflight, tr.id, [(plan.prompt, plan.params)],
                                 priority=body.constraints.priority, interactive=body.interactive, accepted_at=t0)
                lc.advance(RequestState.EXECUTING)
                async for _, ev in gen.events():
                    if ev.text:
                        tr.add_delta(ev.index, ev.text, ev.token_id)
                tr.finish_reason = gen.choices[0].finish_reason
                tr.usage = gen.usage()
            tr.timings = gen.timings_ms()
            if turn is not None:
                instance = backend.session_instance(turn.session_id)
                await turn.remember("".join(tr.output), unit=backend.name, instance=instance,
                                    memory_refs=[body.memory_ref] if body.memory_ref else None)
            if body.remember and (body.memory_ref or backend.features.memory_set) and ctx.memory is not None:
                shared = backend.features.memory_set
                target = shared if body.memory_ref is None or body.memory_ref == shared else scoped(body.memory_ref)
                written = await off_loop(
                    ctx.memory.add, target, [f"Q: {_question(body)}\nA: {''.join(tr.output)}"],
                    [{"request": tr.id}], response_id=scoped(tr.id))
                tr.memories_written = [f"m_{i}" for i in written]
            lc.advance(RequestState.RESOLVED, {"output": "".join(tr.output), "finish_reason": tr.finish_reason,
                                               "usage": tr.usage, "timings": tr.timings,
                                               **({"citations": tr.citations} if tr.citations else {}),
                                               **({"memories_written": tr.memories_written}
                                                  if tr.memories_written else {}),
                                               **({"tool_steps": tr.tool_steps} if tr.tool_steps else {})})
    except TimeoutError:
        _finish_timings(tr, gen, plan)
        lc.reject("timeout", f"timeout_ms={timeout_ms} ran out in {lc.state.value}")
    except asyncio.CancelledError:
        _finish_timings(tr, gen, plan)
        code, message = tr.cancel_reason or ("server_shutting_down", "the server shut down before the request ended")
        lc.reject(code, message)
        raise
    except SitsError as e:
        _finish_timings(tr, gen, plan)
        lc.reject(e.code, e.message, **({"param": e.param} if e.param else {}))
    except Exception as e:  # a bug: the request still ends, with a reason
        log.exception("request %s failed", tr.id)
        _finish_timings(tr, gen, plan)
        lc.reject("internal_error", f"internal error: {type(e).__name__}")


def _question(body: SitsRequest) -> str:
    """What retrieval searches for: the prompt, or the conversation's last user turn."""
    if body.messages is None:
        return body.prompt or ""
    return last_user_text([{"role": m.role, "content": m.text()} for m in body.messages])


def _finish_timings(tr: TrackedRequest, gen: Generation | None, plan: "_Plan | None" = None) -> None:
    if plan is not None and plan.tools is not None:
        gen = plan.tools.last
        tr.usage = dict(plan.tools.usage)
    if gen is not None:
        tr.timings = gen.timings_ms()
        if gen.choices and gen.choices[0].token_ids and (plan is None or plan.tools is None):
            tr.usage = gen.usage()


__all__ = ["router", "RequestNotFoundError"]
