"""``X-Session-ID`` for both dialects: a request's part in a stored conversation.

``SessionTurn`` loads the history before the prompt is built (``conversation``) and appends the new
turns with the answer once the response is complete (``remember``). A failed or aborted response
adds nothing.
"""

from __future__ import annotations

from sits.api.context import ServerContext
from sits.engine.tokenizer import check_text
from sits.memory.sessions import SessionStore, with_history
from sits.runtime.hints import current_hints
from sits.tenancy.principal import scoped


class SessionTurn:
    def __init__(self, store: SessionStore, session_id: str):
        self.store = store
        self.session_id = session_id
        self.key = scoped(session_id)           # stored in the tenant's namespace: another tenant's id is new
        self.new_messages: list[dict] = []
        self.turns = 0

    @classmethod
    def of(cls, ctx: ServerContext) -> "SessionTurn | None":
        sid = current_hints.get().session_id
        return cls(ctx.sessions, sid) if sid and ctx.sessions is not None else None

    async def conversation(self, messages: list[dict]) -> list[dict]:
        """The stored history in front of ``messages`` (unless the client already sent it)."""
        check_text(messages, "messages")    # what a session stores, GET /v1/sessions/{id} must be able to answer
        s = await self.store.get(self.key)
        self.turns = s.turns if s is not None else 0
        full, self.new_messages = with_history(s.messages if s is not None else [], messages)
        return full

    async def remember(self, answer: str, *, unit: str, instance: str | None = None,
                       memory_refs: list[str] | None = None) -> None:
        s = await self.store.append(self.key, self.new_messages + [{"role": "assistant", "content": answer}],
                                    unit=unit, instance=instance, memory_refs=memory_refs)
        self.turns = s.turns

    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.session_id}
