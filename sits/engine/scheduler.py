"""Continuous batching under a per-step token budget, with two policies measured against each other.

``fcfs`` is the honest baseline: what vLLM's default scheduler does. Running requests first (decodes
and the unfinished chunks of running prefills, in arrival order), then waiting requests in arrival
order, chunked into whatever budget is left; under KV pressure the newest running request is
preempted.

``pfsd`` (prefill/decode separation + RAAP priorities) splits a step into two lanes:
- the *decode lane*: every running stream gets its one token each step, so a long prompt never stalls
  a stream; how many streams may decode at once (the decode window) is bounded by what the free KV
  blocks can carry for their predicted remaining output, so admissions do not cause preemption storms;
- the *prefill lane*: the rest of the budget goes to prefills (new, partial and preempted alike),
  chunked, in RAAP order: shortest estimated prefill first, interactive before batch, explicit
  priority, predicted output length, memory headroom, minus an aging credit so nothing starves.
Under KV pressure the lowest-priority running request is preempted and later recomputed.

Both share one step (``Scheduler.schedule``: the running lane, then one admission loop); a policy
(``sched_policy.py``) only orders the candidates, picks the preemption victim and says which
admissions fit. Blocks are the ``KVCacheManager``'s business: the scheduler asks it for room and
tells it what was computed, and never touches a block table or a hash itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sits.engine.block_pool import BlockPool
from sits.engine.config import EngineConfig
from sits.engine.fair_share import FairShare
from sits.engine.kv_cache_manager import KVCacheManager
from sits.engine.sched_policy import policy_named
from sits.engine.sequence import Sequence, SequenceStatus

# RAAP weights, in seconds of estimated service time (the unit the aging credit is paid in).
BATCH_PENALTY_S = 2.0            # a batch job waits behind this much interactive work
PRIORITY_STEP_S = 1.0            # each level of explicit priority is worth this much waiting
OUTPUT_WEIGHT = 0.05             # predicted decode time counts a little (short jobs first)
NO_HEADROOM_PENALTY_S = 1.0      # a request whose predicted KV need exceeds the free blocks
INITIAL_PREFILL_TOK_S = 2000.0   # before the first measurement
INITIAL_DECODE_STEP_S = 0.02


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: ``num_new[i]`` tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.seqs)


class ThroughputModel:
    """EWMA estimates the RAAP score converts tokens into seconds with; fed by the engine."""

    def __init__(self) -> None:
        self.prefill_tok_s = INITIAL_PREFILL_TOK_S
        self.decode_step_s = INITIAL_DECODE_STEP_S
        self.output_len = 64.0

    def observe_step(self, prefill_tokens: int, decode_tokens: int, seconds: float, alpha: float = 0.2) -> None:
        if seconds <= 0:
            return
        if prefill_tokens:
            rate = (prefill_tokens + decode_tokens) / seconds
            self.prefill_tok_s += alpha * (rate - self.prefill_tok_s)
        elif decode_tokens:
            self.decode_step_s += alpha * (seconds - self.decode_step_s)

    def observe_finished(self, output_len: int, alpha: float = 0.1) -> None:
        self.output_len += alpha * (output_len - self.output_len)

    def predicted_output(self, seq: Sequence) -> int:
        """Tokens still to generate: the running mean output length, capped by max_tokens."""
        done = len(seq.output_token_ids)
        total = min(seq.params.max_tokens, max(int(self.output_len), done + 1))
        return max(1, total - done)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, max_model_len: int):
        self.cfg = cfg
        self.kv = KVCacheManager(pool)
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.model = ThroughputModel()
        self.num_preemptions = 0
        self.policy = policy_named(cfg.policy)
        self.fair = FairShare()

    # -- queue management -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.fair.arrived(seq.tenant or "")

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks at once (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if seq.status is not SequenceStatus.FINISHED:
            self.fair.left(seq.tenant or "")
        seq.status = SequenceStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_forced = 0                 # recomputed as prefill
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(0, seq)
        batch.preempted.append(seq)

    def _grow_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch,
                         victim: Callable[[], Sequence]) -> bool:
        """Blocks for ``n`` more tokens of a running ``seq``, preempting ``victim()`` until they fit;
        False if ``seq`` itself had to go."""
        while not self.kv.allocate(seq, n):
            v = victim()
            self._preempt(v, batch)
            if v is seq:
                return False
        return True

    def _adapter_fits(self, seq: Sequence, drain: bool = False) -> bool:
        """A sequence of a LoRA adapter starts only while the running sequences use fewer than
        ``max_loras`` adapters or already use its own (every step runs all of them). ``drain``: a
        waiting sequence's adapter cannot start, so running adapters get no new sequences until one
        of them has none left (else an adapter in steady use would keep it out forever)."""
        if seq.lora is None:
            return True
        running = {s.lora for s in self.running if s.lora is not None}
        if seq.lora in running:
            return not drain
        return len(running) < self.cfg.max_loras

    def _adapters_blocked(self) -> bool:
        if not any(s.lora is not None for s in self.waiting):
            return False
        running = {s.lora for s in self.running if s.lora is not None}
        return len(running) >= self.cfg.max_loras and any(
            s.lora is not None and s.lora not in running for s in self.waiting)

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Try to start (or continue) a waiting sequence's prefill; returns tokens scheduled."""
        self.kv.match_prefix(seq)
        n = min(seq.num_remaining, budget)
        if not self.kv.allocate(seq, n):
            if seq.block_table:                               # give back the matched prefix
                self.kv.free(seq)
                seq.num_cached_tokens = 0
            return 0
        self.kv.record_admission(seq)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        batch.add(seq, n)
        return n

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """The running lane, then one admission loop; the policy orders both (``sched_policy.py``)."""
        policy = self.policy
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        now = time.monotonic()
        past_budget = policy.decodes_past_budget

        def victim() -> Sequence:
            return policy.victim(self, now)

        for seq in policy.running_lane(self, budget, now):
            if budget <= 0 and not past_budget:
                break
            if seq.status is not SequenceStatus.RUNNING:      # preempted earlier in this loop
                continue
            n = min(seq.num_remaining, max(1, budget) if past_budget else budget)
            if self._grow_or_preempt(seq, n, batch, victim):
                batch.add(seq, n)
                budget -= n
        if batch.preempted and not policy.admits_under_pressure:
            return batch
        admission = policy.admission(self, now)
        drain = self._adapters_blocked()
        for seq in admission.candidates:
            if budget <= 0:
                break
            if seq in batch.preempted:
                continue
            if seq.status is SequenceStatus.RUNNING:          # a running prefill's next chunk
                n = min(seq.num_remaining, budget)
                if self.kv.allocate(seq, n):
                    batch.add(seq, n)
                    budget -= n
                continue
            if len(self.running) >= self.cfg.max_num_seqs or not admission.fits(seq) or \
                    not self._adapter_fits(seq, drain):
                if policy.head_of_line:
                    break
                continue
            n = self._admit(seq, budget, batch)
            if n == 0:
                if policy.head_of_line:
                    break
                continue
            budget -= n
            admission.admitted(seq)
        return batch

    def priority_key(self, seq: Sequence, now: float) -> tuple[int, float]:
        """(the tenant's fair-share rank, the RAAP score); lower runs sooner. The rank is its
        tenant's lead over the least-served active tenant in steps' worth of tokens (0 without
        tenants, or with ``fair_share`` off), so among tenants within a step of each other RAAP alone
        decides."""
        rank = 0
        if self.cfg.fair_share:
            rank = int(self.fair.lead(seq.tenant or "") // self.cfg.max_num_batched_tokens)
        return rank, self.raap_score(seq, now)

    def raap_score(self, seq: Sequence, now: float) -> float:
        """RAAP score in seconds of estimated service time; lower runs sooner."""
        m = self.model
        score = seq.num_remaining / m.prefill_tok_s
        score += OUTPUT_WEIGHT * m.predicted_output(seq) * m.decode_step_s
        if not seq.interactive:
            score += BATCH_PENALTY_S
        score -= PRIORITY_STEP_S * seq.priority
        if self.kv.missing_blocks(seq, seq.num_tokens + m.predicted_output(seq)) > self.kv.num_free:
            score += NO_HEADROOM_PENALTY_S
        return score - self.cfg.aging_per_s * (now - seq.arrival_time)

    def decode_reserve(self) -> int:
        """Blocks the running streams are predicted to still need (the decode window's headroom)."""
        m = self.model
        reserve = 0
        for seq in self.running:
            total = min(seq.num_tokens + m.predicted_output(seq), self.max_model_len)
            reserve += self.kv.missing_blocks(seq, total)
        return reserve

    def lowest_priority(self, now: float) -> Sequence:
        return max(self.running, key=lambda s: (self.priority_key(s, now), s.arrival_time))

    # -- after the forward pass -----------------------------------------------------------------
    def on_computed(self, batch: ScheduledBatch) -> None:
        """Advance computed counts; blocks that just became full join the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new):
            prefill = min(n, max(len(seq.prompt_token_ids) - seq.num_computed_tokens, 0))
            self.fair.charge(seq.tenant or "", prefill, n - prefill, seq.tenant_weight)
            seq.num_computed_tokens += n
            if seq.num_forced:
                seq.num_forced = max(0, min(seq.num_forced, seq.num_remaining - 1))
            self.kv.cache_full_blocks(seq)
