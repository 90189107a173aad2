"""One client request run as one or more engine sequences (n choices x prompts), merged.

Both dialects go through here: every job is validated and tokenized before anything is queued (so
bad input is a 4xx, never a half-started stream), the merged stream feeds the metrics, and every
live sequence is registered in ``InflightRegistry`` so a graceful shutdown can tell it why it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from sits.api.backend import Backend
from sits.api.metering import GenerationMeter, SequenceUse, current_account, use_of
from sits.api.metrics import ServerMetrics
from sits.engine.errors import SitsError
from sits.engine.messages import EngineRequest, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.observe import genai
from sits.observe import tracing
from sits.runtime.hints import current_hints


@dataclass(slots=True)
class ChoiceResult:
    """What one choice produced, accumulated from its events."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    last: TokenEvent | None = None
    first: TokenEvent | None = None

    def add(self, ev: TokenEvent) -> None:
        if self.first is None:
            self.first = ev
        self.last = ev
        self.text.append(ev.text)
        if ev.token_id is not None:
            self.token_ids.append(ev.token_id)
            self.logprobs.append(ev.logprob)
            self.top_logprobs.append(ev.top_logprobs)
        if ev.finished:
            self.finish_reason = ev.finish_reason

    def prompt_tokens(self, seq: EngineRequest) -> int:
        """The count the finished event reports (a remote endpoint's own), else the request's."""
        last = self.last
        return last.num_prompt_tokens if last is not None and last.finished and last.num_prompt_tokens \
            else seq.prompt_len

    @property
    def completion_tokens(self) -> int:
        """Tokens produced: the finished event's count (a remote endpoint may send several in one
        event), else the token events so far."""
        last = self.last
        return last.num_output_tokens if last is not None and last.finished and last.num_output_tokens \
            else len(self.token_ids)


class InflightRegistry:
    """Engine requests currently streaming, by id, so shutdown can abort them with a reason."""

    def __init__(self) -> None:
        self._live: dict[str, Backend] = {}

    def add(self, request_id: str, backend: Backend) -> None:
        self._live[request_id] = backend

    def discard(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def abort_all(self, error: SitsError) -> int:
        live = list(self._live.items())
        for rid, backend in live:
            backend.abort(rid, error)
        return len(live)


def seed_for_choice(seed: int | None, i: int) -> int | None:
    """Choice i of n gets seed + i, so n > 1 with a seed is reproducible and not n copies."""
    if seed is None or i == 0:
        return seed
    return (seed + i) % 2**64


class Generation:
    """The engine sequences of one HTTP request and their merged events ``(choice index, event)``."""

    def __init__(self, backend: Backend, metrics: ServerMetrics, inflight: InflightRegistry,
                 request_id: str, jobs: list[tuple[str | list[int], SamplingParams]], *,
                 n: int = 1, priority: int = 0, interactive: bool = True, accepted_at: float | None = None,
                 add_special_tokens: bool = True):
        self.backend = backend
        self.metrics = metrics
        self.inflight = inflight
        self.request_id = request_id
        self.accepted_at = accepted_at if accepted_at is not None else time.monotonic()
        self.seqs: list[EngineRequest] = []
        self.choices: list[ChoiceResult] = []
        for p_idx, (prompt, params) in enumerate(jobs):
            for c in range(n):
                idx = p_idx * n + c
                sp = params if c == 0 else _with_seed(params, seed_for_choice(params.seed, c))
                self.seqs.append(backend.prepare(prompt, sp, request_id=f"{request_id}-{idx}", priority=priority,
                                                 interactive=interactive, add_special_tokens=add_special_tokens))
                self.choices.append(ChoiceResult(idx, p_idx))
        self.prepared_at = time.monotonic()
        scope = tracing.current_scope.get()
        if scope is not None:      # from the end of the body read (gateway.accept) to the queue
            tracing.stage("validate", scope.marks.get("accepted", self.accepted_at), self.prepared_at, level="L1",
                          attributes={"sits.sequences": len(self.seqs)})
        self.ttft_slo_ms: float | None = backend.features.ttft_slo_ms
        self.hints = current_hints.get()        # set by the edge for this HTTP request; handed to the backend
        self.num_prompts = len(jobs)
        account = current_account.get()        # a server with tenants: reserve the worst case, or a 429
        if account is not None and account.principal.tenant is not None:    # the scheduler's fair share
            tenant = account.principal.tenant
            weight = account.tenancy.weight(tenant)
            self.seqs = [replace(s, tenant=tenant, tenant_weight=weight) for s in self.seqs]
        self.meter = GenerationMeter(account, backend, request_id, self.seqs, self.num_prompts) \
            if account is not None else None
        self.metered: dict | None = None        # what the meter settled (the usage extension ``sits``)
        self._started = False
        self._closed = False

    # -- accounting -----------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        n = len(self.seqs) // self.num_prompts
        return sum(c.prompt_tokens(s) for s, c in zip(self.seqs[::n], self.choices[::n]))

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        n = len(self.seqs) // self.num_prompts
        return sum(c.last.num_cached_tokens for c in self.choices[::n] if c.last is not None)

    def usage(self) -> dict:
        p, c = self.prompt_tokens, self.completion_tokens
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.meter is not None:
            metered = self.metered or self.meter.usage(self._uses(), self.num_prompts)
            out["sits"] = {k: metered[k] for k in ("flops", "kv_block_seconds", "cost")}
        return out

    def _uses(self) -> list[SequenceUse]:
        return [use_of(c.prompt_tokens(s), c.first, c.last, c.completion_tokens) for s, c in zip(self.seqs, self.choices)]

    def _settle(self) -> None:
        if self.meter is not None and self.metered is None:
            outcome = "finished" if all(c.finish_reason is not None for c in self.choices) else "aborted"
            self.metered = self.meter.settle(self._uses(), self.num_prompts, outcome)

    def timings_ms(self) -> dict[str, float | None]:
        """validate (accept -> queued), queue, prefill, decode, total: for server-timing and views."""
        first = min((c.first for c in self.choices if c.first is not None), key=lambda e: e.time, default=None)
        last = max((c.last for c in self.choices if c.last is not None), key=lambda e: e.time, default=None)

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1e3, 3)

        out = {"validate": ms(self.accepted_at, self.prepared_at), "queue": None, "prefill": None,
               "decode": None, "total": None}
        if first is not None:
            out["queue"] = ms(first.arrival_time, first.first_scheduled_time)
            out["prefill"] = ms(first.first_scheduled_time, first.first_token_time)
        if last is not None and last.finished and first is not None:
            out["decode"] = ms(first.first_token_time, last.time)
            out["total"] = ms(self.accepted_at, last.time)
        return out

    # -- the stream -----------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Merged events of every choice; closing this generator aborts whatever still runs."""
        if self._started:
            raise RuntimeError("Generation.events() can be consumed once")
        self._started = True
        if self.meter is not None:
            await self.meter.admit()        # a 429 here: nothing reserved, nothing to settle
        try:
            if len(self.seqs) == 1:
                async for item in self._one(0):
                    yield item
                return
            queue: asyncio.Queue = asyncio.Queue()
            done = object()

            async def pump(i: int) -> None:
                try:
                    async for item in self._one(i):
                        queue.put_nowait(item)
                except BaseException as e:  # handed to the consumer, which re-raises it
                    queue.put_nowait(e)
                    return
                queue.put_nowait(done)

            tasks = [asyncio.create_task(pump(i)) for i in range(len(self.seqs))]
            remaining = len(tasks)
            try:
                while remaining:
                    item = await queue.get()
                    if item is done:
                        remaining -= 1
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._settle()

    async def _one(self, i: int) -> AsyncIterator[tuple[int, TokenEvent]]:
        seq = self.seqs[i]
        choice = self.choices[i]
        model = self.backend.name
        self.inflight.add(seq.request_id, self.backend)
        prev: float | None = None
        unobserved: tuple[TokenEvent, float | None] | None = None
        try:
            async for ev in self.backend.stream(seq, self.hints):
                if unobserved is not None:
                    self.metrics.observe_token(model, *unobserved)
                unobserved = (ev, prev)     # observed once the consumer has sent this event on
                if ev.token_id is not None:
                    if prev is None and self.meter is not None:
                        self.meter.first_token()
                    if prev is None and self.ttft_slo_ms is not None and \
                            (time.monotonic() - self.accepted_at) * 1e3 > self.ttft_slo_ms:
                        tracing.annotate({genai.SLO_VIOLATED: True, "sits.ttft_slo_ms": self.ttft_slo_ms})
                    prev = ev.time
                choice.add(ev)
                yield i, ev
        finally:
            if unobserved is not None:
                self.metrics.observe_token(model, *unobserved)
            self.inflight.discard(seq.request_id)
            if choice.finish_reason is None:
                self.metrics.observe_abort(model)
            self._trace_engine(i, choice)

    def _trace_engine(self, i: int, choice: ChoiceResult) -> None:
        """The engine's stages of one choice, from its own timestamps: queue, prefill, decode."""
        first, last = choice.first, choice.last
        scope = tracing.current_scope.get()
        if first is None or scope is None:
            return
        sched = first.first_scheduled_time or first.arrival_time
        ftt = first.first_token_time or first.time
        attrs = {"sits.choice": i}
        queued = min(max(first.arrival_time, scope.marks.get("routed", first.arrival_time)), sched)
        tracing.stage("engine.queue", queued, sched, level="L1", attributes=attrs)
        tracing.stage("engine.prefill", sched, ftt, level="L1",
                      attributes={**attrs, genai.USAGE_INPUT: first.num_prompt_tokens,
                                  "sits.cached_tokens": first.num_cached_tokens})
        if last is not None:
            tracing.stage("engine.decode", ftt, last.time, level="L2",
                          attributes={**attrs, genai.USAGE_OUTPUT: len(choice.token_ids),
                                      "sits.finish_reason": choice.finish_reason or "abort"})

    async def run(self) -> None:
        """Consume to the end (non-streaming responses)."""
        async for _ in self.events():
            pass


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(params, seed=seed)
