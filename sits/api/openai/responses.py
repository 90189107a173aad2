"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: the Responses API.

A request runs through the same pipeline as a chat completion (its items read as chat messages,
the same template, tools and JSON grammars, sampling defaults and validation); what differs is the
answer: typed output items (an assistant ``message`` with ``output_text``, ``function_call``
items) and, streamed, the API's typed events (``response.created`` … ``response.output_text.delta``
… ``response.completed``), each with its ``sequence_number``. As in chat, a stream answers once
the first token exists, and function calls are read whole once the answer has ended.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.backend import Backend
from sits.api.context import ServerContext, accepted_at, context_of, new_request_id
from sits.api.errors import clip, sits_error_as_dict
from sits.api.generation import Generation
from sits.api.openai.chunks import chat_logprobs
from sits.api.openai.response_store import ResponseStore
from sits.api.openai.responses_protocol import ResponsesRequest, input_messages
from sits.api.openai.routes import ERRORS, from_first, open_events, response_headers, run_to_end
from sits.api.openai.structured import Guidance, ToolCallStream, make_guidance, tool_specs
from sits.api.shaping import default_max_tokens, sampling_params, shape_chat
from sits.runtime.message_unit import MessagePrompt
from sits.api.sse import SSEResponse, sse_event
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.messages import TokenEvent

router = APIRouter()

STREAM_DOC = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                                "description": "with stream=true: typed response.* events"}}}


_CHAT_FIELDS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input"}


class ResponseNotFoundError(SitsError):
    code = "response_not_found"
    http_status = 404


def response_store(ctx: ServerContext) -> ResponseStore:
    if ctx.responses is None:
        ctx.responses = ResponseStore()
    return ctx.responses


@router.post("/v1/responses", tags=["openai"], responses={**ERRORS, 200: STREAM_DOC})
async def create_response(body: ResponsesRequest, request: Request):
    ctx = context_of(request)
    body.check_supported()
    backend = ctx.registry.get(body.model)
    store = response_store(ctx)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise ResponseNotFoundError(f"no stored response {clip(body.previous_response_id)} (responses are kept "
                                        "in this server's memory, the newest 1024)", param="previous_response_id")
        history = previous.conversation
    new_input = input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    guidance = make_guidance(tool_specs(body.functions(), where="tools[{i}]"),
                             choice if isinstance(choice, str) or choice is None else choice.name,
                             fmt.type if fmt is not None else None, fmt.schema_ if fmt is not None else None,
                             parallel=body.parallel_tool_calls, format_param="text.format",
                             schema_param="text.format.schema")
    rid = new_request_id()
    try:
        shaped = await shape_chat(ctx, backend, system + history + new_input, turn=None, memory_ref=None,
                                  response_id=f"resp_{rid}", tools=guidance.tools or None)
        if isinstance(shaped.prompt, MessagePrompt):     # the endpoint enforces tools and the format itself
            shaped.prompt = shaped.prompt.with_guidance(guidance.choice if guidance.tools else None,
                                                        _chat_response_format(fmt), body.parallel_tool_calls)
        max_tokens = body.max_output_tokens or default_max_tokens(backend, len(shaped.prompt))
        logprobs = (body.top_logprobs or 0) if body.wants_logprobs else None
        params = sampling_params(max_tokens, defaults=backend.sampling_defaults, temperature=body.temperature,
                                 top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                                 repetition_penalty=body.repetition_penalty, logprobs=logprobs,
                                 grammar=guidance.grammar)
        gen = Generation(backend, ctx.metrics, ctx.inflight, rid, [(shaped.prompt, params)], n=1,
                         priority=body.priority, interactive=True, accepted_at=accepted_at(request))
    except InvalidRequestError as e:       # name this API's fields, not chat's
        if e.code == "invalid_grammar":
            e.param = "tools" if guidance.calls_tools else "text.format"
        elif e.param in _CHAT_FIELDS:
            e.param = _CHAT_FIELDS[e.param]
            e.message = e.message.replace("max_tokens", "max_output_tokens")
        raise
    answer = ResponseAnswer(f"resp_{rid}", body, backend, gen, guidance, history + new_input,
                            store if body.store else None)
    headers = response_headers(gen, body.warning_header())
    if body.stream:
        events, first = await open_events(request, gen)
        return SSEResponse(answer.stream(events, first), headers=headers)
    await run_to_end(request, gen)
    return JSONResponse(answer.finish(answer.output_items("".join(gen.choices[0].text))), headers=headers)


@router.get("/v1/responses/{response_id}", tags=["openai"], responses=ERRORS)
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    stored = response_store(context_of(request)).get(response_id)
    if stored is None:
        raise ResponseNotFoundError(f"no stored response {clip(response_id)}", param="response_id")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", tags=["openai"], responses=ERRORS)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not response_store(context_of(request)).delete(response_id):
        raise ResponseNotFoundError(f"no stored response {clip(response_id)}", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class ResponseAnswer:
    """One response: its object at each status, its output items, and its streamed events."""

    def __init__(self, response_id: str, body: ResponsesRequest, backend: Backend, gen: Generation,
                 guidance: Guidance, conversation: list[dict[str, Any]], store: ResponseStore | None):
        self.id, self.body, self.backend, self.gen, self.guidance = response_id, body, backend, gen, guidance
        self.conversation, self.store = conversation, store
        self.created_at = int(time.time())
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.seq = 0
        self.tool_call_errors: list[dict] = []

    # -- the response object --------------------------------------------------------------------
    def snapshot(self, status: str, output: list[dict], error: dict | None = None) -> dict[str, Any]:
        b, params = self.body, self.gen.seqs[0].params
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        choice = b.tool_choice
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "background": False, "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.backend.name,
               "output": output, "parallel_tool_calls": b.parallel_tool_calls,
               "previous_response_id": b.previous_response_id, "reasoning": None, "store": b.store,
               "temperature": params.temperature, "text": {"format": fmt},
               "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
               else (choice or ("auto" if b.tools else "none")),
               "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "top_p": params.top_p,
               "top_logprobs": b.top_logprobs, "truncation": "disabled", "usage": None, "user": b.user,
               "metadata": b.metadata or {}}
        if status in ("completed", "incomplete"):
            g = self.gen
            out["usage"] = {"input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_tokens},
                            "output_tokens": g.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": g.prompt_tokens + g.completion_tokens}
            if g.meter is not None:                 # a server that keeps tenants: what it cost (as in chat)
                out["usage"]["sits"] = g.usage()["sits"]
            if self.tool_call_errors:
                out["tool_call_errors"] = self.tool_call_errors
        return out

    @property
    def status(self) -> str:
        return "incomplete" if self.gen.choices[0].finish_reason == "length" else "completed"

    def message_item(self, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part] if status != "in_progress" else []}

    def call_item(self, k: int, call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": f"fc_{self.id.removeprefix('resp_')}_{k}", "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments,
                "status": "completed" if arguments is None else "in_progress"}

    def _logprobs(self) -> list | None:
        return chat_logprobs(self.backend, self.gen.choices[0])["content"] if self.body.wants_logprobs else None

    def output_items(self, text: str) -> list[dict[str, Any]]:
        parsed = self.guidance.parse(text)
        self.tool_call_errors = parsed.errors
        items = [self.message_item(parsed.content, self.status, self._logprobs())] if parsed.content else []
        return items + [self.call_item(k, c.openai()) for k, c in enumerate(parsed.calls)]

    def finish(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final object; stored (with the conversation it ends) when the request asked to be."""
        response = self.snapshot(self.status, output)
        if self.store is not None:
            self.store.put(response, self.conversation + (input_messages(output) if output else []))
        return response

    # -- the stream -----------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(data, event=kind)

    async def stream(self, events: AsyncIterator[tuple[int, TokenEvent]],
                     first: tuple[int, TokenEvent] | None) -> AsyncIterator[bytes]:
        calls = ToolCallStream(self.guidance) if self.guidance.calls_tools else None
        text, deltas = "", []
        head = self.event("response.created", response=self.snapshot("in_progress", []))
        head += self.event("response.in_progress", response=self.snapshot("in_progress", []))
        ids = {"item_id": self.message_id, "output_index": 0}
        try:
            async for _, ev in from_first(first, events):
                piece = ev.text if calls is None else calls.feed(ev.text)
                if ev.finished and calls is not None:
                    rest, deltas, self.tool_call_errors = calls.finish()
                    piece += rest
                if piece:
                    if not text:
                        head += self.event("response.output_item.added", output_index=0,
                                           item=self.message_item("", "in_progress"))
                        head += self.event("response.content_part.added", **ids, content_index=0,
                                           part={"type": "output_text", "text": "", "annotations": []})
                    text += piece
                    lps = (chat_logprobs(self.backend, self.gen.choices[0], start=len(self.gen.choices[0].token_ids) - 1)
                           ["content"] if self.body.wants_logprobs and calls is None and ev.token_id is not None else [])
                    yield head + self.event("response.output_text.delta", **ids, content_index=0, delta=piece,
                                            logprobs=lps)
                    head = b""
                elif head:
                    yield head
                    head = b""
            output = []
            if text:
                item = self.message_item(text, self.status, self._logprobs() if calls is None else None)
                part = item["content"][0]
                head += self.event("response.output_text.done", **ids, content_index=0, text=text,
                                   logprobs=part.get("logprobs", []))
                head += self.event("response.content_part.done", **ids, content_index=0, part=part)
                head += self.event("response.output_item.done", output_index=0, item=item)
                output.append(item)
            for k, call in enumerate(deltas):
                at = len(output)
                added = self.call_item(k, call, arguments="")
                item = self.call_item(k, call)
                head += self.event("response.output_item.added", output_index=at, item=added)
                head += self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                   delta=item["arguments"])
                head += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                   name=item["name"], arguments=item["arguments"])
                head += self.event("response.output_item.done", output_index=at, item=item)
                output.append(item)
            response = self.finish(output)
            yield head + self.event(f"response.{response['status']}", response=response)
        except SitsError as e:      # e.g. the server is draining: the stream says why it ends
            error = sits_error_as_dict(e)
            yield head + self.event("response.failed", response=self.snapshot(
                "failed", [], {"code": error.get("code"), "message": error.get("message")}))
        finally:
            await events.aclose()


def _chat_response_format(fmt) -> dict | None:
    """This API's ``text.format`` in the chat API's ``response_format`` shape (what a remote endpoint takes)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}
