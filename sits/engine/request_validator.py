"""Input checks for one request, shared by the engine and by any front end that queues to it.

A front end in another process (``sits serve``'s HTTP server, the runtime's gateway) tokenizes and
validates with the same rules the engine applies, so bad input is refused where the client is,
before anything crosses a process boundary.
"""

from __future__ import annotations

from sits.engine.errors import ContextLengthExceededError, InvalidRequestError
from sits.engine.guided import vocabulary_for
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int, block_size: int,
                 num_kv_blocks: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_kv_blocks

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> list[int]:
        """Token ids of ``prompt``, or the typed error saying what to change."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
            ids = self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            # type() is int: bools are not token ids; one C-level pass per check (a prompt can be long)
            if set(map(type, ids)) - {int} or (ids and (min(ids) < 0 or max(ids) >= vocab)):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})",
                                          param="prompt", code="invalid_token_id")
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {params.max_tokens}: shorten the prompt or lower max_tokens",
                param="max_tokens" if len(ids) < self.max_model_len else "prompt")
        if -(-total // self.block_size) > self.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens ({total} tokens) exceeds the whole KV pool "
                f"({self.kv_capacity_tokens} tokens)", param="max_tokens", code="kv_capacity_exceeded")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority must be an integer", param="priority", code="invalid_parameter")
        if params.grammar is not None:
            vocabulary_for(self.tokenizer, self.vocab_size).check(params.grammar)
        return ids
