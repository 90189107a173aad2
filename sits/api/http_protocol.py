"""uvicorn's httptools protocol with the two limits it lacks (a deadline for the request head and a
cap on its size) and a response head that leaves with the first body bytes.

Stock uvicorn arms a timer only after a response (keep-alive), so a client that opens a
connection and trickles its headers one byte at a time (slowloris), or never sends any, holds it
forever; and httptools accepts a request head of any size, which would let headers bypass the
body limit. Here every connection must deliver a complete head within ``header_timeout_s``
(else 408 and close) of no more than ``max_header_bytes`` (else 431 and close).

uvicorn writes a response's status line and headers the moment the app starts the response, and
the body in a second write. A streamed answer starts when its first token exists, so both writes
come in the same event-loop turn, yet the client wakes for the head alone, parses it and sleeps
again before the token arrives (and on a busy host that wake-up can take the core the server is
using). ``_HeadWithBody`` holds the head until the next write or the end of the loop turn,
whichever is first, so it never waits longer than the turn it was written in.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sits.api.errors import error_body


class _HeadRejected(Exception):
    pass


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, status, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class _HeadWithBody:
    """One response's transport: its first write (the head) is held until the next write or the end
    of the current loop turn; everything else is the transport's own."""

    __slots__ = ("_transport", "_loop", "_held", "_first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self._flush)
        elif self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held + data)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._raw_head = 0
        self._rejected = False
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _reject(self, data: bytes) -> None:
        self._rejected = True
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(data)
            self.transport.close()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:      # no request in flight on it
            self._reject(_response(408, "Request Timeout",
                                   f"the request head did not arrive within {self.header_timeout_s:g} s",
                                   "request_timeout"))

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_header_bytes:
            self._reject(_response(431, "Request Header Fields Too Large",
                                   f"the request head exceeds {self.max_header_bytes} bytes", "headers_too_large"))
            raise _HeadRejected()

    # -- parser callbacks -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        in_head = self._head_timer is not None
        super().data_received(data)
        # httptools buffers an unfinished header line without calling back: count raw bytes too, and
        # refuse a head still incomplete past the cap (bytes after a completed head are body, not head)
        if in_head and not self._rejected:
            self._raw_head += len(data)
            if self._head_timer is not None and self._raw_head > self.max_header_bytes:
                self._reject(_response(431, "Request Header Fields Too Large",
                                       f"the request head exceeds {self.max_header_bytes} bytes", "headers_too_large"))
        if self._head_timer is None:
            self._raw_head = 0

    def send_400_response(self, msg: str) -> None:
        if not self._rejected:            # a rejected head raised out of the parser: already answered
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _HeadWithBody(self.transport, self.loop)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()            # idle between requests is uvicorn's keep-alive timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[GuardedHttpProtocol]:
    """A protocol class with these limits (uvicorn takes a class, one per server)."""
    return type("SitsHttpProtocol", (GuardedHttpProtocol,), {"header_timeout_s": header_timeout_s,
                                                             "max_header_bytes": max_header_bytes})
