"""One request's generation state inside the engine.

Prefill, chunked prefill, decode and recompute after preemption are one mechanism: a sequence has
``all_token_ids`` and ``num_computed_tokens`` (tokens whose KV is in the cache); each step computes a
slice of the rest, and when nothing is left the last logits are sampled and one token is appended.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sits.engine.block_pool import NO_HASH
from sits.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sits.engine.guided import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens or the context length
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0                 # explicit; higher is served sooner
    interactive: bool = True          # a user is watching the stream (vs a batch job)
    arrival_time: float = field(default_factory=time.monotonic)
    tenant: str | None = None         # fair-share group (sits.engine.fair_share)
    tenant_weight: float = 1.0
    lora: str | None = None           # its LoRA adapter (sits.engine.lora)
    cache_root: int = NO_HASH         # the prefix cache's chain starts here: the base model's, or an adapter's

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0        # prefix-cache hits at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chain hash of each full block, in order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    guide: Guide | None = None        # when params.grammar constrains the output
    num_forced: int = 0               # output tokens appended by jump-forward, not computed yet
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, begin: int, end: int) -> list[int]:
        """``all_token_ids[begin:end]`` without concatenating prompt and output (the step's hot path)."""
        n_prompt = len(self.prompt_token_ids)
        if begin >= n_prompt:
            return self.output_token_ids[begin - n_prompt:end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[begin:end]
        return self.prompt_token_ids[begin:] + self.output_token_ids[:end - n_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Prompt (or recompute) work; a stream with jump-forward tokens to compute is decoding."""
        return (not self.output_token_ids or self.num_computed_tokens < len(self.prompt_token_ids)
                or self.num_remaining > 1 + self.num_forced)

    @property
    def parent_hash(self) -> int:
        return self.block_hashes[-1] if self.block_hashes else self.cache_root

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
