"""One tenant's or key's running state: rate buckets, requests in flight, budget spend.

Admission asks every account of a request (its key's and its tenant's) whether the worst case fits
(``refusal``) and only then takes it from all of them (``reserve``); both run without an ``await``
in between, so on the gateway's event loop no other request can interleave and a budget can never be
overspent. ``settle`` turns a reservation into what was really used.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass, field

from sits.engine.errors import SitsError
from sits.tenancy.spec import BudgetSpec, LimitsSpec


class RateLimitedError(SitsError):
    """A per-minute limit, a concurrency or a queue limit is reached (OpenAI: 429 rate_limit_exceeded)."""

    code = "rate_limit_exceeded"
    http_status = 429
    headers: dict[str, str] | None = None


class BudgetExceededError(RateLimitedError):
    """The budget of the period cannot cover this request's worst case; nothing was run."""

    code = "budget_exceeded"


def period_start(period: str, now: float) -> float:
    """The UTC start of the budget period holding ``now`` (0 for ``total``)."""
    if period == "total":
        return 0.0
    t = time.gmtime(now)
    if period == "day":
        return float(calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)))
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


def period_end(period: str, now: float) -> float | None:
    if period == "total":
        return None
    t = time.gmtime(now)
    if period == "day":
        return period_start("day", now) + 86400.0
    y, m = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((y, m, 1, 0, 0, 0)))


class Bucket:
    """A token bucket refilled continuously at ``per_min`` / 60 per second, holding at most ``per_min``."""

    def __init__(self, per_min: int, now: float):
        self.capacity = float(per_min)
        self.rate = per_min / 60.0
        self.level = self.capacity
        self.t = now

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
            self.t = now

    def wait_s(self, n: float, now: float) -> float | None:
        """Seconds until ``n`` fit (0: now); None: never (more than the bucket holds)."""
        if n > self.capacity:
            return None
        self._refill(now)
        return 0.0 if self.level >= n else (n - self.level) / self.rate

    def take(self, n: float) -> None:
        self.level -= n

    def give(self, n: float) -> None:
        self.level = min(self.capacity, self.level + n)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(int(self.level), 0)

    def reset_s(self, now: float) -> float:
        self._refill(now)
        return (self.capacity - self.level) / self.rate


@dataclass
class BudgetState:
    spec: BudgetSpec
    start: float                    # the period's start
    settled_tokens: int = 0
    settled_cost: float = 0.0
    reserved_tokens: int = 0
    reserved_cost: float = 0.0

    def fits(self, tokens: int, cost: float) -> bool:
        s = self.spec
        return ((s.tokens is None or self.settled_tokens + self.reserved_tokens + tokens <= s.tokens)
                and (s.cost is None or self.settled_cost + self.reserved_cost + cost <= s.cost + 1e-12))

    def view(self) -> dict:
        s = self.spec
        out: dict = {"period": s.period, "period_start": self.start, "period_end": period_end(s.period, self.start)}
        if s.tokens is not None:
            out |= {"tokens": s.tokens, "tokens_spent": self.settled_tokens, "tokens_reserved": self.reserved_tokens,
                    "tokens_remaining": max(s.tokens - self.settled_tokens - self.reserved_tokens, 0)}
        if s.cost is not None:
            out |= {"cost": s.cost, "cost_spent": round(self.settled_cost, 9),
                    "cost_reserved": round(self.reserved_cost, 9),
                    "cost_remaining": round(max(s.cost - self.settled_cost - self.reserved_cost, 0.0), 9)}
        return out


@dataclass
class Account:
    kind: str                       # tenant | key
    id: str
    limits: LimitsSpec
    budgets: list[BudgetState] = field(default_factory=list)
    rpm: Bucket | None = None
    tpm: Bucket | None = None
    active: int = 0                 # admitted, not finished
    queued: int = 0                 # admitted, no first token yet

    @classmethod
    def new(cls, kind: str, ident: str, limits: LimitsSpec, budgets: list[BudgetSpec], now: float,
            spent=lambda budget, since: (0, 0.0)) -> "Account":
        acct = cls(kind, ident, limits)
        acct.configure(limits, budgets, now, spent)
        return acct

    def configure(self, limits: LimitsSpec, budgets: list[BudgetSpec], now: float, spent) -> None:
        """New limits and budgets (an update keeps what is in flight and what was spent)."""
        old: dict[str, list[BudgetState]] = {}      # per period, in order: two budgets may share one
        for b in self.budgets:
            old.setdefault(b.spec.period, []).append(b)
        self.limits = limits
        self.rpm = _bucket(limits.requests_per_min, self.rpm, now)
        self.tpm = _bucket(limits.tokens_per_min, self.tpm, now)
        self.budgets = []
        for spec in budgets:
            start = period_start(spec.period, now)
            same = old.get(spec.period)
            prev = same.pop(0) if same else None
            if prev is not None and prev.start == start:
                state = BudgetState(spec, start, prev.settled_tokens, prev.settled_cost, prev.reserved_tokens,
                                    prev.reserved_cost)
            else:
                tokens, cost = spent(spec, start)
                state = BudgetState(spec, start, tokens, cost)
            self.budgets.append(state)

    def roll(self, now: float, spent) -> None:
        """A budget whose period has ended starts the next one at what it settled since (reservations carry over)."""
        for b in self.budgets:
            start = period_start(b.spec.period, now)
            if start != b.start:
                b.start = start
                b.settled_tokens, b.settled_cost = spent(b.spec, start)

    def refusal(self, tokens: int, cost: float, now: float) -> SitsError | None:
        """Why this account cannot admit a request whose worst case is ``tokens`` / ``cost`` (None: it can)."""
        who = f"{self.kind} {self.id!r}"
        lim = self.limits
        if lim.max_concurrent is not None and self.active >= lim.max_concurrent:
            return concurrency_refusal(who, self.active, lim.max_concurrent)
        if lim.max_queued is not None and self.queued >= lim.max_queued:
            return queue_refusal(who, self.queued, lim.max_queued)
        if self.rpm is not None:
            wait = self.rpm.wait_s(1, now)
            if wait:
                return rpm_refusal(who, lim.requests_per_min, wait)
        if self.tpm is not None:
            wait = self.tpm.wait_s(tokens, now)
            if wait is None or wait:
                return tpm_refusal(who, lim.tokens_per_min, tokens, wait)
        for b in self.budgets:
            if not b.fits(tokens, cost):
                return budget_refusal(who, b.view(), tokens, cost, now)
        return None

    def reserve(self, tokens: int, cost: float) -> None:
        self.active += 1
        self.queued += 1
        if self.rpm is not None:
            self.rpm.take(1)
        if self.tpm is not None:
            self.tpm.take(tokens)
        for b in self.budgets:
            b.reserved_tokens += tokens
            b.reserved_cost += cost

    def started(self) -> None:
        self.queued -= 1

    def settle(self, reserved_tokens: int, reserved_cost: float, tokens: int, cost: float, started: bool) -> None:
        self.active -= 1
        if not started:
            self.queued -= 1
        if self.tpm is not None:
            self.tpm.give(max(reserved_tokens - tokens, 0))
        for b in self.budgets:
            b.reserved_tokens -= reserved_tokens
            b.reserved_cost -= reserved_cost
            b.settled_tokens += tokens
            b.settled_cost += cost
            if abs(b.reserved_cost) < 1e-9:
                b.reserved_cost = 0.0

    def rate_headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits this account has."""
        return rate_headers(*((b.capacity, b.remaining(now), b.reset_s(now)) if b is not None else None
                              for b in (self.rpm, self.tpm)))

    def view(self, now: float) -> dict:
        return {"limits": self.limits.model_dump(exclude_none=True), "active": self.active, "queued": self.queued,
                "budgets": [b.view() for b in self.budgets], **({"rate": self.rate_headers(now)} if self.rpm or self.tpm else {})}


def _bucket(per_min: int | None, old: Bucket | None, now: float) -> Bucket | None:
    if per_min is None:
        return None
    if old is not None and old.capacity == per_min:
        return old
    return Bucket(per_min, now)


def _limited(message: str, code: str, retry_s: float | None) -> RateLimitedError:
    err = RateLimitedError(message, code=code)
    if retry_s is not None:
        err.retry_after_s = max(1, math.ceil(retry_s))
    return err


# The refusals, one wording whichever ledger (in-process or Redis) found them.
def concurrency_refusal(who: str, active: int, limit: int) -> RateLimitedError:
    return _limited(f"{who} has {active} requests in flight (max_concurrent {limit})", "concurrency_limit_exceeded", 1)


def queue_refusal(who: str, queued: int, limit: int) -> RateLimitedError:
    return _limited(f"{who} has {queued} requests waiting for their first token (max_queued {limit})",
                    "queue_limit_exceeded", 1)


def rpm_refusal(who: str, limit: int | None, wait_s: float) -> RateLimitedError:
    return _limited(f"{who}: requests per minute limit {limit} reached", "rate_limit_exceeded", wait_s)


def tpm_refusal(who: str, limit: int | None, tokens: int, wait_s: float | None) -> RateLimitedError:
    """``wait_s`` None: the request is larger than the bucket itself and will never fit."""
    if wait_s is None:
        return _limited(f"request too large for {who}: it may use {tokens} tokens (prompt + max_tokens) and the "
                        f"limit is {limit} tokens per minute; lower max_tokens", "rate_limit_exceeded", None)
    return _limited(f"{who}: tokens per minute limit {limit} reached (this request may use {tokens})",
                    "rate_limit_exceeded", wait_s)


def budget_refusal(who: str, view: dict, tokens: int, cost: float, now: float) -> BudgetExceededError:
    """``view``: the budget's ``BudgetState.view()`` (its period, what is left)."""
    left = ", ".join(f"{m} remaining {view[m + '_remaining']}" for m in ("tokens", "cost") if m + "_remaining" in view)
    err = BudgetExceededError(f"{who}: the {view['period']} budget cannot cover this request (worst case {tokens} "
                              f"tokens, cost {cost:.6g}; {left}); lower max_tokens, or wait for the next period")
    if view["period_end"] is not None:
        err.retry_after_s = max(1, math.ceil(view["period_end"] - now))
    return err


def budget_view(spec: BudgetSpec, start: float, settled_tokens: int, settled_cost: float, reserved_tokens: int,
                reserved_cost: float) -> dict:
    return BudgetState(spec, start, settled_tokens, settled_cost, reserved_tokens, reserved_cost).view()


def rate_headers(requests: tuple[float, int, float] | None, tokens: tuple[float, int, float] | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers from (capacity, remaining, seconds to full) of each bucket."""
    h: dict[str, str] = {}
    for name, bucket in (("requests", requests), ("tokens", tokens)):
        if bucket is not None:
            capacity, remaining, reset_s = bucket
            h[f"x-ratelimit-limit-{name}"] = str(int(capacity))
            h[f"x-ratelimit-remaining-{name}"] = str(max(int(remaining), 0))
            h[f"x-ratelimit-reset-{name}"] = _duration(reset_s)
    return h


def _duration(s: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``20ms``."""
    if s < 1:
        return f"{max(int(s * 1000), 0)}ms"
    m, sec = divmod(int(math.ceil(s)), 60)
    return f"{m}m{sec}s" if m else f"{sec}s"
