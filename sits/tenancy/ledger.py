"""Where the accounts' running state lives (requests in flight, rate buckets, budget spend and
reservations): ``LocalLedger`` keeps it in this process, for one gateway that is the authority for
its tenants; ``RedisLedger`` (``redis_ledger.py``) keeps it in Redis, for several gateways sharing
tenants. Both admit all-or-none: the check of every account of a request and the reservation on all
of them are one step nothing else interleaves with (no ``await`` in between here; one Lua script
there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from sits.tenancy.accounts import Account
from sits.tenancy.spec import BudgetSpec, LimitsSpec

AccountRef = tuple[str, str]           # ("key", key id) | ("tenant", name)


@dataclass
class Reservation:
    """A request's worst case held on its accounts until it is settled (exactly once)."""

    refs: list[AccountRef]
    tokens: int
    cost: float
    headers: dict[str, str] = field(default_factory=dict)     # x-ratelimit-* as admitted
    handle: object = None                                     # the ledger's own: accounts, or a Redis id
    started: bool = False


class Ledger(Protocol):
    def configure(self, ref: AccountRef, limits: LimitsSpec, budgets: list[BudgetSpec]) -> None:
        """An account's limits and budgets, new or changed (what was spent and is in flight stays)."""

    def drop(self, ref: AccountRef) -> None:
        """A revoked key or deleted tenant: it admits nothing any more."""

    def refs(self) -> set[AccountRef]:
        """The accounts configured."""

    async def admit(self, refs: list[AccountRef], tokens: int, cost: float) -> Reservation:
        """Reserve on every account or raise the typed 429 of the first that refuses."""

    async def check(self, refs: list[AccountRef], tokens: int, cost: float) -> None:
        """Raise what ``admit`` would raise now, reserving nothing."""

    def first_token(self, res: Reservation) -> None:
        """The request is no longer queued (``max_queued``)."""

    def settle(self, res: Reservation, tokens: int, cost: float) -> None:
        """What was used replaces the reservation (0, 0 releases it). Synchronous, so that a request
        that ends in a ``finally`` or a finalizer always settles; a shared ledger completes it in the
        background (``drain`` waits for that)."""

    async def drain(self) -> None:
        """Every settlement handed to ``settle`` so far has reached the ledger."""

    async def view(self, ref: AccountRef) -> dict | None:
        """Limits, in flight, budgets (spent, reserved, remaining) and rate headers now."""

    def snapshot(self) -> list[tuple[AccountRef, int, list[dict]]]:
        """(account, in flight, budget views) of every account, for metrics (may lag a little)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


Spent = Callable[[str, str, float], tuple[int, float]]    # (tenant | key_id, id, since) -> settled tokens, cost


class LocalLedger:
    """The accounts in this process's memory; a budget's spend so far is summed from the usage rows
    when the account is created (``spent``), then kept here."""

    def __init__(self, spent: Spent, clock=time.time):
        self.spent = spent
        self.clock = clock
        self.accounts: dict[AccountRef, Account] = {}

    def _spent(self, ref: AccountRef):
        column = "tenant" if ref[0] == "tenant" else "key_id"
        return lambda budget, since: self.spent(column, ref[1], since)

    def configure(self, ref: AccountRef, limits: LimitsSpec, budgets: list[BudgetSpec]) -> None:
        acct = self.accounts.get(ref)
        if acct is None:
            self.accounts[ref] = Account.new(ref[0], ref[1], limits, budgets, self.clock(), self._spent(ref))
        else:
            acct.configure(limits, budgets, self.clock(), self._spent(ref))

    def drop(self, ref: AccountRef) -> None:
        self.accounts.pop(ref, None)

    def refs(self) -> set[AccountRef]:
        return set(self.accounts)

    def _current(self, refs: list[AccountRef], now: float) -> list[Account]:
        out = []
        for ref in refs:
            acct = self.accounts.get(ref)
            if acct is not None:
                acct.roll(now, self._spent(ref))
                out.append(acct)
        return out

    async def check(self, refs: list[AccountRef], tokens: int, cost: float) -> None:
        self._refuse(self._current(refs, self.clock()), tokens, cost)

    def _refuse(self, accounts: list[Account], tokens: int, cost: float) -> None:
        now = self.clock()
        for acct in accounts:
            err = acct.refusal(tokens, cost, now)
            if err is not None:
                err.headers = acct.rate_headers(now)
                raise err

    async def admit(self, refs: list[AccountRef], tokens: int, cost: float) -> Reservation:
        now = self.clock()
        accounts = self._current(refs, now)
        self._refuse(accounts, tokens, cost)          # no await between the check and the reservation
        for acct in accounts:
            acct.reserve(tokens, cost)
        headers = next((h for a in accounts if (h := a.rate_headers(now))), {})
        return Reservation(refs, tokens, cost, headers, handle=accounts)

    def first_token(self, res: Reservation) -> None:
        for a in res.handle:
            a.started()

    def settle(self, res: Reservation, tokens: int, cost: float) -> None:
        for a in res.handle:
            a.settle(res.tokens, res.cost, tokens, cost, res.started)

    async def drain(self) -> None:
        pass

    async def view(self, ref: AccountRef) -> dict | None:
        accounts = self._current([ref], self.clock())
        return accounts[0].view(self.clock()) if accounts else None

    def snapshot(self) -> list[tuple[AccountRef, int, list[dict]]]:
        return [(ref, a.active, [b.view() for b in a.budgets]) for ref, a in list(self.accounts.items())]

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
