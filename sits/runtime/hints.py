"""Per-request routing hints: the session, the trace, the route a request came by, and its SLA
headers (a mesh routes by them).

The HTTP edge sets them (``X-Session-ID``, the W3C trace id, the path) in a context variable when a
request arrives, which follows the request into every task it spawns (an async ``/v1/requests``
runs in one); the API layer hands them to ``Backend.stream`` explicitly, and the gateway's router,
prefetcher and fault injection read them from there.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestHints:
    session_id: str | None = None
    trace_id: str | None = None
    path: str | None = None          # the HTTP route (fault injection can be scoped to routes)
    ttft_budget_ms: str | None = None   # X-SITS-TTFT-Budget-Ms, as sent (a mesh checks and routes by it)
    cost_cap: str | None = None         # X-SITS-Cost-Cap, as sent

    @property
    def chain_key(self) -> str | None:
        """What ties consecutive calls together for pre-warming: the session, else the trace."""
        return self.session_id or self.trace_id


current_hints: contextvars.ContextVar[RequestHints] = contextvars.ContextVar("sits_request_hints",
                                                                              default=RequestHints())
