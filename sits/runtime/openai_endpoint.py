"""A client of an OpenAI-compatible endpoint (another SITS, vLLM, a cloud API): one streamed POST at
a time, its chunks as dicts, and every way it can fail as a typed ``SitsError``.

What the endpoint says about the client's request (a 400 with its code) reaches the client as it
was said; what says something about the endpoint itself (unreachable, 5xx, a broken stream, our own
credentials refused) is a 5xx of the gateway's, so the unit's SLA breaker counts it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import orjson

from sits.engine.errors import SitsError


class RemoteError(SitsError):
    code = "remote_error"
    http_status = 502


def _error_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"message": raw[:300].decode("utf-8", "replace").strip()}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return err
    if isinstance(err, str):
        return {"message": err}
    return {"message": str(body)[:300]}


def status_error(where: str, status: int, raw: bytes, retry_after: str | None) -> SitsError:
    """The ``SitsError`` for an endpoint's non-200 answer."""
    err = _error_body(raw)
    message = f"{where}: {err.get('message') or f'HTTP {status}'}"
    code = err.get("code") if isinstance(err.get("code"), str) else None
    if status in (401, 403):       # the gateway's key, not the client's: the operator's to fix
        e = RemoteError(f"{where} refused the gateway's credentials (HTTP {status}): check backend.api_key_env",
                        code="remote_auth_failed")
    elif status == 404:
        e = RemoteError(message + " (check backend.model and backend.openai)", code="remote_not_found")
    elif status == 429:
        e = SitsError(message, code="remote_rate_limited")
        e.http_status = 429
    elif 400 <= status < 500:     # the request itself: the client's to fix, with the endpoint's own code
        e = SitsError(message, param=err.get("param") if isinstance(err.get("param"), str) else None,
                      code=code or "remote_invalid_request")
        e.http_status = status
    elif status == 503:
        e = RemoteError(message, code="remote_unavailable")
        e.http_status = 503
    else:
        e = RemoteError(message, code="remote_error")
    if retry_after is not None and retry_after.strip().isdigit():
        e.retry_after_s = int(retry_after.strip())
    elif e.http_status in (429, 503):
        e.retry_after_s = 1
    return e


class OpenAIEndpoint:
    """One endpoint's base URL, key and connection pool."""

    def __init__(self, base_url: str, api_key: str | None, *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 300.0, max_connections: int = 64, name: str = "remote"):
        self.base_url = base_url.rstrip("/")
        self.name = name
        headers = {"accept": "text/event-stream"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            # pool=None: past max_connections a request waits here for a connection (the gateway's own
            # load), rather than failing as if the endpoint were slow
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def stream(self, path: str, body: dict, headers: dict[str, str] | None = None) -> AsyncIterator[dict]:
        """The chunks of one streamed POST, until ``data: [DONE]``. A stream that ends without it,
        or a chunk that is an error, raises."""
        where = f"{self.name} ({self.base_url})"
        try:
            async with self._client.stream("POST", path, content=orjson.dumps(body),
                                           headers={"content-type": "application/json", **(headers or {})}) as resp:
                if resp.status_code != 200:
                    raise status_error(where, resp.status_code, await resp.aread(), resp.headers.get("retry-after"))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        raise RemoteError(f"{where} sent a chunk that is not JSON: {data[:120]!r}",
                                          code="remote_bad_response") from None
                    if not isinstance(chunk, dict):
                        raise RemoteError(f"{where} sent a chunk that is not an object", code="remote_bad_response")
                    if isinstance(chunk.get("error"), dict):      # the endpoint ended the stream with an error
                        err = chunk["error"]        # its code is the endpoint's: namespaced, never one of ours
                        raise RemoteError(f"{where}: {err.get('message') or 'error in the stream'} "
                                          f"(its code: {err.get('code')})", code="remote_stream_error")
                    yield chunk
                raise RemoteError(f"{where} ended the stream before data: [DONE]", code="remote_stream_broken")
        except httpx.ConnectError as e:
            err = RemoteError(f"{where} cannot be reached: {e}", code="remote_unreachable")
            err.http_status, err.retry_after_s = 503, 1
            raise err from None
        except httpx.TimeoutException as e:
            err = RemoteError(f"{where} did not answer in time ({type(e).__name__})", code="remote_timeout")
            err.http_status = 504
            raise err from None
        except httpx.HTTPError as e:        # the connection broke mid-response
            raise RemoteError(f"{where}: the response broke off ({type(e).__name__}: {e})",
                              code="remote_stream_broken") from None

    async def aclose(self) -> None:
        await self._client.aclose()
