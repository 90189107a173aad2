"""Server-sent events: the wire format both dialects stream in, and client-disconnect handling.

``SSEResponse`` closes its body generator as soon as the response ends for any reason (finished,
client gone, server error), so the engine request behind it is aborted and its KV blocks freed at
once rather than when the garbage collector gets to it. ``until_disconnect`` races an awaitable
against the client going away, for the waits before a response has started.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_data(obj: Any) -> bytes:
    """One ``data:`` event (compact UTF-8 JSON, as OpenAI clients parse it). orjson writes the same
    bytes as ``json.dumps(separators=(",", ":"), ensure_ascii=False)`` at a fifteenth of the cost;
    what it refuses (an integer past 64 bits) goes through ``json``."""
    try:
        body = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return b"data: " + body + b"\n\n"


def sse_event(data: Any, *, event_id: str | int | None = None, event: str | None = None) -> bytes:
    """A full event with optional ``id:`` (for Last-Event-ID resumption) and ``event:`` lines."""
    out = b""
    if event_id is not None:
        out += f"id: {event_id}\n".encode()
    if event is not None:
        out += f"event: {event}\n".encode()
    return out + sse_data(data)


SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse (so FastAPI returns it as it is) with a leaner ``__call__``.

    Starlette streams in an anyio task group beside a disconnect listener: two more tasks and a
    cancel scope before the first byte. Here the body is written from the calling task and one
    watcher task cancels it when the client goes away. Either way the body generator is closed
    when the response ends, so the engine request behind it is aborted at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], status_code: int = 200,
                 headers: dict[str, str] | None = None):
        super().__init__(content, status_code=status_code, headers={**SSE_HEADERS, **(headers or {})},
                         media_type=self.media_type)

    async def __call__(self, scope, receive, send) -> None:
        me = asyncio.current_task()
        gone = streaming = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            if streaming:          # a disconnect after the last chunk cancels nothing
                me.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            streaming = True
            body = aiter(self.body_iterator)
            # the head leaves with the first chunk (two writes in one turn): written alone, it wakes the
            # client for a read that has nothing to show yet
            first = await anext(body, None)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in body:
                    if gone:
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # the watcher's cancel is spent: the client is gone, nothing to send; any other cancel stands
            if not gone or me.uncancel() > 0:
                raise
            streaming = False
        finally:
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if self.background is not None and not gone:
            await self.background()


class ClientDisconnected(Exception):
    """The client went away before the response started."""


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` in this task; if the client disconnects first, cancel it and raise ClientDisconnected.

    The watcher is a side task that cancels this one, so the awaited result reaches the caller with no
    extra task hop (each hop is an event-loop turn, and a turn can wait on the engine thread's GIL).
    """
    me = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                me.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await aw
    except asyncio.CancelledError:
        if gone:
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
