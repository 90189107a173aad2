"""Which READY instance serves a request: session affinity, then prefix-cache affinity × KV room,
minus load.

- A request with ``X-Session-ID`` goes where its session went last, while that instance is READY
  (its conversation's KV blocks are most likely still cached there).
- Otherwise each instance scores ``affinity × room − load``: ``affinity`` is the share of the
  prompt's leading 16-token blocks that this instance served recently (the gateway's view of its
  prefix cache, hash-chained like the engine's), floored at a small base so a cold instance can
  still win; ``room`` is how much of the request's token budget (prompt + max_tokens) fits in the
  instance's free KV blocks (capped at 1); ``load`` is its in-flight requests over its batch size.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

import xxhash

BLOCK = 16
BASE_AFFINITY = 0.2          # an instance with nothing cached still scores this much
LOAD_WEIGHT = 1.0          # a full batch outweighs a fully cached prompt


def prefix_hashes(token_ids: Seq[int], block: int = BLOCK, limit: int = 64) -> list[int]:
    """Chained hashes of the full leading blocks (at most ``limit``)."""
    out, h = [], 0
    for i in range(0, min(len(token_ids) // block, limit) * block, block):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + array.array("q", token_ids[i:i + block]).tobytes())
        out.append(h)
    return out


class Router:
    def __init__(self, max_entries_per_instance: int = 4096, max_sessions: int = 10_000):
        self._cached: dict[str, OrderedDict[int, None]] = {}      # instance id -> recent block hashes (LRU)
        self._sessions: OrderedDict[str, str] = OrderedDict()     # session -> instance id
        self.max_entries = max_entries_per_instance
        self.max_sessions = max_sessions

    def instance_of(self, session_id: str) -> str | None:
        """The instance this session last ran on (affinity), if remembered."""
        return self._sessions.get(session_id)

    def choose(self, instances: list, hashes: list[int], budget_tokens: int, session_id: str | None = None):
        """``instances``: READY instances with ``id``, ``inflight`` and ``backend.stats()``; ``hashes``:
        ``prefix_hashes`` of the prompt (computed once per request, shared with ``record``)."""
        if session_id is not None:
            target = self._sessions.get(session_id)
            for inst in instances:
                if inst.id == target:
                    self._sessions.move_to_end(session_id)
                    return inst, "session"
        best, best_score = None, float("-inf")
        for inst in instances:
            cached = self._cached.get(inst.id)
            hit = 0
            if cached:
                for h in hashes:
                    if h not in cached:
                        break
                    hit += 1
            affinity = max(BASE_AFFINITY, hit / len(hashes)) if hashes else BASE_AFFINITY
            st = inst.backend.stats()
            room = 1.0 if budget_tokens <= 0 else min(1.0, st.num_free_blocks * BLOCK / budget_tokens)
            load = inst.inflight / max(1, inst.backend.max_num_seqs)
            score = affinity * room - LOAD_WEIGHT * load
            if score > best_score:
                best, best_score = inst, score
        return best, "score"

    def record(self, instance_id: str, hashes: list[int], session_id: str | None = None) -> None:
        cached = self._cached.setdefault(instance_id, OrderedDict())
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.max_entries:
            cached.popitem(last=False)
        if session_id is not None:
            self._sessions[session_id] = instance_id
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        self._cached.pop(instance_id, None)
