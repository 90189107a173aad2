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
import socket
import json
import logging
import time
from urllib.parse import urlsplit

import httpx

from sits.api.metrics import ServerMetrics
from sits.api.sits.lifecycle import LifecycleEvent
from sits.engine.errors import InvalidRequestError
from sits.observe import tracing

log = logging.getLogger("sits.webhooks")


MAX_CALLBACK_URL = 2048


def _literal_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names literally, in any form a resolver accepts (127.1, 2130706433, 0x7f.1, ::1)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))     # the classic shorthand / decimal / hex forms
    except OSError:
        return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")      # RFC 6052: the IPv4 address is the last 32 bits


def is_private_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Anything but a globally routable unicast address (IPv4 inside IPv6 forms unwrapped): private,
    loopback, link-local, CGNAT (100.64/10, e.g. a cloud metadata address), reserved, multicast."""
    if isinstance(ip, ipaddress.IPv6Address):
        nat64 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None
        for inner in (ip.ipv4_mapped, ip.sixtofour, (ip.teredo or (None, None))[1], nat64):
            if inner is not None and is_private_address(inner):
                return True
        if nat64 is not None:
            return False         # a public IPv4 address through the well-known NAT64 prefix
        # reserved: ::/8 and the other unassigned blocks, which hold IPv4-compatible ::a.b.c.d,
        # IPv4-translated ::ffff:0:a.b.c.d and NAT64's local-use 64:ff9b:1::/48 (Python calls them global)
        if ip.is_site_local or ip.is_reserved:
            return True
    return not ip.is_global or ip.is_multicast


def validate_callback_url(url: str, *, allow_private: bool = False) -> str:
    """A 400 unless ``url`` is a plain absolute http(s) URL (no credentials, no control characters),
    and, unless ``allow_private``, one that does not name a loopback / private / link-local host
    (the server's own admin endpoints, a cloud metadata service). Names that *resolve* to such an
    address are refused at delivery time (``WebhookDispatcher``)."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"callback_url {why}", param="callback_url", code="invalid_callback_url")

    if len(url) > MAX_CALLBACK_URL:
        raise bad(f"is longer than {MAX_CALLBACK_URL} characters")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise bad("must not contain whitespace or control characters")
    if "%0d" in url.lower() or "%0a" in url.lower() or "%00" in url:
        raise bad("must not contain encoded line breaks or NUL")
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
    try:
        parts.hostname.encode("idna")
    except UnicodeError:
        raise bad("has a host name that is not valid (IDNA)") from None
    if not allow_private:
        host = parts.hostname.rstrip(".")
        ip = _literal_ip(host)
        if host == "localhost" or host.endswith(".localhost") or (ip is not None and is_private_address(ip)):
            raise bad("points at a private or loopback address, which this server refuses "
                      "(start it with --allow-private-callbacks to allow)")
    return url


async def public_address(host: str) -> str | None:
    """The address to connect to for ``host``, or None if it resolves to any non-public address
    (or not at all). Delivery connects to exactly this address, so a name cannot be re-resolved to
    a private one between the check and the POST (DNS rebinding)."""
    ip = _literal_ip(host)
    if ip is not None:
        return None if is_private_address(ip) else str(ip)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    except (OSError, UnicodeError, ValueError):
        return None
    if not addrs or any(is_private_address(a) for a in addrs):
        return None
    return str(addrs[0])


def _pinned(url: str, address: str) -> tuple[str, dict[str, str], dict]:
    """``url`` with its host replaced by ``address``; the Host header (and TLS SNI) keep the name."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host + (f":{parts.port}" if parts.port else "")
    ext = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return parts._replace(netloc=netloc).geturl(), {"host": parts.netloc.rpartition("@")[2]}, ext


def sign(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={mac}"


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver does (and what the tests check)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookDispatcher:
    def __init__(self, metrics: ServerMetrics, *, secret: str | None = None, max_attempts: int = 5,
                 backoff_s: float = 0.25, timeout_s: float = 5.0, allow_private: bool = False):
        self.metrics = metrics
        self.allow_private = allow_private
        self.secret = secret
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False,
                                         headers={"user-agent": "sits-webhooks/1"})
        self._queues: dict[str, asyncio.Queue] = {}
        self._workers: set[asyncio.Task] = set()

    def subscriber(self, request_id: str, url: str, trace: "tracing.Scope | None" = None,
                   traceparent: str | None = None):
        """The lifecycle subscriber that queues this request's events for ``url``. Deliveries carry
        ``traceparent``: the request's execution span when traced (and are spans under it), else the
        trace the client sent."""
        def on_event(ev: LifecycleEvent) -> None:
            q = self._queues.get(request_id)
            if q is None:
                q = self._queues[request_id] = asyncio.Queue()
                task = asyncio.get_running_loop().create_task(self._worker(request_id, url, q, trace, traceparent))
                self._workers.add(task)
                task.add_done_callback(self._workers.discard)
            q.put_nowait(ev)
        return on_event

    async def _worker(self, request_id: str, url: str, q: asyncio.Queue, trace=None,
                      traceparent: str | None = None) -> None:
        tp = trace.traceparent if trace is not None else traceparent
        # one live span for the whole delivery sequence: the trace is decided only after its last POST
        calls = tracing.open_child("webhooks", time.monotonic(), parent=trace, level="L4", async_mechanism="callback",
                                   attributes={"url.full": url}) if trace is not None else None
        failed = False
        try:
            while True:
                ev: LifecycleEvent = await q.get()
                t0 = time.monotonic()
                ok = await self._deliver(url, ev, tp)
                failed |= not ok
                if calls is not None:
                    tracing.stage("webhook.deliver", t0, time.monotonic(), parent=calls, level="L4",
                                  error=None if ok else "webhook_failed", attributes={"sits.event": ev.state.value})
                if ev.state.terminal:
                    return
        finally:
            self._queues.pop(request_id, None)
            tracing.close(calls, error="webhook_failed" if failed else None)

    async def _deliver(self, url: str, ev: LifecycleEvent, traceparent: str | None = None) -> bool:
        target, pin_headers, ext = url, {}, {}
        if not self.allow_private:
            address = await public_address(urlsplit(url).hostname or "")
            if address is None:
                log.warning("webhook %s for %s refused: the host does not resolve to a public address",
                            url, ev.request_id)
                self.metrics.webhook_deliveries.labels("refused").inc()
                return False
            target, pin_headers, ext = _pinned(url, address)
        body = json.dumps({"object": "sits.request.event", **ev.to_dict()}, separators=(",", ":")).encode()
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            ts = str(int(time.time()))
            headers = {"content-type": "application/json", "x-sits-timestamp": ts,
                       "x-sits-event": ev.state.value, "x-sits-request-id": ev.request_id,
                       "x-sits-delivery-attempt": str(attempt)}
            if self.secret:
                headers["x-sits-signature"] = sign(self.secret, ts, body)
            if traceparent:
                headers["traceparent"] = traceparent
            try:
                r = await self._client.post(target, content=body, headers=headers | pin_headers,
                                            extensions=ext or None)
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
