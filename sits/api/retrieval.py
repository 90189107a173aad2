"""Retrieval for a request: the closest memories of a set in front of its question, as citations.

Both dialects use it: the SITS dialect for ``memory_ref`` and RAG units, the OpenAI chat route for
RAG units. The model reads whole chunks; the citations show the first 500 characters of each.
"""

from __future__ import annotations


from sits.api.context import ServerContext
from sits.api.errors import clip
from sits.engine.errors import InvalidRequestError
from sits.engine.tokenizer import check_text
from sits.memory.vectors import off_loop
from sits.tenancy.principal import scoped
from sits.runtime.features import DEFAULT_MEMORY_TOP_K


def last_user_text(messages: list[dict]) -> str:
    """The conversation's last user turn (else its last message): what retrieval searches for."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])


def with_context(messages: list[dict], context: str) -> list[dict]:
    """The retrieved context joins the conversation's system prompt (one system message, first: some
    chat templates accept no other)."""
    note = f"Answer from this context, citing the ids:\n{context}"
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


async def recall(ctx: ServerContext, set_name: str, question: str, rid: str, k: int = DEFAULT_MEMORY_TOP_K, *,
                 required: bool = True) -> tuple[list[dict], str]:
    """(citations, the context text for the prompt): the set's ``k`` closest memories to ``question``,
    recorded as retrieved by ``rid``. ``required``: an empty or unknown set is an error (an explicit
    memory_ref), else the request goes on without context (a RAG unit whose set is empty)."""
    check_text(question, "prompt")        # before the embedder, which has no words for it
    store = ctx.memory
    if store is None:
        raise InvalidRequestError(f"no memory set {clip(set_name)} exists (this server keeps no memory)",
                                  param="memory_ref", code="memory_not_found")
    hits = await off_loop(store.search, set_name, question, k, response_id=scoped(rid))
    if not hits:
        if not required:
            return [], ""
        raise InvalidRequestError(f"no memory set {clip(set_name)} exists (or it holds nothing now)",
                                  param="memory_ref", code="memory_not_found")
    citations = [{"id": f"m_{h.id}", "score": round(h.score, 4), "text": h.text[:500], "meta": h.meta} for h in hits]
    return citations, "\n".join(f"[m_{h.id}] {h.text}" for h in hits)     # the model reads whole chunks
