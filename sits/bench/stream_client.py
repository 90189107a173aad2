"""The benchmark's HTTP client: streamed completions on keep-alive connections, timed as the bytes
arrive (``sits bench serve`` and ``sits bench tracing`` measure the server through it).

It parses HTTP/1.1 and SSE itself on an ``asyncio.Protocol`` instead of using an HTTP library, so
the time it reports for the first token is when its bytes were read from the socket, not when a
library's layers got round to handing them over.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

_WORDS = ("time river light house music window garden story paper market winter engine "
          "mountain letter silver morning people question answer number system water city "
          "language machine world family evening forest camera bridge school dinner planet").split()


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0               # client: request sent -> the bytes of the first token chunk read
    ttft_parsed_s: float = 0.0        # ... -> that chunk parsed by this client
    engine_ttft_s: float = 0.0        # engine: arrival -> first token (from the stream metadata)
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


class _ResponseParser(asyncio.Protocol):
    """HTTP/1.1 responses on one keep-alive connection, parsed as the bytes arrive.

    Every SSE event is handed on with two times: when the bytes that completed it were read from
    the socket (``data_received``, before any parsing: what the server's overhead is measured to)
    and when this parser had it (the client's own parsing on top).
    """

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._state = "head"       # head | chunk-size | chunk-data | body
        self._need = 0
        self._events = b""
        self._status = 0
        self._close = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.items.put_nowait(ConnectionError(f"connection closed: {exc}"))

    def data_received(self, data: bytes) -> None:
        t_recv = time.perf_counter()
        self._buf += data
        while True:
            if self._state == "head":
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4:]
                lines = head.split("\r\n")
                self._status = int(lines[0].split()[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                self._close = headers.get("connection") == "close"
                if headers.get("transfer-encoding") == "chunked":
                    self._state = "chunk-size"
                else:
                    self._state, self._need = "body", int(headers.get("content-length", "0"))
            elif self._state == "chunk-size":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(self._buf[:end], 16)
                self._buf = self._buf[end + 2:]
                if size == 0:
                    self._state, self._need = "trailer", 2
                else:
                    self._state, self._need = "chunk-data", size + 2
            elif self._state == "trailer":
                if len(self._buf) < self._need:
                    return
                self._buf = self._buf[self._need:]
                self._state = "head"
                self.items.put_nowait(("end", self._status, self._close))
            elif self._state == "chunk-data":
                if len(self._buf) < self._need:
                    return
                self._events += self._buf[:self._need - 2]
                self._buf = self._buf[self._need:]
                self._state = "chunk-size"
                while b"\n\n" in self._events:
                    event, self._events = self._events.split(b"\n\n", 1)
                    self.items.put_nowait(("event", t_recv, time.perf_counter(), event))
            else:                      # a Content-Length body (an error answer)
                if len(self._buf) < self._need:
                    return
                body, self._buf = self._buf[:self._need], self._buf[self._need:]
                self._state = "head"
                self.items.put_nowait(("body", self._status, body))


class StreamClient:
    """A lean HTTP/1.1 streaming client on one keep-alive connection (asyncio protocol, no framework).

    The benchmark measures the server, so the client adds as little as it can: responses are
    parsed in ``data_received`` and each event carries the time its bytes were read (see
    ``_ResponseParser``); JSON is parsed only where numbers are needed (the first token chunk's
    metadata and the usage chunk).
    """

    def __init__(self, url: str):
        import httpx    # not at the top: `sits --help` imports every benchmark module
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port or 80
        self.protocol: _ResponseParser | None = None

    async def close(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()
        self.protocol = None

    async def post_stream(self, path: str, body: bytes):
        """Yield (bytes read at, parsed at, event bytes) for each SSE event; raise on non-200."""
        p = self.protocol
        if p is None or p.transport is None or p.transport.is_closing():
            _, p = await asyncio.get_running_loop().create_connection(_ResponseParser, self.host, self.port)
            self.protocol = p
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-SITS-Stream-Meta: 1\r\nAccept: text/event-stream\r\n\r\n")
        p.transport.write(head.encode() + body)
        while True:
            item = await p.items.get()
            if isinstance(item, BaseException):
                self.protocol = None
                raise item
            kind = item[0]
            if kind == "event":
                yield item[1], item[2], item[3]
            elif kind == "body":
                if item[1] != 200:
                    raise RuntimeError(f"HTTP {item[1]}: {item[2][:200]!r}")
                return
            else:                      # the chunked body ended
                if item[2]:
                    await self.close()
                return


async def one_request(client: StreamClient, model: str, prompt: str, max_tokens: int, chat: bool) -> RequestResult:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    res = RequestResult(ok=False)
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    last = None
    try:
        async for now, parsed, event in client.post_stream(path, payload):
            if event == b"data: [DONE]":
                continue          # read on to the end of the chunked body: the connection is reused
            if b'"usage":{' in event:
                usage = json.loads(event[6:]).get("usage") or {}
                res.output_tokens = usage.get("completion_tokens", 0)
                res.prompt_tokens = usage.get("prompt_tokens", 0)
            elif b'"stage":"prefill"' in event or b'"stage":"decode"' in event:
                if last is None:
                    res.ttft_s = now - t0
                    res.ttft_parsed_s = parsed - t0
                    meta = json.loads(event[6:])["sits"]
                    res.engine_ttft_s = meta.get("engine_ttft_us", 0) / 1e6
                else:
                    res.itl_s.append(now - last)
                last = now
            elif event.startswith(b'data: {"error"'):
                res.error = json.loads(event[6:])["error"].get("code")
                return res
        res.e2e_s = time.perf_counter() - t0
        res.ok = last is not None
    except (OSError, RuntimeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        await client.close()
    return res
