"""Webhook delivery: every state transition of a request POSTed to its ``callback_url``, in order.

One worker task per request delivers its events one after another (a receiver never sees EXECUTING
before VALIDATING), retrying network errors, 5xx and 429 with exponential backoff. With a secret
configured each POST is signed: ``X-SITS-Signature: sha256=HMAC(secret, "{timestamp}.{body}")``
with the timestamp in ``X-SITS-Timestamp``, so a receiver can verify origin and reject replays.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import time
from urllib.parse import urlsplit

import httpx

from sits.api.lifecycle import LifecycleEvent
from sits.api.metrics import ServerMetrics
from sits.engine.errors import InvalidRequestError

log = logging.getLogger("sits.webhooks")


def validate_callback_url(url: str, *, allow_private: bool = True) -> str:
    """A 400 unless ``url`` is a plain absolute http(s) URL (no credentials, no control characters)."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"callback_url {why}", param="callback_url", code="invalid_callback_url")

    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise bad("must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise bad(f"is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise bad("must be an http:// or https:// URL")
    if not parts.hostname:
        raise bad("has no host")
    if parts.username or parts.password:
        raise bad("must not carry credentials")
    if not allow_private:
        try:
            ip = ipaddress.ip_address(parts.hostname)
        except ValueError:
            ip = None
        if parts.hostname == "localhost" or (ip is not None and (ip.is_private or ip.is_loopback
                                                                 or ip.is_link_local)):
            raise bad("points at a private or loopback address, which this server refuses")
    return url


def sign(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={mac}"


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver does (and what the tests check)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookDispatcher:
    def __init__(self, metrics: ServerMetrics, *, secret: str | None = None, max_attempts: int = 5,
                 backoff_s: float = 0.25, timeout_s: float = 5.0):
        self.metrics = metrics
        self.secret = secret
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False,
                                         headers={"user-agent": "sits-webhooks/1"})
        self._queues: dict[str, asyncio.Queue] = {}
        self._workers: set[asyncio.Task] = set()

    def subscriber(self, request_id: str, url: str):
        """The lifecycle subscriber that queues this request's events for ``url``."""
        def on_event(ev: LifecycleEvent) -> None:
            q = self._queues.get(request_id)
            if q is None:
                q = self._queues[request_id] = asyncio.Queue()
                task = asyncio.get_running_loop().create_task(self._worker(request_id, url, q))
                self._workers.add(task)
                task.add_done_callback(self._workers.discard)
            q.put_nowait(ev)
        return on_event

    async def _worker(self, request_id: str, url: str, q: asyncio.Queue) -> None:
        try:
            while True:
                ev: LifecycleEvent = await q.get()
                await self._deliver(url, ev)
                if ev.state.terminal:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def _deliver(self, url: str, ev: LifecycleEvent) -> bool:
        body = json.dumps({"object": "sits.request.event", **ev.to_dict()}, separators=(",", ":")).encode()
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            ts = str(int(time.time()))
            headers = {"content-type": "application/json", "x-sits-timestamp": ts,
                       "x-sits-event": ev.state.value, "x-sits-request-id": ev.request_id,
                       "x-sits-delivery-attempt": str(attempt)}
            if self.secret:
                headers["x-sits-signature"] = sign(self.secret, ts, body)
            try:
                r = await self._client.post(url, content=body, headers=headers)
                if r.status_code < 300:
                    self.metrics.webhook_deliveries.labels("delivered").inc()
                    return True
                retry = r.status_code >= 500 or r.status_code == 429
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                retry, why = True, f"{type(e).__name__}: {e}"
            if not retry or attempt == self.max_attempts:
                log.warning("webhook %s for %s (%s) failed after %d attempt(s): %s", url, ev.request_id,
                            ev.state.value, attempt, why)
                self.metrics.webhook_deliveries.labels("failed").inc()
                return False
            self.metrics.webhook_deliveries.labels("retried").inc()
            await asyncio.sleep(delay)
            delay *= 2
        return False

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Let queued deliveries finish for up to ``grace_s``, then stop."""
        if self._workers:
            await asyncio.wait(list(self._workers), timeout=grace_s)
        for t in list(self._workers):
            t.cancel()
        await self._client.aclose()
