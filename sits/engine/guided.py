"""Grammar-constrained decoding: each step, only tokens that keep the output inside a grammar.

Why: a tool call or a structured answer has to parse whatever model produced it, including the
random-weight models the tests use. A grammar makes that a property of decoding instead of luck.
The grammar engine is llguidance (the Rust library behind vLLM's and llama.cpp's guided decoding:
a derivative-based lexer plus an Earley parser); it answers a token mask per step in about 0.1 ms
for an 8k vocabulary, so a guided request costs the step loop almost nothing.

Grammars travel as strings (``SamplingParams.grammar``, made by the ``*_grammar`` functions here)
so they cross process boundaries like any other sampling parameter; each engine turns one into a
``Guide`` per sequence when the sequence is queued.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from sits.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from sits.engine.tokenizer import Tokenizer

# Compact JSON with one space after ':' and ',' (what json.dumps writes): flexible whitespace would
# let a weak model pad its output with newlines until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                "lenient": True}


COMPILED_CACHE = 64              # grammars kept compiled per tokenizer
SAFE_INTEGER = 2**53 - 1      # I-JSON (RFC 7493): the integers every JSON parser reads exactly


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def decoding_schema(schema: Any, *, close: bool = True) -> Any:
    """``schema`` with the defaults a decoder needs: closed objects and bounded integers.

    JSON Schema lets unlisted keys through and integers grow without end; for decoding those
    defaults invite a model to invent keys after the ones asked for, or to write digits until
    max_tokens. Like xgrammar's strict mode (and OpenAI's strict structured outputs), an object is
    closed unless ``additionalProperties`` says otherwise; an integer without bounds gets the range
    every JSON parser reads exactly (|n| < 2**53). Only subschemas are visited (a property named
    ``properties`` is a name, not a keyword), and ``allOf`` parts stay open (closing each part
    would leave their intersection nothing).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: decoding_schema(sub) for name, sub in out[k].items()}
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = decoding_schema(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [decoding_schema(sub) for sub in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [decoding_schema(sub, close=False) for sub in out["allOf"]]
    if (close and "allOf" not in out and "properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out):
        out["additionalProperties"] = False
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A grammar for JSON matching ``schema`` (with ``decoding_schema``'s defaults; keywords
    llguidance cannot enforce, such as ``format``, are ignored and left to validation)."""
    try:
        return LLMatcher.grammar_from_json_schema(decoding_schema(schema) if not isinstance(schema, bool) else {},
                                                  overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"the JSON schema is not usable: {e}", param="response_format",
                                  code="invalid_schema") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(source: str) -> str:
    """A grammar from llguidance's Lark dialect (``%json {...}`` embeds a JSON schema)."""
    return LLMatcher.grammar_from_lark(source)


def embedded_schema(schema: dict[str, Any]) -> str:
    """``schema`` for a ``%json`` block of a Lark grammar, with this module's JSON options."""
    return json.dumps({**decoding_schema(schema), "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema)


class GuidedVocabulary:
    """llguidance's view of one tokenizer: every token's bytes, for computing masks.

    Built once per tokenizer (about a millisecond per thousand tokens) and shared by every guided
    request. ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (padded embeddings); the extra ids are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        eos = list(tokenizer.eos_token_ids) or None
        self.vocab_size = vocab_size
        self.eos_token_ids = eos or []
        self.llm_tokenizer = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        # compiled grammars by source: the same tools or schema on every request of a client compile
        # once (tens of ms for dozens of tools), then each sequence gets a copy of the fresh matcher
        self._compiled: collections.OrderedDict[str, LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _prototype(self, grammar: str) -> LLMatcher:
        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
        m = LLMatcher(self.llm_tokenizer, grammar, log_level=0)
        if not m.is_error():
            with self._lock:
                self._compiled[grammar] = m
                while len(self._compiled) > COMPILED_CACHE:
                    self._compiled.popitem(last=False)
        return m

    def check(self, grammar: str) -> None:
        """Refuse a grammar that cannot be compiled (400 ``invalid_grammar``), before it is queued."""
        if not isinstance(grammar, str) or not grammar:
            raise InvalidRequestError("grammar must be a non-empty string", param="grammar", code="invalid_grammar")
        m = self._prototype(grammar)           # compiled once: the sequences that follow copy it
        if m.is_error():
            first = (m.get_error() or "unknown error").strip().splitlines()[0][:500]
            raise InvalidRequestError(f"the grammar cannot be compiled: {first}", param="grammar",
                                      code="invalid_grammar")

    def guide(self, grammar: str, consumed: list[int] = ()) -> "Guide":
        """A fresh matcher for one sequence; ``consumed`` are tokens it already produced elsewhere
        (a stream resumed on another instance) and are replayed first."""
        proto = self._prototype(grammar)
        with self._lock:                       # the prototype never advances; copies do
            matcher = proto.deep_copy() if not proto.is_error() else proto
        guide = Guide(matcher, self)
        for tok in consumed:
            guide.accept(tok)
        return guide


def vocabulary_for(tokenizer: Tokenizer, vocab_size: int) -> GuidedVocabulary:
    """The tokenizer's GuidedVocabulary, built on first use and kept on the tokenizer."""
    cached = getattr(tokenizer, "_guided_vocabulary", None)
    if cached is None or cached.vocab_size != vocab_size:
        cached = GuidedVocabulary(tokenizer, vocab_size)
        tokenizer._guided_vocabulary = cached
    return cached


class Guide:
    """One sequence's position in its grammar: the mask of allowed next tokens, and advancing it.

    A matcher that fails (it never should: the sampler only picks allowed tokens) or that has no
    allowed token left is treated as finished: only end-of-sequence is allowed, so the sequence ends
    instead of sampling from an empty distribution.
    """

    __slots__ = ("matcher", "vocabulary", "error")

    def __init__(self, matcher: LLMatcher, vocabulary: GuidedVocabulary):
        self.matcher = matcher
        self.vocabulary = vocabulary
        self.error: str | None = matcher.get_error() or None

    def allowed(self) -> np.ndarray:
        """Boolean mask over the model's vocabulary of the tokens the grammar allows next."""
        v = self.vocabulary.vocab_size
        if self.error is None:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8),
                                 bitorder="little")[:v].astype(bool)
            if bits.any():
                return bits
            self.error = self.matcher.get_error() or "the grammar allows no further token"
        only_eos = np.zeros(v, dtype=bool)
        only_eos[[t for t in self.vocabulary.eos_token_ids if t < v] or [0]] = True
        return only_eos

    def accept(self, token_id: int) -> None:
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = self.matcher.get_error() or f"token {token_id} is not allowed here"

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar allows no alternative to (at most ``limit``): jump-forward decoding
        appends them at once, and the model computes them together in the next step, where it would
        otherwise spend one step on each (``<tool_call>\n{"name": "`` is a dozen steps)."""
        if self.error is not None or limit <= 0:
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more: the output is whole and the sequence can end now."""
        return self.error is None and self.matcher.is_stopped()


__all__ = ["GuidedVocabulary", "Guide", "json_schema_grammar", "json_object_grammar", "lark_grammar",
           "embedded_schema", "vocabulary_for"]
