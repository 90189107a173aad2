"""Bad input gets a 4xx with the OpenAI error body and a stable code; the server keeps serving."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from sits.api.context import ServerSettings


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(ServerSettings(max_body_bytes=64 * 1024, drain_grace_s=1.0))


def _ok(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [
    # (id, path, body (bytes = raw), status, code, param)
    ("malformed-json", CMPL, b'{"model": "tiny", "prompt": ', 400, "invalid_json", None),
    ("not-an-object", CMPL, b"[1, 2, 3]", 400, "invalid_json", None),
    ("empty-body", CMPL, b"", 400, "missing_body", None),
    ("missing-model", CMPL, {"prompt": "x"}, 400, "missing_parameter", "model"),
    ("missing-prompt", CMPL, {"model": "tiny"}, 400, "missing_parameter", "prompt"),
    ("max-tokens-string", CMPL, {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "invalid_parameter",
     "max_tokens"),
    ("max-tokens-negative", CMPL, {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "invalid_parameter",
     "max_tokens"),
    ("max-tokens-huge", CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400,
     "context_length_exceeded", "max_tokens"),
    ("temperature-out-of-range", CMPL, {"model": "tiny", "prompt": "x", "temperature": 5}, 400,
     "invalid_parameter", "temperature"),
    ("top-p-zero", CMPL, {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "invalid_parameter", "top_p"),
    ("n-too-big", CMPL, {"model": "tiny", "prompt": "x", "n": 1000}, 400, "invalid_parameter", "n"),
    ("stream-not-bool", CMPL, {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "invalid_parameter",
     "stream"),
    ("empty-prompt", CMPL, {"model": "tiny", "prompt": ""}, 400, "empty_prompt", "prompt"),
    ("empty-prompt-list", CMPL, {"model": "tiny", "prompt": []}, 400, "empty_prompt", "prompt"),
    ("token-id-out-of-vocab", CMPL, {"model": "tiny", "prompt": [1, 10**9]}, 400, "invalid_token_id", "prompt"),
    ("prompt-over-context", CMPL, {"model": "tiny", "prompt": [5] * 300, "max_tokens": 1}, 400,
     "context_length_exceeded", "prompt"),
    ("empty-stop-string", CMPL, {"model": "tiny", "prompt": "x", "stop": [""]}, 400, "invalid_parameter", "stop"),
    ("unknown-model", CMPL, {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found", "model"),
    ("empty-messages", CHAT, {"model": "tiny", "messages": []}, 400, "invalid_parameter", "messages"),
    ("bad-role", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_parameter", "messages.0.role"),
    ("messages-not-a-list", CHAT, {"model": "tiny", "messages": "hi"}, 400, "invalid_parameter", "messages"),
    ("chat-over-context", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "context_length_exceeded", None),
    ("top-logprobs-without-logprobs", CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 2}, 400,
     "invalid_parameter", "top_logprobs"),
    ("chat-unknown-model", CHAT, {"model": "nope", "messages": MSG}, 404, "model_not_found", "model"),
    ("sits-prompt-and-messages", "/v1/requests", {"prompt": "x", "messages": MSG}, 400, "invalid_parameter",
     "prompt"),
    ("sits-bad-callback", "/v1/requests", {"prompt": "x", "callback_url": "ftp://x"}, 400,
     "invalid_callback_url", "callback_url"),
    ("sits-callback-header-injection", "/v1/requests", {"prompt": "x", "callback_url": "http://a/\r\nX-Evil: 1"},
     400, "invalid_callback_url", "callback_url"),
    ("sits-timeout-zero", "/v1/requests", {"prompt": "x", "constraints": {"timeout_ms": 0}}, 400,
     "invalid_parameter", "constraints.timeout_ms"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_typed_4xx(server, case):
    _, path, body, status, code, param = case
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    assert err["message"] and "Traceback" not in err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert r.headers["x-request-id"]


def test_server_keeps_serving_after_every_bad_input(server):
    for _, path, body, *_ in BAD:
        if isinstance(body, bytes):
            httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        else:
            httpx.post(server.url + path, json=body)
    _ok(server.url)


def test_oversized_body_is_413_declared_or_chunked(server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * 100_000 + b'"}'
    r = httpx.post(server.url + CMPL, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks():   # no content-length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(server.url + CMPL, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    _ok(server.url)


def _urllib_post(url: str, data, headers: dict) -> tuple[int, dict]:
    """POST as Python's urllib does: the whole body is written before the response is read."""
    import json
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        assert e.headers.get("connection") == "close"
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_413_reaches_a_client_that_sends_the_whole_body_first(server, framing):
    """10 MB against a 64 KiB limit: the client sees the 413, not a connection reset."""
    big = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    hs = {"Content-Type": "application/json"}
    data = big if framing == "content-length" else (big[i:i + 65536] for i in range(0, len(big), 65536))
    status, body = _urllib_post(server.url + CMPL, data, hs)
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    _ok(server.url)


def test_unread_body_after_a_413_is_bounded(server):
    """A 1 GB declared body is not read forever: the server cuts the connection after its bound."""
    from sits.api.http_protocol import GuardedHttpProtocol
    host, port = server.url.removeprefix("http://").split(":")
    sent, piece = 0, b"a" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        with pytest.raises(OSError):         # reset / broken pipe once the bound is passed
            while sent < 1_000_000_000:
                s.sendall(piece)
                sent += len(piece)
    # the server cut it once it had discarded more than the bound; the piece in flight when the reset
    # came is not counted in `sent`
    assert GuardedHttpProtocol.linger_bytes - len(piece) <= sent < 4 * GuardedHttpProtocol.linger_bytes
    _ok(server.url)


def test_curl_style_form_content_type_is_read_as_json(server):
    r = httpx.post(server.url + CMPL, content=b'{"model": "tiny", "prompt": "x", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + CMPL)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="missing", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    assert e.value.code == "context_length_exceeded"


def test_client_request_id_is_echoed(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-request-id": "trace-abc.123"})
    assert r.headers["x-request-id"] == "trace-abc.123"
    r = httpx.get(server.url + "/v1/models", headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"] != "bad id\twith spaces"
    assert "server-timing" in r.headers


def test_trickling_body_is_cut_off(serve_tiny):
    """A client that never finishes its body gets 408, not a worker held forever."""
    srv = serve_tiny(ServerSettings(drain_grace_s=0.5, body_timeout_s=0.5))
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"mo")
        data = s.recv(4096)
    assert b" 408 " in data.split(b"\r\n")[0] and b"request_timeout" in data
    _ok(srv.url)


def test_api_keys(serve_tiny):
    srv = serve_tiny(ServerSettings(api_keys=("k-one", "k-two"), drain_grace_s=0.5))
    r = httpx.get(srv.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer k-wrong"})
    assert r.status_code == 401
    for key in ("k-one", "k-two"):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(srv.url + "/health").status_code == 200       # probes need no key
    assert httpx.get(srv.url + "/metrics").status_code == 200


# bodies whose JSON edge cases the two validators (json.loads + pydantic, pydantic from the bytes) could read
# differently: the hot path must answer each exactly as FastAPI's route does
RAW_EDGE = [b" ", b"null", b" null ", b"{}", b"true", b'"text"', b"{" * 5000, b'{"model": "tiny", "prompt": NaN}',
            b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', b'{"model": "tiny", "prompt": "\\ud800"}',
            b'{"model": "tiny", "model": 7, "prompt": "x"}', b'{"model": "tiny", "prompt": "x", "seed": 1' + b"0" * 40 + b"}",
            b'{"model": "tiny", "prompt": "x", "temperature": 1.5e0, "max_tokens": 2.0}',
            b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "max_tokens": 1}']


def test_hot_path_answers_bad_input_as_fastapi_does(server, serve_tiny):
    """The generation endpoints skip FastAPI's router (sits.api.hot_path); with it off, the same
    bodies go through FastAPI. Status, code, param and type must agree for every bad input."""
    baseline = serve_tiny(ServerSettings(max_body_bytes=64 * 1024, drain_grace_s=1.0, hot_path=False))
    cases = [(p, b) for _, p, b, *_ in BAD if p in (CHAT, CMPL)] + [(p, raw) for raw in RAW_EDGE for p in (CHAT, CMPL)]

    def answer(url, path, body):
        if isinstance(body, bytes):
            r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
        else:
            r = httpx.post(url + path, json=body)
        err = r.json().get("error") if r.headers["content-type"].startswith("application/json") else None
        return r.status_code, err and (err["code"], err["param"], err["type"])

    for path, body in cases:
        hot, slow = answer(server.url, path, body), answer(baseline.url, path, body)
        assert hot == slow, (path, body[:80] if isinstance(body, bytes) else body, hot, slow)
        assert hot[0] < 500, (path, body, hot)
    _ok(server.url)
