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

A response that closes the connection before the request body has all arrived (a 413 on its
Content-Length, a 408, ...) would, closed at once, make the kernel answer the rest of the upload
with a reset, and a client that writes its whole body before reading (urllib, requests, many
proxies) would see that reset instead of the response. So such a close lingers: the response and
a FIN go out, and what the client still sends is discarded unparsed (no pipelined request behind
it ever runs) until it closes, or ``linger_bytes`` / ``linger_s`` / ``linger_idle_s`` run out.
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

    __slots__ = ("_transport", "_loop", "_held", "_first", "_close")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, close=None):
        """``close``: how the response's close is done (default: the transport's own)."""
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True
        self._close = close or transport.close

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
        self._close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    # a closing response's unread upload: discarded up to this many bytes, for this long in all,
    # and while bytes keep coming (a gap this long ends it)
    linger_bytes: int = 64 << 20
    linger_s: float = 30.0
    linger_idle_s: float = 5.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._raw_head = 0
        self._rejected = False
        self._linger_timer: asyncio.TimerHandle | None = None
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

    def _close_after_response(self) -> None:
        """The close a ``Connection: close`` response asks for: lingering while the request body is
        still arriving, at once otherwise."""
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.response_complete or not cycle.more_body:
            self.transport.close()
            return
        self._rejected = True               # nothing more is parsed on this connection
        self._disarm()
        self._linger_left = self.linger_bytes
        self._linger_end = self.loop.time() + self.linger_s
        self._linger_last = self.loop.time()
        if self.transport.can_write_eof():
            self.transport.write_eof()      # the response is whole: a client reading until close sees its end
        self.flow.resume_reading()
        self._linger_check()

    def _linger_check(self) -> None:
        now = self.loop.time()
        until = min(self._linger_end, self._linger_last + self.linger_idle_s)
        if now >= until:
            self._linger_timer = None
            self.transport.close()
        else:
            self._linger_timer = self.loop.call_at(until, self._linger_check)

    # -- parser callbacks -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            self._linger_last = self.loop.time()
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
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
            self.cycle.transport = _HeadWithBody(self.transport, self.loop, self._close_after_response)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()            # idle between requests is uvicorn's keep-alive timeout
        if self._linger_timer is not None:
            self._unset_keepalive_if_required()     # a lingering close has its own deadlines

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[GuardedHttpProtocol]:
    """A protocol class with these limits (uvicorn takes a class, one per server)."""
    return type("SitsHttpProtocol", (GuardedHttpProtocol,), {"header_timeout_s": header_timeout_s,
                                                             "max_header_bytes": max_header_bytes})
