"""Scheduling policies: how ``Scheduler.schedule`` orders its one running lane and one admission loop.

A policy decides nothing about blocks or budgets (the scheduler does); it says which running
sequences compute this step and in what order, who is preempted under KV pressure, which
candidates the admission loop tries and in what order, and whether one that does not fit blocks
the queue behind it (vLLM's FCFS queue) or is skipped (a priority queue).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sits.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from sits.engine.scheduler import Scheduler
    from sits.engine.sequence import Sequence


@dataclass(slots=True)
class Admission:
    """One step's admission: the candidates in order, and the policy's say on each."""

    candidates: list["Sequence"]
    fits: Callable[["Sequence"], bool] = lambda seq: True
    admitted: Callable[["Sequence"], None] = lambda seq: None


class FcfsPolicy:
    """vLLM's default: running requests in arrival order, then the waiting queue in arrival order,
    stopping at the first that does not fit; the newest running request is preempted first, and a
    step that preempted admits nothing."""

    name = "fcfs"
    head_of_line = True
    decodes_past_budget = False
    admits_under_pressure = False

    def running_lane(self, sched: "Scheduler", budget: int, now: float) -> list["Sequence"]:
        return list(sched.running)

    def victim(self, sched: "Scheduler", now: float) -> "Sequence":
        return sched.running[-1]

    def admission(self, sched: "Scheduler", now: float) -> Admission:
        return Admission(list(sched.waiting))


class PfsdPolicy:
    """Prefill/decode separation with RAAP priorities: the running lane is the decode lane (every
    stream one token, most important first, yielding to waiting prefills down to half the budget);
    running prefills and waiting requests then compete in RAAP order, skipping what does not fit,
    and a request is admitted only if the decode window's predicted KV needs still fit beside it."""

    name = "pfsd"
    head_of_line = False
    decodes_past_budget = True        # a decode is one token (or a grammar's forced run): never cut
    admits_under_pressure = True

    def running_lane(self, sched: "Scheduler", budget: int, now: float) -> list["Sequence"]:
        decodes = sorted((s for s in sched.running if not s.is_prefill), key=lambda s: sched.priority_key(s, now))
        prefill_waiting = bool(sched.waiting) or len(decodes) < len(sched.running)
        window = max(sched.cfg.min_decode_window, budget // 2) if prefill_waiting else len(decodes)
        return decodes[:window]

    def victim(self, sched: "Scheduler", now: float) -> "Sequence":
        return sched.lowest_priority(now)

    def admission(self, sched: "Scheduler", now: float) -> Admission:
        partial = [s for s in sched.running if s.is_prefill and s.status is SequenceStatus.RUNNING]
        candidates = sorted(partial + sched.waiting, key=lambda s: sched.priority_key(s, now))
        reserve = sched.decode_reserve()

        def predicted_blocks(seq: "Sequence") -> int:
            return sched.kv.blocks_needed(min(seq.num_tokens + sched.model.predicted_output(seq),
                                              sched.max_model_len))

        def fits(seq: "Sequence") -> bool:       # the decode window's headroom, unless nothing else runs
            return not sched.running or predicted_blocks(seq) + reserve <= sched.kv.num_free + len(seq.block_table)

        def admitted(seq: "Sequence") -> None:
            nonlocal reserve
            reserve += sched.kv.blocks_needed(seq.num_tokens + sched.model.predicted_output(seq)) \
                - len(seq.block_table)

        return Admission(candidates, fits, admitted)


POLICIES = {"fcfs": FcfsPolicy, "pfsd": PfsdPolicy}


def policy_named(name: str) -> FcfsPolicy | PfsdPolicy:
    return POLICIES[name]()
