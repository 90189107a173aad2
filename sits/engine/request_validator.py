"""Input checks for one request, made once, in the front end, against the engine's real limits.

Whoever queues to an engine validates and tokenizes there (``LLMEngine.make_request`` in-process,
``sits serve``'s HTTP server, the runtime's gateway), so bad input is refused where the client is,
before anything crosses a process boundary; the engine core then trusts its ``EngineRequest``s.
That is sound because every front end holds the engine's own ``EngineLimits``: read from the
instance's ``Ready``, or planned from the same config with ``plan_limits`` (a gateway, before any
instance runs), and an instance whose ``Ready`` says otherwise is not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sits.engine.errors import ContextLengthExceededError, InvalidRequestError
from sits.engine.guided import vocabulary_for
from sits.engine.messages import EngineLimits
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sits.engine.config import EngineConfig, ModelConfig


def plan_limits(cfg: "EngineConfig", model_config: "ModelConfig") -> EngineLimits:
    """The limits an engine built from ``cfg`` will have (the engine sizes its KV pool with this)."""
    from sits.engine.config import resolve_device, resolve_dtype
    from sits.engine.kv_cache import bytes_per_block

    mpe = model_config.max_position_embeddings
    dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device), model_config.torch_dtype)
    per_block = bytes_per_block(model_config, cfg.block_size, dtype)
    return EngineLimits(vocab_size=model_config.vocab_size, max_model_len=min(cfg.max_model_len or mpe, mpe),
                        block_size=cfg.block_size,
                        num_kv_blocks=cfg.num_kv_blocks or max(1, cfg.kv_cache_memory_mb * 2**20 // per_block))


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits):
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = limits.vocab_size
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size
        self.num_kv_blocks = limits.num_kv_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.limits.kv_capacity_tokens

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams, priority: int = 0, *,
                   add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt``, or the typed error saying what to change. A text prompt gets the
        tokenizer's own special tokens (e.g. Llama's BOS) unless ``add_special_tokens`` is false, as
        Hugging Face and vLLM encode a completion prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt", code="empty_prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, max_tokens=self.max_model_len)
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
