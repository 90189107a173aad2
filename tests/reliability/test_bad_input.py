"""Hostile input against a real server: every case is refused with a 4xx and the OpenAI error body
(or, for transport-level abuse, the connection is closed cleanly), never a 5xx, never a hang, and the
server still answers a normal ``/v1/completions`` request afterwards.

Hand-written cases, grouped as in the reliability brief:
 1. invalid UTF-8 (body, header values, a query), lone surrogate escapes (also where text meets the
    memory's embedder or a session store), NUL bytes
 2. deeply nested JSON, huge / non-finite number literals
 3. oversized bodies (declared and chunked), a 10 MB prompt inside a raised limit
 4. slow clients: trickled headers, trickled bodies, a slow SSE reader
 5. a thousand idle connections
 6. header injection and odd schemes / credentials / lengths in ``callback_url``
 7. callback URLs aimed at loopback / private / metadata hosts, also inside IPv6 forms
    (``allow_private_callbacks`` both ways)
 8. what else a hostile client of an LLM API tries (absurd sampling values, request amplification,
    content types, HTTP framing tricks, huge headers, disconnecting before the answer, session ids
    that could not be read back, hostile ``$ref``s in tool schemas)

Every socket and HTTP call has an explicit timeout. Servers run with ``engine_mode="thread"``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from sits.api.context import ServerSettings

pytestmark = pytest.mark.reliability

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
REQS = "/v1/requests"
MSG = [{"role": "user", "content": "hi"}]
T = 10.0          # default client timeout: nothing here may hang longer than this
FAST_S = 5.0      # "answered within a few seconds"
JSON_CT = {"content-type": "application/json"}
_SANE_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


# -- servers ----------------------------------------------------------------------------------------
def _settings(**kw) -> ServerSettings:
    base = dict(drain_grace_s=0.5, webhook_backoff_s=0.05, webhook_max_attempts=1, webhook_timeout_s=0.5,
                allow_private_callbacks=False)
    base.update(kw)
    return ServerSettings(**base)


@pytest.fixture(scope="module")
def server(serve_tiny):
    """Default limits (1 MiB bodies), private callbacks refused."""
    return serve_tiny(_settings(), engine_mode="thread")


@pytest.fixture(scope="module")
def open_server(serve_tiny):
    """Private / loopback callbacks allowed."""
    return serve_tiny(_settings(allow_private_callbacks=True), engine_mode="thread")


@pytest.fixture(scope="module")
def memory_server(serve_tiny, tmp_path_factory):
    """Memory and sessions on (a data directory)."""
    return serve_tiny(_settings(data_dir=str(tmp_path_factory.mktemp("bad-input-data"))), engine_mode="thread")


@pytest.fixture(scope="module")
def big_server(serve_tiny):
    """The body limit raised to 16 MiB."""
    return serve_tiny(_settings(max_body_bytes=16 << 20), engine_mode="thread")


@pytest.fixture(scope="module")
def slow_server(serve_tiny):
    """Bodies must arrive within 1 s, request heads within 3 s."""
    return serve_tiny(_settings(body_timeout_s=1.0, header_timeout_s=3.0), engine_mode="thread")


@pytest.fixture(scope="module")
def keyed_server(serve_tiny):
    return serve_tiny(_settings(api_keys=("k-good",)), engine_mode="thread")


@pytest.fixture(scope="module")
def batch_server(serve_tiny):
    """Its own server for the request-amplification case (it may leave the engine busy for a while)."""
    return serve_tiny(_settings(), engine_mode="thread")


# -- helpers ----------------------------------------------------------------------------------------
def hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def assert_still_serving(url: str, timeout: float = FAST_S) -> float:
    """A normal completion succeeds within ``timeout``; returns how long it took."""
    t0 = time.monotonic()
    try:
        r = httpx.post(url + CMPL, json={"model": "tiny", "prompt": "still here", "max_tokens": 2}, timeout=timeout)
    except httpx.HTTPError as e:
        pytest.fail(f"the server no longer answers a normal /v1/completions within {timeout} s: "
                    f"{type(e).__name__}: {e}")
    assert r.status_code == 200, f"normal request afterwards: {r.status_code} {r.text[:300]}"
    assert isinstance(r.json()["choices"][0]["text"], str)
    return time.monotonic() - t0


def assert_openai_error(r: httpx.Response, status: int | None = None, code: str | set[str] | None = None,
                        param: str | None = None) -> dict:
    """A 4xx with exactly ``{"error": {"message", "type", "param", "code"}}``."""
    text = r.text[:400]
    assert 400 <= r.status_code < 500, f"expected a 4xx, got {r.status_code}: {text}"
    if status is not None:
        assert r.status_code == status, f"expected {status}, got {r.status_code}: {text}"
    try:
        body = r.json()
    except ValueError:
        pytest.fail(f"{r.status_code} without a JSON body: {text}")
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, f"not the OpenAI shape: {text}"
    assert err["message"] and "Traceback" not in err["message"], err
    if code is not None:
        codes = {code} if isinstance(code, str) else set(code)
        assert err["code"] in codes, (f"{r.status_code} code {err['code']!r} ({err['message'][:200]!r}); "
                                      f"expected {sorted(codes)}")
    if param is not None:
        assert err["param"] == param, err
    return err


def post(url: str, path: str, body, timeout: float = T, headers: dict | None = None) -> httpx.Response:
    """POST raw bytes (``bytes``) or JSON (anything else)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={**JSON_CT, **(headers or {})}, timeout=timeout)


def wait_terminal(url: str, rid: str, timeout: float = T) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = httpx.get(f"{url}{REQS}/{rid}", timeout=timeout).json()
        if v["state"] in ("RESOLVED", "REJECTED"):
            return v
        assert time.monotonic() < deadline, f"request {rid} still {v['state']} after {timeout} s"
        time.sleep(0.05)


def assert_sits_refused_or_rejected(r: httpx.Response, url: str, codes: set[str] | None = None) -> None:
    """The SITS dialect may refuse at once (400) or accept and REJECT later; a REJECTED reason must
    be the client's fault, never ``internal_error``."""
    if r.status_code == 202:
        v = wait_terminal(url, r.json()["id"])
        if v["state"] == "REJECTED":
            code = (v.get("error") or {}).get("code")
            assert code != "internal_error", f"accepted, then REJECTED as a server bug: {v['error']}"
            if codes is not None:
                assert code in codes, v["error"]
        return
    assert_openai_error(r, code=codes)


@dataclass
class RawReply:
    data: bytes
    closed: bool          # the server closed the connection (EOF or reset)
    elapsed: float

    @property
    def status(self) -> int | None:
        m = re.match(rb"HTTP/1\.[01] (\d{3})", self.data)
        return int(m.group(1)) if m else None

    @property
    def statuses(self) -> list[int]:
        """Status of every complete response on the connection, in order (framed by Content-Length or
        chunked encoding, as a client would read them)."""
        out, buf = [], self.data
        while buf:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
            if not sep or not m:
                break
            status = int(m.group(1))
            out.append(status)
            cl = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            if status == 100 or status == 204 or status == 304:
                buf = rest
            elif cl:
                buf = rest[int(cl.group(1)):]
            elif re.search(rb"(?i)\r\ntransfer-encoding:\s*chunked", head):
                while True:
                    size_line, _, rest = rest.partition(b"\r\n")
                    size = int(size_line.split(b";")[0] or b"0", 16)
                    rest = rest[size + 2:]
                    if size == 0:
                        break
                buf = rest
            else:                     # read until close: nothing can follow
                break
        return out

    def header(self, name: bytes) -> bytes | None:
        head = self.data.split(b"\r\n\r\n", 1)[0]
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == name.lower():
                return v.strip()
        return None

    def json(self):
        return json.loads(self.data.split(b"\r\n\r\n", 1)[1])


def raw_exchange(url: str, payload: bytes, timeout: float = T, sock_opts=()) -> RawReply:
    """Send ``payload`` on a fresh connection and read until the server closes it (or ``timeout``)."""
    t0 = time.monotonic()
    data, closed = b"", False
    with socket.create_connection(hostport(url), timeout=timeout) as s:
        for opt in sock_opts:
            s.setsockopt(*opt)
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s.settimeout(left)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            data += chunk
    return RawReply(data, closed, time.monotonic() - t0)


def assert_refused_cleanly(reply: RawReply, what: str) -> None:
    """Transport-level abuse: a 4xx status line (or nothing) and the connection closed; never a 5xx or a hang."""
    assert reply.closed, f"{what}: the server neither answered nor closed within {reply.elapsed:.1f} s " \
                         f"(got {reply.data[:200]!r})"
    if reply.data:
        assert reply.status is not None and 400 <= reply.status < 500, f"{what}: {reply.data[:300]!r}"


def http_request(method: bytes, path: bytes, body: bytes = b"", headers: list[bytes] | None = None,
                 version: bytes = b"HTTP/1.1", close: bool = True, length: bool = True) -> bytes:
    lines = [method + b" " + path + b" " + version, b"Host: sits.test"]
    lines += headers or []
    if body and length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    if close:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


NORMAL = b'{"model":"tiny","prompt":"x","max_tokens":2}'


class Receiver:
    """A raw HTTP listener on 127.0.0.1 that records every request it gets (bytes as received)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    head, _, rest = data.partition(b"\r\n\r\n")
                    m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                    need = int(m.group(1)) if m else 0
                    while len(rest) < need:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                    self.requests.append(head + b"\r\n\r\n" + rest)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    self.requests.append(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# == 1. invalid UTF-8, lone surrogates, NUL ============================================================
INVALID_UTF8 = [
    ("completion-prompt", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}'),
    ("completion-no-model", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    ("chat-content", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}'),
    ("cesu-surrogate", CMPL, b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 2}'),
    ("sits-cesu-surrogate", REQS, b'{"prompt": "\xed\xa0\x80", "constraints": {"max_tokens": 2}}'),
    ("in-a-key", CMPL, b'{"model": "tiny", "prompt": "ok", "max_tokens": 2, "\xff": 1}'),
    ("truncated-sequence", CMPL, b'{"model": "tiny", "prompt": "\xe2\x82", "max_tokens": 2}'),
]


@pytest.mark.parametrize("path,body", [c[1:] for c in INVALID_UTF8], ids=[c[0] for c in INVALID_UTF8])
def test_invalid_utf8_body_is_invalid_json(server, path, body):
    """RFC 8259 JSON is UTF-8: a body that is not is malformed JSON, the same 400 as a syntax error."""
    r = post(server.url, path, body)
    assert_openai_error(r, status=400, code="invalid_json")
    assert_still_serving(server.url)


HEADER_VALUES = [
    ("x-request-id", b"\xff\xfe"),
    ("x-session-id", b"\xc3\x28"),
    ("traceparent", b"00-\xff\xfe-\xff-01"),
    ("user-agent", b"\xed\xa0\x80 bot"),
    ("x-sits-stream-meta", b"\xff"),
    ("authorization", b"Bearer \xff\xfe"),
    ("content-type", b"application/json; charset=\xff"),
]


@pytest.mark.parametrize("name,value", HEADER_VALUES, ids=[h[0] for h in HEADER_VALUES])
def test_invalid_utf8_in_header_values(server, name, value):
    reply = raw_exchange(server.url, http_request(b"POST", CMPL.encode(), NORMAL,
                                                  [b"Content-Type: application/json", name.encode() + b": " + value]))
    assert reply.status is not None, f"no response: {reply.data[:200]!r}"
    assert reply.status < 500, reply.data[:400]
    rid = reply.header(b"x-request-id")
    assert rid is not None and _SANE_ID.match(rid), f"x-request-id echoed unsanitised: {rid!r}"
    if reply.status >= 400:
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    assert_still_serving(server.url)


def test_invalid_utf8_in_authorization_with_keys(keyed_server):
    for value in (b"Bearer \xff\xfe", b"Bearer k-good\xff", b"\xff\xfe k-good", b"Bearer k-go\x80od"):
        reply = raw_exchange(keyed_server.url, http_request(b"POST", CMPL.encode(), NORMAL,
                                                            [b"Content-Type: application/json",
                                                             b"Authorization: " + value]))
        assert reply.status == 401, (value, reply.data[:300])
        assert reply.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(keyed_server.url + CMPL, content=NORMAL, headers={**JSON_CT, "authorization": "Bearer k-good"},
                   timeout=FAST_S)
    assert r.status_code == 200, r.text


SURROGATES = [
    ("completion-prompt", CMPL, b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'),
    ("completion-prompt-list", CMPL, b'{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("chat-content", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], '
                           b'"max_tokens": 2}'),
    ("chat-text-part", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": '
                             b'[{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2}'),
    ("chat-name", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}], '
                        b'"max_tokens": 2}'),
    ("stop", CMPL, b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}'),
    ("model", CMPL, b'{"model": "\\ud800", "prompt": "x", "max_tokens": 2}'),
    ("unknown-field-name", CMPL, b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "\\ud800": 1}'),
]


@pytest.mark.parametrize("path,body", [c[1:] for c in SURROGATES], ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_escape(server, path, body):
    """``"\\ud800"`` is valid JSON but not a Unicode scalar: refuse it (400) or replace it (200); never a 500."""
    r = post(server.url, path, body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code != 200:
        assert_openai_error(r)
    assert_still_serving(server.url)


@pytest.mark.parametrize("body", [
    b'{"prompt": "\\ud800", "constraints": {"max_tokens": 2}}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "constraints": {"max_tokens": 2}}',
], ids=["prompt", "messages"])
def test_lone_surrogate_in_sits_request(server, body):
    r = post(server.url, REQS, body)
    assert r.status_code < 500, r.text[:300]
    assert_sits_refused_or_rejected(r, server.url)
    assert_still_serving(server.url)


BAD_TEXT = [
    # (id, method, path, body, headers): client text bound for the embedder, a memory set or a session
    ("memory-text", "POST", "/v1/memory/kb", b'{"texts": ["ok", "a\\ud800b"]}', {}),
    ("memory-meta", "POST", "/v1/memory/kb", b'{"texts": ["ok"], "metas": [{"source": "\\udfff"}]}', {}),
    ("memory-meta-key", "POST", "/v1/memory/kb", b'{"texts": ["ok"], "metas": [{"\\ud800": 1}]}', {}),
    ("search-pct-ff", "GET", "/v1/memory/kb/search?q=%ff%fe", None, {}),
    ("search-pct-cesu", "GET", "/v1/memory/kb/search?q=%ed%a0%80", None, {}),
    ("search-pct-truncated", "GET", "/v1/memory/kb/search?q=a%e2%82", None, {}),
    ("embeddings-minilm", "POST", "/v1/embeddings", b'{"model": "all-minilm-l6-v2", "input": ["\\ud800"]}', {}),
    ("embeddings-model", "POST", "/v1/embeddings", b'{"model": "tiny", "input": ["ok", "\\udc00"]}', {}),
    ("chat-memory-ref", "POST", CHAT, b'{"model": "tiny", "memory_ref": "kb", "max_tokens": 2, '
                                      b'"messages": [{"role": "user", "content": "\\ud800"}]}', {}),
    ("chat-session-name", "POST", CHAT, b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                                        b'"content": "hi", "name": "\\ud800"}]}', {"x-session-id": "bad-text"}),
]


@pytest.mark.parametrize("method,path,body,headers", [c[1:] for c in BAD_TEXT], ids=[c[0] for c in BAD_TEXT])
def test_bad_text_bound_for_memory_embeddings_or_sessions(memory_server, method, path, body, headers):
    """The same 400 ``invalid_text`` as the generation routes, and nothing stored that would make every
    later read of the set or the session a 500."""
    url = memory_server.url
    r = httpx.post(url + "/v1/memory/kb", json={"texts": ["Invoices are due on the 1st."]}, timeout=T)
    assert r.status_code == 201, r.text[:300]
    r = httpx.request(method, url + path, content=body, headers={**JSON_CT, **headers}, timeout=T)
    assert_openai_error(r, status=400, code="invalid_text")
    for read in ("/v1/memory/kb/memories", "/v1/memory/kb/search?q=invoice"):
        assert httpx.get(url + read, timeout=T).status_code == 200, f"{read} after {path}"
    assert httpx.get(url + "/v1/sessions/bad-text", timeout=T).status_code == 404
    assert_still_serving(url)


def test_bad_text_in_a_memory_ref_request(memory_server):
    url = memory_server.url
    httpx.post(url + "/v1/memory/kb", json={"texts": ["Invoices are due on the 1st."]}, timeout=T)
    r = post(url, REQS, b'{"prompt": "when \\ud800?", "memory_ref": "kb", "constraints": {"max_tokens": 2}}')
    assert_sits_refused_or_rejected(r, url, codes={"invalid_text"})
    assert_still_serving(url)


NULS = [
    ("prompt", CMPL, {"model": "tiny", "prompt": "a\x00b", "max_tokens": 2}, None),
    ("prompt-only-nul", CMPL, {"model": "tiny", "prompt": "\x00", "max_tokens": 2}, None),
    ("chat-content", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "\x00"}], "max_tokens": 2},
     None),
    ("model", CMPL, {"model": "tiny\x00", "prompt": "x", "max_tokens": 2}, 404),
    ("stop", CMPL, {"model": "tiny", "prompt": "x", "stop": ["\x00"], "max_tokens": 2}, None),
    ("user", CMPL, {"model": "tiny", "prompt": "x", "user": "\x00", "max_tokens": 2}, None),
    ("unknown-field-name", CMPL, {"model": "tiny", "prompt": "x", "\x00": 1, "max_tokens": 2}, None),
    ("sits-prompt", REQS, {"prompt": "a\x00", "constraints": {"max_tokens": 2}}, None),
    ("sits-unit", REQS, {"unit": "tiny\x00", "prompt": "x", "constraints": {"max_tokens": 2}}, None),
]


@pytest.mark.parametrize("path,body,status", [c[1:] for c in NULS], ids=[c[0] for c in NULS])
def test_nul_bytes_in_strings(server, path, body, status):
    r = post(server.url, path, body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if status is not None:
        assert_openai_error(r, status=status)
    elif path == REQS:
        assert_sits_refused_or_rejected(r, server.url)
    elif r.status_code != 200:
        assert_openai_error(r)
    assert_still_serving(server.url)


def test_raw_nul_inside_a_json_string_is_invalid_json(server):
    r = post(server.url, CMPL, b'{"model": "tiny", "prompt": "a\x00b", "max_tokens": 2}')
    assert_openai_error(r, status=400, code="invalid_json")


@pytest.mark.parametrize("raw", [
    http_request(b"POST", CMPL.encode(), NORMAL, [b"Content-Type: application/json", b"X-Request-ID: a\x00b"]),
    http_request(b"GET", b"/v1/models\x00", headers=[]),
    http_request(b"POST", CMPL.encode() + b"\xff", NORMAL, [b"Content-Type: application/json"]),
    http_request(b"GET", b"/v1/models", headers=[b"X-\x00: 1"]),
], ids=["nul-in-header-value", "nul-in-request-target", "raw-0xff-in-request-target", "nul-in-header-name"])
def test_nul_and_raw_bytes_in_the_request_head(server, raw):
    reply = raw_exchange(server.url, raw, timeout=FAST_S)
    if reply.status is not None and reply.status < 400:   # lenient parsing is fine if it is not a 5xx
        assert reply.closed
    else:
        assert_refused_cleanly(reply, "NUL / raw byte in the request head")
    assert_still_serving(server.url)


@pytest.mark.parametrize("path", [b"/v1/requests/%ff%fe", b"/v1/requests/%00", b"/v1/requests/%ed%a0%80",
                                  b"/v1/requests/" + b"a" * 8000, b"/v1/requests/%2e%2e%2f%2e%2e%2fadmin"],
                         ids=["pct-ff", "pct-nul", "pct-surrogate", "8k-id", "dot-dot"])
def test_hostile_request_ids_in_the_path(server, path):
    reply = raw_exchange(server.url, http_request(b"GET", path), timeout=FAST_S)
    assert reply.status is not None and 400 <= reply.status < 500, reply.data[:300]
    if reply.header(b"content-type") == b"application/json":
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server.url)


# == 2. deep nesting, huge numbers ===================================================================
DEPTH = 100_000
NESTED = [
    ("array-body", CMPL, b"[" * DEPTH + b"]" * DEPTH),
    ("object-body", CMPL, b'{"a":' * DEPTH + b"1" + b"}" * DEPTH),
    ("unclosed-array-body", CMPL, b"[" * DEPTH),
    ("chat-content", CHAT, b'{"model":"tiny","messages":[{"role":"user","content":' + b"[" * DEPTH + b"]" * DEPTH
     + b"}]}"),
    ("unknown-field", CMPL, b'{"model":"tiny","prompt":"x","max_tokens":2,"extra":' + b'{"a":' * DEPTH + b"1"
     + b"}" * DEPTH + b"}"),
    ("sits-constraints", REQS, b'{"prompt":"x","constraints":' + b'{"a":' * DEPTH + b"1" + b"}" * DEPTH + b"}"),
]


@pytest.mark.parametrize("path,body", [c[1:] for c in NESTED], ids=[c[0] for c in NESTED])
def test_deeply_nested_json(server, path, body):
    """100 000 levels: a parser that recurses must give up with a 400 ``invalid_json``, not a 500 / crash."""
    t0 = time.monotonic()
    r = post(server.url, path, body)
    assert time.monotonic() - t0 < FAST_S
    assert_openai_error(r, status=400, code="invalid_json")
    assert_still_serving(server.url)


BIG_INT = b"1" + b"0" * 5000          # 10**5000: beyond Python's int-from-string digit limit (4300)
NUMBERS = [
    ("max_tokens-1e400", CMPL, b'{"model":"tiny","prompt":"x","max_tokens":1e400}', "max_tokens", None),
    ("temperature-1e400", CMPL, b'{"model":"tiny","prompt":"x","temperature":1e400}', "temperature", None),
    ("temperature-NaN", CMPL, b'{"model":"tiny","prompt":"x","temperature":NaN}', "temperature", None),
    ("top_p-Infinity", CMPL, b'{"model":"tiny","prompt":"x","top_p":Infinity}', "top_p", None),
    ("top_p-1e-400", CMPL, b'{"model":"tiny","prompt":"x","top_p":1e-400}', "top_p", None),
    ("presence_penalty--Infinity", CMPL, b'{"model":"tiny","prompt":"x","presence_penalty":-Infinity}',
     "presence_penalty", None),
    ("priority--1e400", CMPL, b'{"model":"tiny","prompt":"x","priority":-1e400}', "priority", None),
    ("seed-1e400", CMPL, b'{"model":"tiny","prompt":"x","seed":1e400}', "seed", None),
    ("n-1e400", CMPL, b'{"model":"tiny","prompt":"x","n":1e400}', "n", None),
    ("max_tokens-10e5000", CMPL, b'{"model":"tiny","prompt":"x","max_tokens":' + BIG_INT + b"}", None,
     {"invalid_json", "invalid_parameter"}),
    ("seed-10e5000", CMPL, b'{"model":"tiny","prompt":"x","seed":' + BIG_INT + b"}", None,
     {"invalid_json", "invalid_parameter"}),
    ("prompt-token-10e5000", CMPL, b'{"model":"tiny","prompt":[' + BIG_INT + b"]}", None,
     {"invalid_json", "invalid_parameter", "invalid_token_id"}),
    ("max_tokens-10e4000", CMPL, b'{"model":"tiny","prompt":"x","max_tokens":1' + b"0" * 4000 + b"}", None,
     {"context_length_exceeded", "invalid_parameter"}),
    ("chat-top_logprobs-NaN", CHAT, b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"logprobs":true,'
                                    b'"top_logprobs":NaN}', "top_logprobs", None),
    ("sits-temperature-NaN", REQS, b'{"prompt":"x","temperature":NaN}', "temperature", None),
    ("sits-timeout-1e400", REQS, b'{"prompt":"x","constraints":{"timeout_ms":1e400}}', "constraints.timeout_ms",
     None),
    ("sits-max_tokens-10e5000", REQS, b'{"prompt":"x","constraints":{"max_tokens":' + BIG_INT + b"}}", None,
     {"invalid_json", "invalid_parameter"}),
]


@pytest.mark.parametrize("path,body,param,codes", [c[1:] for c in NUMBERS], ids=[c[0] for c in NUMBERS])
def test_huge_and_non_finite_numbers(server, path, body, param, codes):
    r = post(server.url, path, body)
    assert_openai_error(r, status=400, code=codes or "invalid_parameter", param=param)
    assert len(r.content) < 64 * 1024, f"the error echoes the input back ({len(r.content)} bytes)"
    assert_still_serving(server.url)


# == 3. big bodies ===================================================================================
TEN_MB = 10 << 20


def _send_in_background(sock: socket.socket, parts) -> tuple[threading.Thread, list[OSError]]:
    errors: list[OSError] = []

    def run():
        try:
            for p in parts:
                sock.sendall(p)
        except OSError as e:
            errors.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def _read_reply(sock: socket.socket, timeout: float) -> RawReply:
    t0 = time.monotonic()
    data, closed = b"", False
    sock.settimeout(timeout)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    except TimeoutError:
        pass
    except ConnectionResetError:
        closed = True
    return RawReply(data, closed, time.monotonic() - t0)


@pytest.mark.parametrize("reader", ["concurrent", "after-sending"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_10mb_body_is_413_quickly(server, framing, reader):
    """The 413 leaves at once, the upload is read and discarded (no reset), then the connection closes:
    a client reading while it sends and one that reads only after sending (urllib, requests) both see it."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: sits.test\r\nContent-Type: application/json\r\n"
    piece = b"a" * 65536
    if framing == "content-length":
        head += b"Content-Length: " + str(TEN_MB).encode() + b"\r\n\r\n"
        parts = [head] + [piece] * (TEN_MB // len(piece))
    else:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        chunk = hex(len(piece))[2:].encode() + b"\r\n" + piece + b"\r\n"
        parts = [head] + [chunk] * (TEN_MB // len(piece)) + [b"0\r\n\r\n"]
    t0 = time.monotonic()
    with socket.create_connection(hostport(server.url), timeout=T) as s:
        sender, send_errors = _send_in_background(s, parts)
        if reader == "after-sending":
            sender.join(T)
        reply = _read_reply(s, timeout=T)
        sender.join(T)
    elapsed = time.monotonic() - t0
    assert reply.status == 413, reply.data[:300]
    assert reply.json()["error"]["code"] == "payload_too_large"
    assert reply.header(b"connection") == b"close"
    assert elapsed < 3.0, f"413 took {elapsed:.1f} s"
    assert not send_errors, f"the upload was cut: {send_errors}"
    assert reply.closed, "the connection stays open after a 413 on a half-read body"
    assert_still_serving(server.url)


def test_10mb_prompt_within_a_raised_limit_is_a_fast_context_length_error(big_server):
    """16 MiB limit, 10 MiB prompt: refused as context_length_exceeded within a few seconds, not tokenized
    for tens of seconds on the event loop (nor a 5xx / OOM)."""
    body = json.dumps({"model": "tiny", "prompt": "hello world " * (TEN_MB // 12), "max_tokens": 2}).encode()
    t0 = time.monotonic()
    r = post(big_server.url, CMPL, body, timeout=60)
    elapsed = time.monotonic() - t0
    assert_openai_error(r, status=400, code="context_length_exceeded", param="prompt")
    assert elapsed < FAST_S, f"a 10 MiB prompt took {elapsed:.1f} s to be refused (the limit is {FAST_S} s)"
    assert_still_serving(big_server.url)


def test_100k_messages_are_refused_in_bounded_time(big_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 2}
    t0 = time.monotonic()
    r = post(big_server.url, CHAT, body, timeout=30)
    elapsed = time.monotonic() - t0
    assert_openai_error(r, status=400, code="context_length_exceeded")
    assert elapsed < 2 * FAST_S, f"100 000 messages took {elapsed:.1f} s to be refused"
    assert_still_serving(big_server.url)


# == 4. slow clients =================================================================================
HEADER_CUTOFF_S = 10.0   # slow_server's header_timeout_s is 3 s, body_timeout_s 1 s


def test_trickled_headers_are_cut_off_and_do_not_block_others(slow_server):
    """Slowloris: one header byte every 0.5 s. Others must be served meanwhile, and the server must
    not hold the connection forever: it has to close it (or answer 408/431) within HEADER_CUTOFF_S."""
    s = socket.create_connection(hostport(slow_server.url), timeout=T)
    reply, cut_after, others = b"", None, None
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: sits.test\r\nX-Slow: ")
        t0 = time.monotonic()
        s.settimeout(0.05)
        while time.monotonic() - t0 < HEADER_CUTOFF_S:
            try:
                s.sendall(b"a")
                chunk = s.recv(4096)
                if chunk:
                    reply += chunk
                cut_after = time.monotonic() - t0
                break
            except TimeoutError:
                pass
            except OSError:          # reset / broken pipe: the server cut it
                cut_after = time.monotonic() - t0
                break
            if others is None and time.monotonic() - t0 > 1.0:
                others = assert_still_serving(slow_server.url)
            time.sleep(0.5)
    finally:
        s.close()
    assert others is not None and others < FAST_S
    assert cut_after is not None, (f"a client trickling its headers (1 byte / 0.5 s) still held its connection "
                                   f"after {HEADER_CUTOFF_S:.0f} s: no header-read timeout")
    if reply:
        st = RawReply(reply, True, 0).status
        assert st is not None and 400 <= st < 500, reply[:200]
    assert_still_serving(slow_server.url)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_trickled_body_is_408(slow_server, framing):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: sits.test\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 200\r\n\r\n" if framing == "content-length" else b"Transfer-Encoding: chunked\r\n\r\n"
    byte = b" " if framing == "content-length" else b"1\r\n \r\n"
    data, t0 = b"", time.monotonic()
    with socket.create_connection(hostport(slow_server.url), timeout=T) as s:
        s.sendall(head + (b"{" if framing == "content-length" else b"1\r\n{\r\n"))
        s.settimeout(0.05)
        while time.monotonic() - t0 < T:
            try:
                s.sendall(byte)
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            except TimeoutError:
                pass
            except OSError:
                break
            time.sleep(0.2)
    elapsed = time.monotonic() - t0
    reply = RawReply(data, True, elapsed)
    assert reply.status == 408, data[:300]
    assert reply.json()["error"]["code"] == "request_timeout"
    assert elapsed < 4.0, f"408 came after {elapsed:.1f} s with body_timeout_s=1"
    assert_still_serving(slow_server.url)


def test_slow_sse_reader_does_not_stall_others(server):
    """A streaming client that reads one chunk and then sleeps: the server's send blocks on that one
    connection only; everyone else is served, and the slow stream is still whole when finally read."""
    body = json.dumps({"model": "tiny", "prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(T)
    s.connect(hostport(server.url))
    try:
        s.sendall(http_request(b"POST", CMPL.encode(), body, [b"Content-Type: application/json"]))
        first = s.recv(1024)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        for _ in range(3):                        # the slow reader sleeps; others go on
            assert assert_still_serving(server.url) < FAST_S
            time.sleep(0.3)
        with httpx.stream("POST", server.url + CMPL, json={"model": "tiny", "prompt": "x", "max_tokens": 8,
                                                           "stream": True}, timeout=FAST_S) as r:
            assert r.status_code == 200
            assert b"data: [DONE]" in b"".join(r.iter_bytes())
        rest, deadline = b"", time.monotonic() + T
        while b"data: [DONE]" not in rest and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        assert b"data: [DONE]" in first + rest, f"the slow stream did not end properly: {rest[-300:]!r}"
    finally:
        s.close()
    assert_still_serving(server.url)


def test_slow_sse_reader_that_disconnects_midway(server):
    body = json.dumps({"model": "tiny", "prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    for _ in range(5):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(T)
        s.connect(hostport(server.url))
        s.sendall(http_request(b"POST", CMPL.encode(), body, [b"Content-Type: application/json"]))
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
        s.close()
    assert_still_serving(server.url)
    m = httpx.get(server.url + "/metrics", timeout=FAST_S)
    assert m.status_code == 200


# == 5. a thousand idle connections ===================================================================
def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def test_thousand_idle_connections(server):
    """~1000 connections that send nothing or half a request line; a normal request still succeeds
    within a few seconds; after they are closed the server is fine. (Thread mode: the server's end of
    each connection is an fd of this process too, hence 2 per connection.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1000
    need = _open_fds() + 2 * want + 256
    raised = False
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        raised = True
    cur = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = want if cur == resource.RLIM_INFINITY else min(want, (cur - _open_fds() - 256) // 2)
    if n < 100:
        pytest.skip(f"RLIMIT_NOFILE {cur} leaves room for only {n} connections")
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for i in range(n):
            c = socket.create_connection(hostport(server.url), timeout=T)
            if i % 2:
                c.sendall(b"GET /v1/mod")          # half a request line, never finished
            socks.append(c)
        opened = time.monotonic() - t0
        time.sleep(0.5)
        took = assert_still_serving(server.url)
        assert took < FAST_S, f"with {n} idle connections a normal request took {took:.1f} s"
        assert httpx.get(server.url + "/health", timeout=FAST_S).status_code == 200
        assert opened < 20, f"opening {n} connections took {opened:.1f} s"
    finally:
        for c in socks:
            c.close()
    time.sleep(0.5)
    assert_still_serving(server.url)
    if raised:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            pass


# == 6. callback_url: injection, schemes, credentials, length =========================================
BAD_CALLBACKS = [
    ("crlf", "http://127.0.0.1:9/x\r\nX-Injected: 1"),
    ("lf", "http://127.0.0.1:9/x\nX-Injected: 1"),
    ("cr", "http://127.0.0.1:9/x\rX-Injected: 1"),
    ("crlf-in-host", "http://127.0.0.1\r\nX-Injected: 1/"),
    ("pct-crlf-path", "http://127.0.0.1:9/x%0d%0aX-Injected:%201"),
    ("pct-CRLF-query", "http://127.0.0.1:9/x?a=%0D%0AX-Injected:%201"),
    ("pct-crlf-host", "http://127.0.0.1%0d%0aX-Injected:1/"),
    ("pct-nul", "http://127.0.0.1:9/x%00"),
    ("nul", "http://127.0.0.1:9/x\x00"),
    ("tab", "http://127.0.0.1:9/x\tX-Injected: 1"),
    ("unicode-line-separator", "http://127.0.0.1:9/x\u2028X-Injected: 1"),
    ("nel", "http://127.0.0.1:9/x\u0085X-Injected: 1"),
    ("file", "file:///etc/passwd"),
    ("gopher", "gopher://127.0.0.1:6379/_FLUSHALL%0D%0A"),
    ("gopher-plain", "gopher://127.0.0.1:6379/_INFO"),
    ("javascript", "javascript:alert(1)"),
    ("data", "data:text/plain,hello"),
    ("dict", "dict://127.0.0.1:11211/stats"),
    ("ftp", "ftp://127.0.0.1/x"),
    ("ws", "ws://127.0.0.1:9/x"),
    ("scheme-relative", "//127.0.0.1:9/x"),
    ("no-scheme", "127.0.0.1:9/x"),
    ("user-pass", "http://user:pass@127.0.0.1:9/x"),
    ("user-only", "http://user@127.0.0.1:9/x"),
    ("pass-only", "http://:pass@127.0.0.1:9/x"),
    ("backslash-userinfo", "http://example.com\\@127.0.0.1:9/x"),
    ("no-host", "http:///x"),
    ("bad-port", "http://127.0.0.1:99999/x"),
    ("unclosed-ipv6", "http://[::1/x"),
    ("empty", ""),
]


@pytest.mark.parametrize("url", [c[1] for c in BAD_CALLBACKS], ids=[c[0] for c in BAD_CALLBACKS])
def test_bad_callback_url_is_400(open_server, url):
    """Refused whatever allow_private_callbacks says (this server allows private hosts, so the reason
    can only be the URL's form)."""
    r = post(open_server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    assert r.status_code != 202, f"callback_url {url!r} was accepted: {r.text[:200]}"
    assert_openai_error(r, status=400, code={"invalid_callback_url", "invalid_parameter"}, param="callback_url")
    assert_still_serving(open_server.url)


@pytest.mark.parametrize("length", [2049, 4096, 100_000])
def test_over_long_callback_url_is_400(open_server, length):
    url = "http://example.com/" + "a" * (length - len("http://example.com/"))
    r = post(open_server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    err = assert_openai_error(r, status=400, code={"invalid_callback_url", "invalid_parameter"},
                              param="callback_url")
    assert len(err["message"]) < 1024, "the error echoes the whole URL back"


@pytest.mark.parametrize("suffix", ["/hook/\u560a\u560dX-Injected:1", "/hook?q=%E5%98%8A%E5%98%8DX-Injected:1",
                                    "/hook#\r\n", "/hook/%5Cr%5Cn"],
                         ids=["utf8-crlf-lookalike", "pct-crlf-lookalike", "fragment-crlf", "escaped-backslash"])
def test_accepted_callback_delivers_no_injected_header(open_server, receiver, suffix):
    """What passes validation must not smuggle a header into the webhook POST as sent on the wire."""
    url = f"http://127.0.0.1:{receiver.port}{suffix}"
    r = post(open_server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    if r.status_code != 202:
        assert_openai_error(r, status=400, code="invalid_callback_url")
        return
    wait_terminal(open_server.url, r.json()["id"])
    deadline = time.monotonic() + FAST_S
    while not receiver.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.requests, "an accepted callback was never delivered"
    for raw in receiver.requests:
        head = raw.split(b"\r\n\r\n", 1)[0]
        names = [line.split(b":", 1)[0].strip().lower() for line in head.split(b"\r\n")[1:]]
        assert b"x-injected" not in names, head
        assert all(0x20 <= b < 0x7F for b in head.split(b"\r\n")[0]), f"request line not clean ASCII: {head[:200]!r}"


# == 7. callbacks aimed at this server / private hosts / metadata =====================================
PRIVATE_CALLBACKS = [
    ("own-admin-faults", "http://127.0.0.1:{port}/admin/faults"),
    ("own-v1", "http://127.0.0.1:{port}/v1/requests"),
    ("localhost", "http://localhost/admin/faults"),
    ("localhost-upper", "http://LOCALHOST:{port}/admin"),
    ("localhost-dot", "http://localhost.:{port}/admin"),
    ("sub-localhost", "http://admin.localhost/"),
    ("ipv6-loopback", "http://[::1]:{port}/admin/faults"),
    ("ipv6-loopback-long", "http://[0:0:0:0:0:0:0:1]/"),
    ("ipv4-mapped-ipv6", "http://[::ffff:127.0.0.1]/"),
    ("ipv4-mapped-ipv6-hex", "http://[::ffff:7f00:1]/"),
    ("unspecified", "http://0.0.0.0/"),
    ("unspecified-ipv6", "http://[::]/"),
    ("zero", "http://0/"),
    ("metadata", "http://169.254.169.254/latest/meta-data/"),
    ("metadata-ipv6", "http://[fd00:ec2::254]/"),
    ("decimal", "http://2130706433/"),
    ("hex", "http://0x7f000001/"),
    ("hex-dotted", "http://0x7f.0.0.1/"),
    ("octal", "http://0177.0.0.1/"),
    ("octal-long", "http://017700000001/"),
    ("short-form", "http://127.1/"),
    ("zero-padded", "http://127.000.000.001/"),
    ("https-loopback", "https://127.0.0.1:{port}/"),
    ("private-10", "http://10.0.0.1/"),
    ("private-192", "http://192.168.1.1/"),
    ("private-172", "http://172.16.0.1/"),
    ("link-local-v6-scoped", "http://[fe80::1%25eth0]/"),
    ("ipv4-compatible", "http://[::127.0.0.1]:{port}/admin/faults"),
    ("ipv4-compatible-metadata", "http://[::a9fe:a9fe]/latest/meta-data/"),
    ("ipv4-translated", "http://[::ffff:0:7f00:1]/"),
    ("nat64-metadata", "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/"),
    ("nat64-loopback", "http://[64:ff9b::7f00:1]:{port}/admin/faults"),
    ("nat64-private", "http://[64:ff9b::10.0.0.1]/"),
    ("nat64-local-use", "http://[64:ff9b:1::a9fe:a9fe]/"),
    ("6to4-loopback", "http://[2002:7f00:1::]/"),
    ("6to4-metadata", "http://[2002:a9fe:a9fe::1]/"),
    ("teredo", "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/"),
]


@pytest.mark.parametrize("url", [c[1] for c in PRIVATE_CALLBACKS], ids=[c[0] for c in PRIVATE_CALLBACKS])
def test_private_callback_refused_when_not_allowed(server, url):
    url = url.format(port=hostport(server.url)[1])
    r = post(server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    assert r.status_code != 202, f"allow_private_callbacks=False accepted {url!r}"
    assert_openai_error(r, status=400, code="invalid_callback_url", param="callback_url")


@pytest.mark.parametrize("url", [c[1] for c in PRIVATE_CALLBACKS], ids=[c[0] for c in PRIVATE_CALLBACKS])
def test_private_callback_accepted_when_allowed(open_server, url):
    url = url.format(port=hostport(open_server.url)[1])
    r = post(open_server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    assert r.status_code == 202, f"allow_private_callbacks=True refused {url!r}: {r.text[:300]}"


def test_hostname_that_resolves_to_loopback_gets_no_delivery(server, receiver):
    """A DNS name (not a literal) that resolves to 127.0.0.1 passes the syntax check, so the refusal has to
    happen at delivery time: the receiver on loopback must never see a POST."""
    name = socket.gethostname()
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        pytest.skip(f"{name!r} does not resolve here")
    if "127.0.0.1" not in addrs:
        pytest.skip(f"{name!r} resolves to {sorted(addrs)}, not 127.0.0.1")
    url = f"http://{name}:{receiver.port}/hook"
    r = post(server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2}, "callback_url": url})
    if r.status_code == 202:
        wait_terminal(server.url, r.json()["id"])
        time.sleep(1.0)
    else:
        assert_openai_error(r, status=400, code="invalid_callback_url")
    assert not receiver.requests, f"a webhook reached loopback through the name {name!r}: {receiver.requests[0][:200]!r}"


def test_private_callback_is_really_delivered_when_allowed(open_server, receiver):
    """The positive control for the two tests above: with allow_private_callbacks=True it does arrive."""
    r = post(open_server.url, REQS, {"prompt": "x", "constraints": {"max_tokens": 2},
                                     "callback_url": f"http://127.0.0.1:{receiver.port}/hook"})
    assert r.status_code == 202, r.text
    wait_terminal(open_server.url, r.json()["id"])
    deadline = time.monotonic() + FAST_S
    while len(receiver.requests) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.requests and receiver.requests[0].startswith(b"POST /hook ")


# == 8. more of what a hostile client tries =========================================================
ABSURD = [
    ("n-1e9", CMPL, {"model": "tiny", "prompt": "x", "n": 10**9}, "n"),
    ("n-2e63", CMPL, {"model": "tiny", "prompt": "x", "n": 2**63}, "n"),
    ("logprobs-1e6", CMPL, {"model": "tiny", "prompt": "x", "logprobs": 10**6}, "logprobs"),
    ("top_logprobs-1e6", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 10**6},
     "top_logprobs"),
    ("top_k-1e7", CMPL, {"model": "tiny", "prompt": "x", "top_k": 10**7}, "top_k"),
    ("stop-10000", CMPL, {"model": "tiny", "prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("chat-stop-10000", CHAT, {"model": "tiny", "messages": MSG, "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("stop_token_ids-10000", CMPL, {"model": "tiny", "prompt": "x", "stop_token_ids": list(range(10_000))},
     "stop_token_ids"),
    ("stop_token_ids-negative", CMPL, {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("seed-2e64", CMPL, {"model": "tiny", "prompt": "x", "seed": 2**64}, "seed"),
    ("priority-1e9", CMPL, {"model": "tiny", "prompt": "x", "priority": 10**9}, "priority"),
    ("user-10k", CMPL, {"model": "tiny", "prompt": "x", "user": "u" * 10_000}, "user"),
    ("max_completion_tokens--1", CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("max_completion_tokens-1e9", CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": 10**9}, None),
    ("chat-max_tokens-0", CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("stream-max_tokens-1e9", CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 10**9, "stream": True}, None),
    ("token-id-2e63", CMPL, {"model": "tiny", "prompt": [2**63]}, "prompt"),
    ("token-id-negative", CMPL, {"model": "tiny", "prompt": [-1]}, "prompt"),
    ("token-id-bool", CMPL, {"model": "tiny", "prompt": [True, False]}, None),
    ("empty-inner-token-list", CMPL, {"model": "tiny", "prompt": [[]]}, "prompt"),
    ("empty-string-in-list", CMPL, {"model": "tiny", "prompt": ["", "x"]}, "prompt"),
    ("mixed-prompt-list", CMPL, {"model": "tiny", "prompt": ["x", 1]}, None),
    ("image-part", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, None),
    ("role-tool", CHAT, {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, None),
    ("messages-not-objects", CHAT, {"model": "tiny", "messages": [1, 2, 3]}, None),
    ("stream_options-not-object", CMPL, {"model": "tiny", "prompt": "x", "stream": True, "stream_options": "all"},
     None),
    ("model-list", CMPL, {"model": ["tiny"], "prompt": "x"}, "model"),
    ("model-1mb-ish", CMPL, {"model": "m" * 500_000, "prompt": "x"}, None),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in ABSURD], ids=[c[0] for c in ABSURD])
def test_absurd_sampling_values(server, path, body, param):
    r = post(server.url, path, body)
    err = assert_openai_error(r, param=param)
    assert err["code"] != "internal_error"
    assert len(r.content) < 64 * 1024, f"the error echoes the input back ({len(r.content)} bytes)"
    assert_still_serving(server.url)


def test_stop_token_id_outside_the_vocabulary_is_not_a_5xx(server):
    for ids in ([2**63], [10**30], [4096, 10**9]):
        r = post(server.url, CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 2, "stop_token_ids": ids})
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert_openai_error(r, param="stop_token_ids")


SITS_ABSURD = [
    ("stop-10000", {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)], "constraints": {"max_tokens": 2}}),
    ("max_tokens-1e9", {"prompt": "x", "constraints": {"max_tokens": 10**9}}),
    ("allowed_tools-10000", {"prompt": "x", "allowed_tools": [f"tool{i}" for i in range(10_000)]}),
    ("priority-1e9", {"prompt": "x", "constraints": {"priority": 10**9}}),
    ("unit-unknown", {"unit": "nope", "prompt": "x"}),
    ("messages-and-prompt-none", {"constraints": {"max_tokens": 2}}),
    ("memory_ref-100k", {"prompt": "x", "memory_ref": "m" * 100_000}),
]


@pytest.mark.parametrize("body", [c[1] for c in SITS_ABSURD], ids=[c[0] for c in SITS_ABSURD])
def test_absurd_sits_requests(server, body):
    r = post(server.url, REQS, body)
    assert r.status_code < 500, r.text[:300]
    assert_sits_refused_or_rejected(r, server.url)
    if r.status_code == 202:
        v = httpx.get(f"{server.url}{REQS}/{r.json()['id']}", timeout=T)
        assert len(v.content) < 64 * 1024, f"the stored request view echoes the input ({len(v.content)} bytes)"
    assert_still_serving(server.url)


SESSION_IDS = [
    ("slash", b"a/b"), ("dot-dot-slash", b"../admin"), ("dot-dot", b".."), ("dot", b"."), ("pct-slash", b"a%2fb"),
    ("query", b"a?b"), ("fragment", b"a#b"), ("space", b"a b"), ("129-chars", b"s" * 129), ("utf8", "é".encode()),
]


@pytest.mark.parametrize("sid", [c[1] for c in SESSION_IDS], ids=[c[0] for c in SESSION_IDS])
def test_session_ids_that_could_not_be_read_back_are_400(memory_server, sid):
    """An id /v1/sessions/{id} could never name (a '/', a dot segment, an escape) is refused where it
    arrives, on either dialect, instead of starting a session nobody can read or delete."""
    for path, body in ((CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 2}),
                       (REQS, {"prompt": "x", "constraints": {"max_tokens": 2}})):
        r = httpx.post(memory_server.url + path, json=body, headers={"x-session-id": sid}, timeout=T)
        err = assert_openai_error(r, status=400, code="invalid_session_id")
        assert "[A-Za-z0-9._:-]" in err["message"]
    assert_still_serving(memory_server.url)


_WEATHER = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
            "$defs": {"City": {"enum": ["Oslo", "Lima"]}}}
HOSTILE_TOOL_SCHEMAS = [
    # (id, parameters, whether it is served: True 200, False 400, None either)
    ("ref-to-defs", _WEATHER, True),
    ("ref-recursive-root", {"type": "object", "properties": {"next": {"$ref": "#"}}}, True),
    ("ref-missing", {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, False),
    ("ref-metadata-url", {"type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/x"}}}, False),
    ("ref-file", {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}, False),
    ("ref-outside-the-tool", {"type": "object", "properties": {"a": {"$ref": "#/properties/name"}}}, False),
    ("ref-cycle", {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                   "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}}, None),
]


@pytest.mark.parametrize("parameters,served", [c[1:] for c in HOSTILE_TOOL_SCHEMAS],
                         ids=[c[0] for c in HOSTILE_TOOL_SCHEMAS])
def test_refs_in_tool_schemas(server, parameters, served):
    """A tool's ``$ref``s resolve inside its own parameters (pydantic's ``$defs`` work); one that points
    nowhere, outside the tool, or off the machine is a quick 400 (nothing is fetched), never a 5xx."""
    t0 = time.monotonic()
    r = post(server.url, CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 40, "tool_choice": "required",
                                "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    assert time.monotonic() - t0 < FAST_S
    if served:
        assert r.status_code == 200, r.text[:300]
    elif served is False or r.status_code != 200:
        assert_openai_error(r, status=400, param="tools")
    assert_still_serving(server.url)


def test_prompt_batch_amplification_is_refused(batch_server):
    """2048 prompts x n=16 = 32 768 sequences from one 10 KB body. Capping n at 16 means nothing if the
    prompt list is unbounded: this must be a quick 4xx, and the server must keep answering /health."""
    body = {"model": "tiny", "prompt": ["x"] * 2048, "n": 16, "max_tokens": 1}
    result: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            result["r"] = post(batch_server.url, CMPL, body, timeout=FAST_S)
        except httpx.HTTPError as e:
            result["exc"] = f"{type(e).__name__}"
        result["t"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        health = httpx.get(batch_server.url + "/health", timeout=T).status_code
    except httpx.HTTPError as e:
        health = type(e).__name__
    health_s = time.monotonic() - t0
    th.join(T)
    try:
        assert "r" in result, (f"no answer within {FAST_S} s ({result.get('exc')}); /health meanwhile took "
                               f"{health_s:.1f} s ({health})")
        assert_openai_error(result["r"], status=400)
        assert health == 200 and health_s < 2.0, f"/health took {health_s:.1f} s ({health}) during the batch"
    finally:
        assert_still_serving(batch_server.url, timeout=60)


CONTENT_TYPES = [
    ("text-plain", "text/plain", NORMAL),
    ("xml", "application/xml", b"<completion><model>tiny</model></completion>"),
    ("multipart", "multipart/form-data; boundary=x",
     b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n--x--\r\n'),
    ("multipart-no-boundary", "multipart/form-data", NORMAL),
    ("urlencoded-real-form", "application/x-www-form-urlencoded", b"model=tiny&prompt=x&max_tokens=2"),
    ("ndjson", "application/x-ndjson", NORMAL + b"\n" + NORMAL),
    ("utf16-json", "application/json; charset=utf-16", json.dumps({"model": "tiny", "prompt": "x",
                                                                   "max_tokens": 2}).encode("utf-16")),
    ("octet-stream-garbage", "application/octet-stream", bytes(range(256))),
    ("gzip-claimed", "application/json", b"\x1f\x8b\x08\x00garbage"),
    ("json-with-trailing-garbage", "application/json", NORMAL + b" trailing"),
    ("two-json-objects", "application/json", NORMAL + NORMAL),
    ("content-type-1kb", "application/json" + "; x=y" * 200, NORMAL),
]


@pytest.mark.parametrize("ctype,body", [c[1:] for c in CONTENT_TYPES], ids=[c[0] for c in CONTENT_TYPES])
def test_unknown_content_types(server, ctype, body):
    r = httpx.post(server.url + CMPL, content=body, headers={"content-type": ctype}, timeout=T)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code != 200:
        assert_openai_error(r)
    assert_still_serving(server.url)


def test_gzip_content_encoding_is_not_a_5xx(server):
    import gzip
    r = httpx.post(server.url + CMPL, content=gzip.compress(NORMAL),
                   headers={**JSON_CT, "content-encoding": "gzip"}, timeout=T)
    assert r.status_code < 500, r.text[:300]
    if r.status_code != 200:
        assert_openai_error(r)


def test_unknown_field_names_cannot_inject_response_headers(server):
    r = post(server.url, CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 2, "a\r\nX-Injected: 1": 1,
                                "b\nSet-Cookie: s=1": 2})
    assert r.status_code == 200, r.text
    assert "x-injected" not in r.headers and "set-cookie" not in r.headers
    assert all(0x20 <= ord(ch) < 0x7F for ch in r.headers.get("warning", ""))
    t0 = time.monotonic()
    r = post(server.url, CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 2, **{f"f{i}": i for i in range(50_000)}})
    assert r.status_code == 200, r.text[:300]
    assert time.monotonic() - t0 < FAST_S
    assert len(r.headers.get("warning", "")) < 2048


def test_http10_without_host(server):
    for raw in (b"GET /v1/models HTTP/1.0\r\n\r\n",
                b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(NORMAL)).encode() + b"\r\n\r\n" + NORMAL,
                b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n"):
        reply = raw_exchange(server.url, raw, timeout=FAST_S)
        assert reply.closed, f"HTTP/1.0 connection left open: {raw[:40]!r}"
        assert reply.status is not None and (reply.status == 200 or 400 <= reply.status < 500), reply.data[:300]
    assert_still_serving(server.url)


def test_pipelined_requests(server):
    raw = (http_request(b"POST", CMPL.encode(), NORMAL, [b"Content-Type: application/json"], close=False)
           + http_request(b"GET", b"/v1/models", close=False)
           + http_request(b"POST", CMPL.encode(), b'{"model":"tiny","prompt":', [b"Content-Type: application/json"],
                          close=False)
           + http_request(b"GET", b"/health"))
    reply = raw_exchange(server.url, raw)
    assert reply.closed
    assert reply.statuses == [200, 200, 400, 200], reply.data[:600]
    assert_still_serving(server.url)


def test_pipelined_requests_after_a_413_are_not_run(server):
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 99999999\r\n\r\n" + http_request(b"GET", b"/v1/models"))
    reply = raw_exchange(server.url, raw, timeout=FAST_S)
    assert reply.closed and reply.statuses == [413], reply.data[:400]


B_LEN = str(len(NORMAL)).encode()
CHUNKED = hex(len(NORMAL))[2:].encode() + b"\r\n" + NORMAL + b"\r\n0\r\n\r\n"
FRAMING = [
    # (id, raw request, must_refuse)
    ("dup-content-length-differ", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: " + B_LEN + b"\r\nContent-Length: 5\r\n\r\n" + NORMAL, True),
    ("dup-content-length-same", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: " + B_LEN + b"\r\nContent-Length: " + B_LEN + b"\r\nConnection: close\r\n\r\n" + NORMAL, False),
    ("content-length-list", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: " + B_LEN + b", " + B_LEN + b"\r\nConnection: close\r\n\r\n" + NORMAL, False),
    ("content-length-negative", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + NORMAL,
     True),
    ("content-length-plus", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +45\r\n\r\n" + NORMAL, True),
    ("content-length-hex", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0x2d\r\n\r\n" + NORMAL, True),
    ("content-length-overflow", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
     + b"9" * 30 + b"\r\n\r\n" + NORMAL, True),
    ("te-and-cl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED, False),
    ("te-cl-smuggle", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\nContent-Length: " + str(len(CHUNKED)).encode() + b"\r\n\r\n" + CHUNKED
     + b"GET /smuggled HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False),
    ("te-xchunked", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: xchunked\r\n\r\n" + CHUNKED, True),
    ("te-twice", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n" + CHUNKED, True),
    ("te-space-before-colon", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding : chunked\r\n\r\n" + CHUNKED, True),
    ("bad-chunk-size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\nabc\r\n0\r\n\r\n", True),
    ("huge-chunk-size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"ffffffffffffffffffff\r\nabc", True),
    ("obs-fold", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", True),
    ("bare-lf", b"GET /v1/models HTTP/1.1\nHost: x\n\n", False),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", True),
    ("method-10k", b"A" * 10_000 + b" /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", True),
    ("unknown-method", b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", True),
    ("url-1mb", b"GET /v1/models?" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n", True),
    ("http-version-9.9", b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n", True),
]


@pytest.mark.parametrize("raw,must_refuse", [c[1:] for c in FRAMING], ids=[c[0] for c in FRAMING])
def test_http_framing_tricks(server, raw, must_refuse):
    """Ambiguous or malformed framing: refused with a 4xx and a closed connection (must_refuse), or at
    least never a 5xx, never a hang, and never a request smuggled past the first response."""
    reply = raw_exchange(server.url, raw, timeout=FAST_S)
    if must_refuse:
        assert_refused_cleanly(reply, "malformed framing")
    else:
        assert reply.closed, f"connection left open after ambiguous framing: {reply.data[:300]!r}"
        assert reply.statuses, reply.data[:300]
        assert all(s < 500 for s in reply.statuses), reply.data[:400]
        assert len(reply.statuses) == 1, f"a second request was read out of the first one's body: {reply.statuses}"
    assert_still_serving(server.url)


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * (4 << 20),
    b"\r\n".join(b"X-H%d: v" % i for i in range(20_000)),
], ids=["one-4mb-header", "20000-headers"])
def test_huge_header_block_is_refused(server, head):
    """The 1 MiB body limit means little if the header block is unbounded: a 4 MiB header (or 20 000
    headers) must get a 431/400 or a closed connection, not be parsed and routed."""
    reply = raw_exchange(server.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head
                         + b"\r\nConnection: close\r\n\r\n", timeout=T)
    assert reply.status != 200, f"a {len(head) >> 10} KiB header block was accepted and answered 200"
    assert_refused_cleanly(reply, "huge header block")
    assert_still_serving(server.url)


def test_client_that_disconnects_before_the_answer_causes_no_server_error(server):
    """A non-streamed request whose client hangs up mid-generation: the server aborts it quietly
    (no 'Exception in ASGI application', no 'unhandled error' traceback in the logs)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "sits.api")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}).encode()
        for _ in range(3):
            with socket.create_connection(hostport(server.url), timeout=T) as s:
                s.sendall(http_request(b"POST", CMPL.encode(), body, [b"Content-Type: application/json"]))
                time.sleep(0.3)
        time.sleep(1.0)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    bad = [f"{r.name}: {r.getMessage().strip()} ({r.exc_info[0].__name__}: {r.exc_info[1]})" if r.exc_info
           else f"{r.name}: {r.getMessage().strip()}" for r in handler.records]
    assert not bad, "a client disconnect produced server errors:\n" + "\n".join(dict.fromkeys(bad))
    assert_still_serving(server.url)


def test_many_bad_requests_in_a_row_on_one_keepalive_connection(server):
    """One connection, 200 bad requests back to back (keep-alive): each answered, none kills the connection
    or the server."""
    bad = [b"{", b"[]", b'{"model": 1}', b'{"model":"tiny","prompt":"x","n":0}', b'{"model":"tiny","prompt":""}']
    raw = b"".join(http_request(b"POST", CMPL.encode(), bad[i % len(bad)], [b"Content-Type: application/json"],
                                close=False) for i in range(199))
    raw += http_request(b"GET", b"/health")
    reply = raw_exchange(server.url, raw, timeout=T)
    assert reply.closed
    assert reply.statuses[:-1] == [400] * 199 and reply.statuses[-1] == 200, reply.statuses[:10]
    assert_still_serving(server.url)


def test_an_endless_header_line_is_refused_at_the_cap(server):
    """httptools buffers an unfinished header line without a callback: the raw bytes count too."""
    host, port = server.url.rsplit("/", 1)[-1].split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        got = b""
        try:
            for _ in range(64):
                s.sendall(b"a" * 4096)
        except OSError:
            pass                                   # the server answered and closed
        try:
            got = s.recv(200)
        except OSError:
            pass
    assert got.startswith(b"HTTP/1.1 431") and time.monotonic() - t0 < 3, got
    assert_still_serving(server.url)
