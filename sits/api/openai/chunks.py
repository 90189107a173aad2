"""The OpenAI dialect's response shapes: streamed chunks and final choices of completions and chat
completions, and their ``logprobs``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from sits.api.backend import Backend
from sits.api.generation import ChoiceResult, Generation
from sits.api.openai.structured import Guidance, ToolCallStream, assistant_message
from sits.engine.messages import TokenEvent


def _token_text(backend: Backend, tid: int) -> str:
    return backend.tokenizer.decode([tid], skip_special_tokens=False)


def completion_logprobs(backend: Backend, ch: ChoiceResult, start: int = 0, offset0: int = 0,
                        events: list[TokenEvent] | None = None) -> dict[str, Any]:
    ids = ch.token_ids[start:]
    lps = ch.logprobs[start:]
    tops = ch.top_logprobs[start:]
    tokens = [_token_text(backend, t) for t in ids]
    offsets, pos = [], offset0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = None
    if any(t is not None for t in tops):
        top = [None if t is None else {_token_text(backend, i): lp for i, lp in t} for t in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(backend: Backend, ch: ChoiceResult, start: int = 0) -> dict[str, Any]:
    content = []
    for tid, lp, top in zip(ch.token_ids[start:], ch.logprobs[start:], ch.top_logprobs[start:]):
        tok = _token_text(backend, tid)
        token_bytes = backend.tokenizer.token_bytes      # the token's real bytes, half a character or not
        content.append({"token": tok, "logprob": lp, "bytes": list(token_bytes(tid)),
                        "top_logprobs": [{"token": _token_text(backend, i), "logprob": v,
                                          "bytes": list(token_bytes(i))} for i, v in (top or [])]})
    return {"content": content}



class Chunks(ABC):
    """One dialect's shapes: streamed chunks from merged (choice, event) pairs, and the final choices."""

    obj = ""                 # the "object" of a streamed chunk
    response_object = ""     # ... and of the non-streamed response

    def __init__(self, cid: str, backend: Backend, gen: Generation, body):
        self.cid, self.backend, self.gen, self.body = cid, backend, gen, body
        self.citations: list[dict] = []      # a RAG unit's retrieved memories (an extra field clients ignore)
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def base(self, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.cid, "object": self.obj, "created": self.created, "model": self.backend.name,
                "choices": choices}

    def opening(self) -> list[dict]:
        return []

    @abstractmethod
    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        """The chunk for one event of choice ``i``, or None when it carries nothing to show."""

    @abstractmethod
    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        """One choice of the non-streamed response."""

    def usage(self) -> dict:
        out = self.base([])
        out["usage"] = self.gen.usage()
        return out


class CompletionChunks(Chunks):
    obj = response_object = "text_completion"

    def __init__(self, *a, echo: list[str] | None = None):
        super().__init__(*a)
        # echo: each prompt's text goes in front of its choices' text (the first chunk carries it)
        self.echo = [echo[c.prompt_index] for c in self.gen.choices] if echo else [""] * len(self.gen.choices)
        self.offsets = [len(e) for e in self.echo]

    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        return {"index": ch.index, "text": self.echo[ch.index] + "".join(ch.text), "finish_reason": ch.finish_reason,
                "logprobs": completion_logprobs(self.backend, ch) if self.body.logprobs is not None else None}

    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished:
            return None
        ch = self.gen.choices[i]
        text, self.echo[i] = self.echo[i] + ev.text, ""
        c: dict[str, Any] = {"index": i, "text": text, "logprobs": None,
                             "finish_reason": ev.finish_reason if ev.finished else None}
        if self.body.logprobs is not None and ev.token_id is not None:
            c["logprobs"] = completion_logprobs(self.backend, ch, start=len(ch.token_ids) - 1,
                                                offset0=self.offsets[i])
        self.offsets[i] += len(ev.text)
        return self.base([c])


class ChatChunks(Chunks):
    obj = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, cid: str, backend: Backend, gen: Generation, body, guidance: Guidance):
        super().__init__(cid, backend, gen, body)
        self.guidance = guidance
        self.calls = [ToolCallStream(guidance) for _ in gen.choices] if guidance.calls_tools else None

    def final_choice(self, ch: ChoiceResult) -> dict[str, Any]:
        message, finish_reason, errors = assistant_message(self.guidance, "".join(ch.text), ch.finish_reason)
        out = {"index": ch.index, "message": message, "finish_reason": finish_reason,
               "logprobs": chat_logprobs(self.backend, ch) if self.body.logprobs else None}
        if errors:
            out["tool_call_errors"] = errors
        return out

    def opening(self) -> list[dict]:
        out = [self.base([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]) for c in self.gen.choices]
        if self.citations:
            out[0]["citations"] = self.citations
        return out

    def delta(self, i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished:
            return None
        ch = self.gen.choices[i]
        text, finish_reason, delta, errors = ev.text, ev.finish_reason if ev.finished else None, {}, []
        if self.calls is not None:       # prose streams; calls are read whole at the end
            text = self.calls[i].feed(ev.text)
            if ev.finished:
                rest, calls, errors = self.calls[i].finish()
                text += rest
                if calls:
                    delta["tool_calls"] = calls
                    if finish_reason != "length":     # cut off by max_tokens stays "length"
                        finish_reason = "tool_calls"
            if not text and not delta and not ev.finished:
                return None
        if text:
            delta = {"content": text, **delta}
        c: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if errors:
            c["tool_call_errors"] = errors
        if self.body.logprobs and ev.token_id is not None:
            c["logprobs"] = chat_logprobs(self.backend, ch, start=len(ch.token_ids) - 1)
        return self.base([c])
