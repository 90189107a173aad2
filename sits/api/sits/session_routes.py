"""``/v1/sessions/{id}``: read or forget a session (what ``X-Session-ID`` requests built up:
``sits.api.session``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.context import context_of
from sits.api.errors import clip, error_docs
from sits.engine.errors import SitsError
from sits.memory.sessions import SessionStore
from sits.tenancy.principal import scoped

router = APIRouter(tags=["sits"])


class SessionNotFoundError(SitsError):
    code = "session_not_found"
    http_status = 404


ERRORS = error_docs({
    401: "missing or wrong API key",
    404: "no such session, or this server keeps none",
})


def _store(request: Request) -> SessionStore:
    store = context_of(request).sessions
    if store is None:
        raise SessionNotFoundError("this server keeps no sessions: start it with --session-store or a --data-dir",
                                   param="session_id", code="sessions_disabled")
    return store


@router.get("/v1/sessions/{session_id}", responses=ERRORS)
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    """A session's conversation, unit, last instance and turn count."""
    s = await _store(request).get(scoped(session_id))
    if s is None:
        raise SessionNotFoundError(f"no session {clip(session_id)}", param="session_id")
    return {"object": "session", **s.to_dict(), "id": session_id}


@router.delete("/v1/sessions/{session_id}", responses=ERRORS)
async def delete_session(session_id: str, request: Request) -> JSONResponse:
    if not await _store(request).delete(scoped(session_id)):
        raise SessionNotFoundError(f"no session {clip(session_id)}", param="session_id")
    return JSONResponse({"id": session_id, "deleted": True})
