"""Incremental detokenization: turn a token stream into valid text deltas, cutting at stop strings.

Decoding token by token is wrong in two ways: a multi-byte character can span tokens (each piece
alone decodes to U+FFFD), and tokenizers that strip a leading space (SentencePiece) drop it when a
token is decoded on its own. The vLLM/TGI technique fixes both at bounded cost: keep a small window
of ids, decode it with and without the newest tokens, and emit the difference once it no longer
ends in an incomplete character. Earlier text provides the context, so the window never has to
reach back further than the previous emission.
"""

from __future__ import annotations

from collections.abc import Sequence

from sits.engine.tokenizer import Tokenizer

# Prompt ids kept as decoding context for the first output tokens (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request streaming decoder.

    ``step`` returns the new text for one token; the concatenation of every ``step`` result and
    ``finish()`` is ``tokenizer.decode(output_ids)`` (with ``prompt_ids`` the output is decoded in
    the prompt's context, so e.g. a SentencePiece leading space is kept), unless a stop string
    matched. Then ``stopped`` is set, ``stop_reason`` is the matched string, and the output ends
    right before it; later calls return ``""``.

    With several stop strings the one whose match *ends* first wins (ties: the longer one), which
    is where a reader scanning the text would stop, independent of how the text was tokenized.
    Text that might be the start of a stop string is held back until the next tokens rule that
    out (or ``finish()`` releases it), so a stop string never leaks into a stream.

    ``text`` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        # The decoding window: ids[:read] is context (the tokens of the last emission, or the
        # prompt's tail); ids[read:] is not emitted yet (an incomplete character, or empty text).
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read_offset = len(self._ids)
        self._held = ""       # decoded text not yet released: it may be the start of a stop string
        self._finished = False
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    def step(self, token_id: int) -> str:
        """Feed one generated token; return the text that became certain (possibly ``""``)."""
        if self.stopped or self._finished:
            return ""
        self._ids.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """End of generation: flush an incomplete trailing character and the held-back text."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        """Text added by ``ids[read:]``, or ``""`` while it ends in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[:self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids, skip_special_tokens=skip)
        # An empty delta (e.g. a skipped special token) keeps the window: dropping the context
        # would let a SentencePiece decoder strip the next token's leading space.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        # The tokens just emitted become the next context; older ids are dropped, so the window
        # (and the cost of each step) stays bounded however long the generation gets.
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _release(self, delta: str, final: bool) -> str:
        """Add ``delta`` to the held text, cut at a stop string, and return what is now certain."""
        held = self._held + delta
        if self._stop:
            match = self._first_stop(held)
            if match is not None:
                start, stop = match
                self.stopped, self.stop_reason = True, stop
                self._held = ""
                self.text += held[:start]
                return held[:start]
            keep = 0 if final else self._partial_stop_len(held)
        else:
            keep = 0
        out = held[:len(held) - keep]
        self._held = held[len(held) - keep:]
        self.text += out
        return out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest-ending stop string occurrence in ``text`` as (start, stop string)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key < best:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
