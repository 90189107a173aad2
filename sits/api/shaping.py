"""Request shaping: what both dialects do to turn a client's request into a prompt and its parameters.

The pipeline is the same for ``/v1/chat/completions`` and ``/v1/requests``: the session's history
goes in front (``X-Session-ID``), retrieved memories join the system prompt (``memory_ref`` or a
RAG unit's set), the chat template renders the conversation with any tools, the tokenizer encodes
it, and ``SamplingParams`` are built with the client's nulls meaning the defaults. Each dialect
keeps only what is its own: how it reads its body and how it answers. Token-level validation is
not here: ``Backend.prepare`` does it once, against the serving engine's real limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sits.api.backend import Backend
from sits.api.context import ServerContext
from sits.api.retrieval import last_user_text, recall, with_context
from sits.api.session import SessionTurn
from sits.runtime.message_unit import MessagePrompt
from sits.tenancy.principal import scoped
from sits.engine.errors import ContextLengthExceededError, InvalidRequestError
from sits.engine.sampling_params import SamplingParams
from sits.engine.tool_format import ToolSpec


@dataclass(slots=True)
class ShapedPrompt:
    """A request's prompt as the model will read it, and what was gathered on the way."""

    prompt: str | list[int] | MessagePrompt   # token ids once a template rendered it; a plain text prompt as it is
    messages: list[dict] | None = None   # the whole conversation (history and retrieved context included)
    citations: list[dict] = field(default_factory=list)


async def gather_conversation(ctx: ServerContext, backend: Backend, messages: list[dict], *, turn: SessionTurn | None,
                              memory_ref: str | None, response_id: str) -> tuple[list[dict], list[dict]]:
    """``(conversation, citations)``: the session's history in front of ``messages``, then the closest
    memories of ``memory_ref`` (or of the unit's own set) in its system prompt."""
    if turn is not None:
        messages = await turn.conversation(messages)
    citations, context = await _recall(ctx, backend, memory_ref, last_user_text(messages), response_id)
    return (with_context(messages, context) if context else messages), citations


async def shape_chat(ctx: ServerContext, backend: Backend, messages: list[dict], *, turn: SessionTurn | None,
                     memory_ref: str | None, response_id: str, tools: list[ToolSpec] | None = None,
                     add_generation_prompt: bool = True, add_special_tokens: bool = False) -> ShapedPrompt:
    """A conversation: gathered (``gather_conversation``), rendered with ``tools`` and encoded."""
    messages, citations = await gather_conversation(ctx, backend, messages, turn=turn, memory_ref=memory_ref,
                                                    response_id=response_id)
    ids = encode_chat(backend, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                      add_special_tokens=add_special_tokens)
    return ShapedPrompt(ids, messages, citations)


async def shape_text(ctx: ServerContext, backend: Backend, prompt: str, *, memory_ref: str | None,
                     response_id: str) -> ShapedPrompt:
    """A plain prompt (no template): retrieved memories go in front of it as context."""
    citations, context = await _recall(ctx, backend, memory_ref, prompt, response_id)
    text = f"Context:\n{context}\n\nQuestion: {prompt}\nAnswer:" if context else prompt
    return ShapedPrompt(text, None, citations)


async def _recall(ctx: ServerContext, backend: Backend, memory_ref: str | None, question: str,
                  response_id: str) -> tuple[list[dict], str]:
    shared = backend.features.memory_set                     # a RAG unit retrieves by itself
    # a set the client names is its tenant's own, unless it names the unit's shared set
    set_name = shared if memory_ref is None or memory_ref == shared else scoped(memory_ref)
    if set_name is None:
        return [], ""
    return await recall(ctx, set_name, question, response_id, backend.features.memory_top_k,
                        required=memory_ref is not None)


def encode_chat(backend: Backend, messages: list[dict], *, tools: list[ToolSpec] | None = None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int] | MessagePrompt:
    """The conversation rendered by the model's chat template and encoded (at most the context's
    length: anything longer is refused by ``prepare`` with the real numbers). The template spells
    out its special tokens, so the tokenizer adds none unless asked (``add_special_tokens``).
    A backend with ``message_prompts`` (a remote endpoint, a mesh) gets the messages (a ``MessagePrompt``)."""
    if backend.features.message_prompts:
        if not add_generation_prompt:
            raise InvalidRequestError(f"{backend.name} renders its chat template where its model runs: "
                                      "add_generation_prompt: false is not passed through",
                                      param="add_generation_prompt", code="unsupported_parameter")
        return MessagePrompt(messages, tools)
    if len(messages) > backend.max_model_len:     # every message renders to a token at least
        raise ContextLengthExceededError(f"{len(messages)} messages cannot fit in this model's "
                                         f"{backend.max_model_len} tokens", param="messages")
    ids = backend.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        add_special_tokens=add_special_tokens, max_tokens=backend.max_model_len)
    if not ids:
        raise InvalidRequestError("the rendered conversation is empty", param="messages", code="empty_prompt")
    return ids


def default_max_tokens(backend: Backend, prompt_len: int) -> int:
    """What a missing ``max_tokens`` means: the rest of the context and of the KV pool (at most the
    model's own ``max_new_tokens`` default, when its generation config has one)."""
    room = min(backend.max_model_len, backend.kv_capacity_tokens) - prompt_len
    if room < 1:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {backend.max_model_len} tokens and the prompt has "
            f"{prompt_len}: no room is left for output", param="messages")
    return min(room, int(backend.sampling_defaults.get("max_tokens", room)))


def sampling_params(max_tokens: int, *, defaults: Mapping[str, float] | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                    presence_penalty: float | None = None, frequency_penalty: float | None = None,
                    repetition_penalty: float | None = None, stop: str | list[str] | None = None,
                    stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                    logprobs: int | None = None, grammar: str | None = None) -> SamplingParams:
    """``SamplingParams`` from a request's fields. A ``None`` (the client sent null or nothing) takes
    the model's default from ``defaults`` (its ``generation_config.json``, as vLLM applies it), else
    the API's; a negative ``top_k`` means no top-k, as in vLLM."""
    d = defaults or {}
    temperature = d.get("temperature") if temperature is None else temperature
    top_p = d.get("top_p") if top_p is None else top_p
    top_k = d.get("top_k") if top_k is None else top_k
    min_p = d.get("min_p") if min_p is None else min_p
    repetition_penalty = d.get("repetition_penalty") if repetition_penalty is None else repetition_penalty
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        min_p=min_p or 0.0,
        seed=seed,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos,
        logprobs=logprobs, grammar=grammar)
