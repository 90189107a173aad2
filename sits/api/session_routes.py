"""``X-Session-ID`` for both dialects, and ``/v1/sessions/{id}`` to read or forget one.

``SessionTurn`` is one request's part in a session: it loads the history before the prompt is
built (``conversation``) and appends the new turns with the answer once the response is complete
(``remember``). A failed or aborted response adds nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sits.api.context import ServerContext, context_of
from sits.api.errors import clip, error_docs
from sits.engine.errors import SitsError
from sits.engine.tokenizer import check_text
from sits.memory.sessions import SessionStore, with_history
from sits.runtime.hints import current_hints

router = APIRouter(tags=["sits"])


class SessionNotFoundError(SitsError):
    code = "session_not_found"
    http_status = 404


class SessionTurn:
    def __init__(self, store: SessionStore, session_id: str):
        self.store = store
        self.session_id = session_id
        self.new_messages: list[dict] = []
        self.turns = 0

    @classmethod
    def of(cls, ctx: ServerContext) -> "SessionTurn | None":
        sid = current_hints.get().session_id
        return cls(ctx.sessions, sid) if sid and ctx.sessions is not None else None

    async def conversation(self, messages: list[dict]) -> list[dict]:
        """The stored history in front of ``messages`` (unless the client already sent it)."""
        check_text(messages, "messages")    # what a session stores, GET /v1/sessions/{id} must be able to answer
        s = await self.store.get(self.session_id)
        self.turns = s.turns if s is not None else 0
        full, self.new_messages = with_history(s.messages if s is not None else [], messages)
        return full

    async def remember(self, answer: str, *, unit: str, instance: str | None = None,
                       memory_refs: list[str] | None = None) -> None:
        s = await self.store.append(self.session_id, self.new_messages + [{"role": "assistant", "content": answer}],
                                    unit=unit, instance=instance, memory_refs=memory_refs)
        self.turns = s.turns

    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.session_id}


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
    s = await _store(request).get(session_id)
    if s is None:
        raise SessionNotFoundError(f"no session {clip(session_id)}", param="session_id")
    return {"object": "session", **s.to_dict()}


@router.delete("/v1/sessions/{session_id}", responses=ERRORS)
async def delete_session(session_id: str, request: Request) -> JSONResponse:
    if not await _store(request).delete(session_id):
        raise SessionNotFoundError(f"no session {clip(session_id)}", param="session_id")
    return JSONResponse({"id": session_id, "deleted": True})
