"""A mesh: a unit that serves each request from one of its tiers (other units, local or remote, in
escalation order such as small → medium → large), chosen by the request's SLA and the tiers' live
state, and re-run on the next tier when an escalation rule says the answer will not do.

Routing: the first tier whose SLA breaker admits, whose price for the request stays within the cost
cap, and whose predicted TTFT (its recent p95, its queue, a cold start if it has no instance) fits
the TTFT budget; a request with a positive priority takes the eligible tier with the lowest
predicted TTFT instead. The budget and the cap come from the request (``X-SITS-TTFT-Budget-Ms``,
``X-SITS-Cost-Cap``) or the mesh's spec. Escalation (to the next eligible tier): no first token
within what is left of the budget, a server-side error or rate limit, a malformed tool call or JSON
answer, or a local tier's answer whose mean token logprob is below the threshold; the output checks
hold a tier's answer back until it is complete. The last tier's answer, or the best one held when no
later tier can take the request, is what the client gets. Every decision is a gateway event, a
``mesh.attempt`` span and attributes on the request's span.

A mesh's prompt crosses as messages (``message_prompts``), because which tokenizer and template it
needs is known only once a tier is chosen: a local tier's is applied here.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import jsonschema

from sits.engine.errors import InvalidRequestError, RequestAbortedError, SitsError
from sits.engine.messages import EngineRequest, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.engine.tool_format import parse_tool_calls
from sits.observe import tracing
from sits.runtime.hints import RequestHints
from sits.runtime.message_unit import EstimatedRequest, MessagePrompt, MessageUnit, estimate_tokens
from sits.runtime.sla import NOT_OUTCOMES
from sits.runtime.unit_spec import UnitSpec

if TYPE_CHECKING:
    from sits.runtime.gateway import UnitHost

DEFAULT_CONTEXT = 32768       # a mesh's context while none of its tiers is deployed


class MeshUnavailableError(SitsError):
    code = "mesh_no_tier"
    http_status = 503
    retry_after_s = 1


@dataclass(frozen=True, slots=True)
class MeshRequest(EstimatedRequest):
    """A request held by a mesh until a tier is chosen: the prompt as messages or text."""

    prompt: MessagePrompt | str = ""


@dataclass(slots=True)
class _Attempt:
    """One tier's try at a request: what it produced, and why it was given up (None: kept)."""

    tier: str
    events: list[TokenEvent] = field(default_factory=list)
    reason: str | None = None


class _Escalate(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class MeshUnit(MessageUnit):
    kind = "mesh"

    def __init__(self, spec: UnitSpec, host: "UnitHost"):
        if spec.mesh is None:
            raise ValueError(f"unit {spec.name} is not a mesh")
        super().__init__(spec, host, "mesh:" + ",".join(spec.mesh.tiers))
        self.sampling_defaults = {"max_tokens": spec.mesh.max_tokens} | self.sampling_defaults
        self.served_by: collections.Counter = collections.Counter()
        self.escalations: collections.Counter = collections.Counter()     # by reason
        self.skips: collections.Counter = collections.Counter()           # (tier, reason)
        self._current: dict[str, tuple[object, str]] = {}   # request id -> (tier, the tier's request id)

    # -- the tiers ------------------------------------------------------------------------------------
    def tiers(self) -> list:
        """The deployed tiers, in escalation order."""
        return [u for n in self.spec.mesh.tiers if (u := self.host.unit(n)) is not None]

    @property
    def max_model_len(self) -> int:
        """The shortest context among the tiers: a request that fits it fits every tier."""
        return min((t.max_model_len for t in self.tiers()), default=DEFAULT_CONTEXT)

    @property
    def kv_capacity_tokens(self) -> int:
        return min((t.kv_capacity_tokens for t in self.tiers()), default=DEFAULT_CONTEXT)

    # -- the Backend API ------------------------------------------------------------------------------
    def prepare(self, prompt: MessagePrompt | str | list[int], params: SamplingParams, *, request_id: str,
                priority: int = 0, interactive: bool = True, add_special_tokens: bool = True,
                lora: str | None = None) -> MeshRequest:
        self.check_prompt(prompt, params, request_id, lora, self._current)
        estimate = len(prompt) if isinstance(prompt, MessagePrompt) else estimate_tokens(prompt)
        return MeshRequest(request_id, [], params, priority, interactive, prompt=prompt,
                           estimated_prompt_tokens=estimate)

    def stream(self, seq: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        if not isinstance(seq, MeshRequest):
            raise TypeError("a mesh streams requests it prepared")
        hints = hints or RequestHints()
        budget_ms = _header_number(hints.ttft_budget_ms, "X-SITS-TTFT-Budget-Ms") or self.spec.mesh.ttft_budget_ms
        cap = _header_number(hints.cost_cap, "X-SITS-Cost-Cap") or self.spec.mesh.cost_cap
        return self.guarded(seq, hints, self._route(seq, hints, budget_ms, cap))

    def plan(self, seq: MeshRequest, budget_ms: float, cap: float | None) -> tuple[list, list[tuple[str, str]]]:
        """The tiers to try in order, and the ones left out or put last with why: those predicted to
        miss the budget come after the ones that fit (the fastest first), as fallbacks for errors."""
        eligible, skipped = [], []
        for name in self.spec.mesh.tiers:
            tier = self.host.unit(name)
            if tier is None:
                skipped.append((name, "not_deployed"))
            elif not tier.breaker.admits():
                skipped.append((name, "breaker_open"))
            elif cap is not None and self._cost(tier, seq) > cap:
                skipped.append((name, "over_cost_cap"))
            else:
                eligible.append(tier)
        fits = [t for t in eligible if t.predicted_ttft_ms() <= budget_ms]
        late = sorted((t for t in eligible if t not in fits), key=lambda t: t.predicted_ttft_ms())
        skipped += [(t.name, "predicted_ttft_over_budget") for t in late]
        if seq.priority > 0 and len(fits) > 1:     # urgent: the fastest first, the others after it
            fastest = min(fits, key=lambda t: t.predicted_ttft_ms())
            fits = [fastest] + [t for t in fits if t is not fastest]
        return fits + late, skipped

    @staticmethod
    def _cost(tier, seq: MeshRequest) -> float:
        pricing = tier.features.pricing
        if pricing is None:
            return 0.0
        shape = tier.features.shape
        flops = shape.flops(seq.prompt_len, 0, seq.params.max_tokens) if shape is not None else 0.0
        return pricing.cost(seq.prompt_len, 0, seq.params.max_tokens, flops)

    async def _route(self, seq: MeshRequest, hints: RequestHints, budget_ms: float,
                     cap: float | None) -> AsyncIterator[TokenEvent]:
        try:
            async for ev in self._attempts(seq, hints, budget_ms, cap):
                yield ev
        finally:
            self._current.pop(seq.request_id, None)

    async def _attempts(self, seq: MeshRequest, hints: RequestHints, budget_ms: float,
                        cap: float | None) -> AsyncIterator[TokenEvent]:
        order, skipped = self.plan(seq, budget_ms, cap)
        for name, why in skipped:
            self.skips[(name, why)] += 1
        if not order:
            raise MeshUnavailableError(f"mesh {self.name}: no tier can take the request ("
                                       + ", ".join(f"{n}: {w}" for n, w in skipped) + ")", param="model")
        self.host.record(self.name, "mesh_route", {"request": seq.request_id, "order": [t.name for t in order],
                                                   "skipped": dict(skipped), "ttft_budget_ms": budget_ms})
        deadline = seq.arrival_time + budget_ms / 1e3
        in_budget = {t.name for t in order} - {n for n, _ in skipped}
        esc = self.spec.mesh.escalate
        held: _Attempt | None = None       # the last whole answer given up on: served if no later tier answers
        path: list[str] = []
        for i, tier in enumerate(order):
            last = i == len(order) - 1
            # a tier predicted to fit gets the budget's rest as its deadline; the others (fallbacks, or
            # the last tier) run to their end
            timed = esc.deadline and not last and tier.name in in_budget
            if timed and time.monotonic() >= deadline:
                self.skips[(tier.name, "no_time_left")] += 1
                continue
            attempt = _Attempt(tier.name)
            path.append(tier.name)
            t0 = time.monotonic()
            checks = self._checks(tier, seq) if not last else []
            delivered = False
            try:
                req = self._tier_request(tier, seq, want_logprobs="logprob" in checks)
                events = tier.stream(req, hints)
                self._current[seq.request_id] = (tier, req.request_id)
                try:
                    async for ev in self._watched(events, deadline if timed else None):
                        ev = _as_mesh_event(ev, seq)
                        if checks:
                            attempt.events.append(ev)
                            continue
                        delivered = delivered or bool(ev.text)     # what the client has seen
                        yield ev
                finally:
                    await events.aclose()
                if checks:
                    reason = _check(attempt.events, checks, seq.prompt, esc.min_mean_logprob)
                    if reason is not None:
                        raise _Escalate(reason)
                    for ev in attempt.events:
                        yield ev
                self._decided(seq, tier, t0, "served", None, path)
                return
            except _Escalate as e:
                attempt.reason = e.reason
                if e.reason != "deadline":      # a whole answer that failed a check: better than none
                    held = attempt
            except SitsError as e:
                retryable = (esc.errors and (e.http_status >= 500 or e.http_status == 429)
                             and e.code not in NOT_OUTCOMES) or e.code == "context_length_exceeded"
                if delivered or ((not retryable or last) and held is None):
                    self._decided(seq, tier, t0, "failed", e.code, path)
                    raise
                if not retryable or last:      # no later tier for it: the answer held last is served
                    attempt.reason = f"error:{e.code}"
                    self.escalations["error"] += 1
                    self._decided(seq, tier, t0, "escalated", attempt.reason, path)
                    break
                attempt.reason = f"error:{e.code}"
            self.escalations[attempt.reason.split(":")[0]] += 1
            self._decided(seq, tier, t0, "escalated", attempt.reason, path)
        if held is not None:         # every later tier failed: the answer held last
            for ev in held.events:
                yield ev
            self._decided(seq, self.host.unit(held.tier), time.monotonic(), "served_held", held.reason, path)
            return
        raise MeshUnavailableError(f"mesh {self.name}: every tier failed or ran out of time "
                                   f"({' -> '.join(path) or 'none tried'})", param="model")

    def _checks(self, tier, seq: MeshRequest) -> list[str]:
        """The output checks this tier's answer must pass before it reaches the client."""
        esc = self.spec.mesh.escalate
        out = []
        p = seq.prompt
        if esc.invalid_output and isinstance(p, MessagePrompt):
            if p.tools and p.tool_choice != "none":
                out.append("tool_calls")
            elif p.response_format is not None and p.response_format.get("type") in ("json_object", "json_schema"):
                out.append("json")
        if esc.min_mean_logprob is not None and not tier.features.message_prompts:
            out.append("logprob")
        return out

    def _tier_request(self, tier, seq: MeshRequest, *, want_logprobs: bool) -> EngineRequest:
        """``seq`` as ``tier`` takes it: messages for an endpoint or mesh, its own template and
        tokenizer for a local unit."""
        head, _, tail = seq.request_id.rpartition("-")
        rid = f"{head}.{tier.name}-{tail}"
        params = replace(seq.params, logprobs=0) if want_logprobs else seq.params
        prompt = seq.prompt
        if isinstance(prompt, MessagePrompt) and not tier.features.message_prompts:
            prompt = tier.tokenizer.encode_chat(prompt.messages, tools=prompt.tools, max_tokens=tier.max_model_len)
        req = tier.prepare(prompt, params, request_id=rid, priority=seq.priority, interactive=seq.interactive)
        return replace(req, tenant=seq.tenant, tenant_weight=seq.tenant_weight)

    @staticmethod
    async def _watched(events: AsyncIterator[TokenEvent], deadline: float | None) -> AsyncIterator[TokenEvent]:
        """``events``, or ``_Escalate("deadline")`` when no first token has come by ``deadline``."""
        it = events.__aiter__()
        if deadline is not None:
            try:
                async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - time.monotonic())):
                    first = await it.__anext__()
            except TimeoutError:
                raise _Escalate("deadline") from None
            except StopAsyncIteration:
                return
            yield first
        async for ev in it:
            yield ev

    def _decided(self, seq: MeshRequest, tier, t0: float, outcome: str, reason: str | None, path: list[str]) -> None:
        name = tier.name if tier is not None else "?"
        if outcome.startswith("served"):
            self.served_by[name] += 1
        self.host.record(self.name, "mesh_" + outcome, {"request": seq.request_id, "tier": name, "reason": reason})
        tracing.stage("mesh.attempt", t0, time.monotonic(), level="L2",
                      error=reason if outcome == "failed" else None,
                      attributes={"sits.mesh.tier": name, "sits.mesh.outcome": outcome, "sits.mesh.reason": reason})
        if outcome != "escalated":
            tracing.annotate({"sits.mesh": self.name, "sits.mesh.tier": name, "sits.mesh.path": " -> ".join(path),
                              "sits.mesh.escalations": len(path) - 1})

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        cur = self._current.get(request_id)
        if cur is not None:
            tier, tier_rid = cur
            tier.abort(tier_rid, error or RequestAbortedError(f"request {request_id} was aborted"))

    def predicted_ttft_ms(self) -> float:
        return min((t.predicted_ttft_ms() for t in self.tiers()), default=0.0)

    # -- the gateway's side ---------------------------------------------------------------------------
    async def close(self, error: SitsError | None = None) -> None:
        for rid in list(self._current):
            self.abort(rid, error)

    def view(self) -> dict:
        tiers = []
        for name in self.spec.mesh.tiers:
            t = self.host.unit(name)
            tiers.append({"unit": name, "deployed": t is not None,
                          "breaker": t.breaker.state.value if t is not None else None,
                          "predicted_ttft_ms": round(t.predicted_ttft_ms(), 1) if t is not None else None,
                          "served": self.served_by.get(name, 0)})
        return super().view() | {"tiers": tiers, "escalations": dict(self.escalations),
                                 "skipped": {f"{n}:{w}": c for (n, w), c in self.skips.items()}}


def _header_number(raw: str | None, header: str) -> float | None:
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0 or v == float("inf"):
        raise InvalidRequestError(f"{header} must be a positive number; got {raw[:40]!r}", param=header,
                                  code="invalid_header")
    return v


def _as_mesh_event(ev: TokenEvent, seq: MeshRequest) -> TokenEvent:
    """A tier's event under the mesh's request id."""
    return replace(ev, request_id=seq.request_id)


def _check(events: list[TokenEvent], checks: list[str], prompt, min_mean_logprob: float | None) -> str | None:
    """Why a held answer will not do (an escalation reason), or None."""
    text = "".join(e.text for e in events)
    if "tool_calls" in checks:
        parsed = parse_tool_calls(text, prompt.tools)
        if parsed.errors:
            return "invalid_tool_call"
    if "json" in checks:
        try:
            value = json.loads(text)
        except ValueError:
            return "invalid_json"
        fmt = prompt.response_format
        schema = (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else None
        if schema is not None and not jsonschema.Draft202012Validator(schema).is_valid(value):
            return "schema_mismatch"
    if "logprob" in checks:
        lps = [e.logprob for e in events if e.token_id is not None and e.logprob is not None]
        if lps and sum(lps) / len(lps) < min_mean_logprob:
            return "low_confidence"
    return None
