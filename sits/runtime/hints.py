"""Per-request routing hints, carried from the HTTP edge to the runtime in a context variable.

The HTTP layer sets them (``X-Session-ID``, the W3C trace id) when a request arrives; the gateway's
router and prefetcher read them. A context variable follows the request into every task it spawns,
and the Backend API stays free of transport details.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestHints:
    session_id: str | None = None
    trace_id: str | None = None
    path: str | None = None          # the HTTP route (fault injection can be scoped to routes)

    @property
    def chain_key(self) -> str | None:
        """What ties consecutive calls together for pre-warming: the session, else the trace."""
        return self.session_id or self.trace_id


current_hints: contextvars.ContextVar[RequestHints] = contextvars.ContextVar("sits_request_hints",
                                                                              default=RequestHints())
