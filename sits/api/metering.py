"""A generation's part in tenancy: admitted (its worst case reserved) before anything is queued,
and settled with what it really used when it ends, however it ends.

The edge puts a ``RequestAccount`` (who is calling, and the server's ``Tenancy``) in a context
variable when the server keeps tenants; without one, nothing here runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field

from sits.api.backend import Backend
from sits.engine.messages import EngineRequest, TokenEvent
from sits.tenancy.cost import kv_block_seconds
from sits.tenancy.principal import Principal, RequestCharges
from sits.tenancy.service import Admission, Tenancy
from sits.tenancy.spec import NO_PRICING
from sits.tenancy.store import UsageRecord


@dataclass
class RequestAccount:
    tenancy: Tenancy
    principal: Principal
    headers: dict[str, str] = field(default_factory=dict)    # x-ratelimit-* for the response
    charges: RequestCharges = field(default_factory=RequestCharges)   # what the runtime adds (cold starts)


current_account: contextvars.ContextVar[RequestAccount | None] = contextvars.ContextVar("sits_account", default=None)


@dataclass(slots=True)
class SequenceUse:
    prompt: int
    cached: int
    completion: int
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class GenerationMeter:
    """Admission and settlement of one ``Generation``'s sequences."""

    def __init__(self, account: RequestAccount, backend: Backend, request_id: str, seqs: list[EngineRequest],
                 num_prompts: int):
        self.account = account
        self.backend = backend
        self.request_id = request_id
        features = backend.features
        self.pricing = features.pricing or NO_PRICING
        self.shape = features.shape
        per_prompt = len(seqs) // num_prompts
        # the worst case: every prompt computed once (choices share it), every choice to max_tokens
        prompt = sum(s.prompt_len for s in seqs[::per_prompt])
        completion = sum(s.params.max_tokens for s in seqs)
        flops = 0 if self.shape is None else sum(
            self.shape.flops(s.prompt_len, 0, s.params.max_tokens) for s in seqs)
        self.tokens = prompt + completion
        self.cost = self.pricing.cost(prompt, 0, completion, flops)
        self.admission: Admission | None = None

    async def admit(self) -> None:
        """Reserve the worst case, or raise the 429 of the limit or budget that refuses it. Done when
        the generation's events are first read, so a refusal is still the response's status."""
        account = self.account
        self.admission = await account.tenancy.admit(account.principal, self.backend.name, self.tokens, self.cost)
        account.headers.update(self.admission.headers)

    def first_token(self) -> None:
        if self.admission is not None:
            self.admission.first_token()

    def usage(self, uses: list[SequenceUse], num_prompts: int) -> dict:
        """Tokens, FLOPs, KV block-seconds and cost so far (the ``usage`` extension ``sits``)."""
        per_prompt = max(len(uses) // max(num_prompts, 1), 1)
        prompt = sum(u.prompt for u in uses[::per_prompt] if u.scheduled_at is not None)
        cached = sum(u.cached for u in uses[::per_prompt] if u.scheduled_at is not None)
        completion = sum(u.completion for u in uses)
        flops = 0
        kv = 0.0
        if self.shape is not None:
            for i, u in enumerate(uses):
                if u.scheduled_at is None:
                    continue
                # choices of one prompt share its prefill: the first pays it, the others start cached
                computed_from = u.cached if i % per_prompt == 0 else u.prompt
                flops += self.shape.flops(u.prompt, computed_from, u.completion)
                kv += kv_block_seconds(u.prompt, u.completion, self.backend.features.kv_block_size, u.scheduled_at,
                                       u.first_token_at, u.finished_at)
        cost = self.pricing.cost(prompt, cached, completion, flops)
        return {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
                "flops": flops, "kv_block_seconds": round(kv, 6), "cost": round(cost, 9)}

    def settle(self, uses: list[SequenceUse], num_prompts: int, outcome: str) -> dict:
        u = self.usage(uses, num_prompts)
        p = self.account.principal
        if self.admission is None:      # refused: nothing reserved, nothing ran
            return u
        self.account.tenancy.settle(self.admission, UsageRecord(
            at=time.time(), request_id=self.request_id, tenant=p.tenant, key_id=p.key_id, unit=self.backend.name,
            outcome=outcome, prompt_tokens=u["prompt_tokens"], cached_tokens=u["cached_tokens"],
            completion_tokens=u["completion_tokens"], flops=float(u["flops"]), kv_block_seconds=u["kv_block_seconds"],
            gb_hours=0.0, cost=u["cost"], cold_starts=self.account.charges.cold_starts))
        self.account.charges.cold_starts = 0        # a later generation of the same request (tool loop) starts at 0
        return u


@contextlib.asynccontextmanager
async def metered_prompts(unit: str, request_id: str, lengths: list[int], pricing=None, shape=None):
    """Admission and settlement of a request that only reads prompts (embeddings): its tokens
    are reserved on a tenant's limits and budgets, and recorded, like a generation's prompt."""
    account = current_account.get()
    if account is None:
        yield
        return
    pricing = pricing or NO_PRICING
    tokens = sum(lengths)
    flops = 0 if shape is None else sum(shape.flops(n, 0, 0, lm_head=False) for n in lengths)
    cost = pricing.cost(tokens, 0, 0, flops)
    admission = await account.tenancy.admit(account.principal, unit, tokens, cost)
    account.headers.update(admission.headers)
    admission.first_token()
    outcome = "failed"
    try:
        yield
        outcome = "finished"
    finally:
        p = account.principal
        account.tenancy.settle(admission, UsageRecord(
            at=time.time(), request_id=request_id, tenant=p.tenant, key_id=p.key_id, unit=unit, outcome=outcome,
            prompt_tokens=tokens if outcome == "finished" else 0, cached_tokens=0, completion_tokens=0,
            flops=float(flops) if outcome == "finished" else 0.0, kv_block_seconds=0.0, gb_hours=0.0,
            cost=cost if outcome == "finished" else 0.0))


def use_of(prompt_len: int, first: TokenEvent | None, last: TokenEvent | None, completion: int) -> SequenceUse:
    if first is None:
        return SequenceUse(prompt_len, 0, 0)
    return SequenceUse(prompt_len, first.num_cached_tokens, completion, first.first_scheduled_time or first.arrival_time,
                       first.first_token_time, last.time if last is not None else None)
