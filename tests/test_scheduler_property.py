"""Property: any mix of arrivals, lengths, priorities, grammars and aborts ends with zero leaked KV blocks,
every request finished, and no deadlock — under both policies and a pool small enough to preempt."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sits.engine.guided import json_schema_grammar
from sits.engine.sampling_params import SamplingParams

request = st.tuples(st.integers(1, 60),            # prompt length
                    st.integers(1, 24),            # max_tokens
                    st.integers(0, 6),             # arrival step
                    st.one_of(st.none(), st.integers(0, 12)),   # abort after this many steps
                    st.integers(-2, 2),            # explicit priority
                    st.booleans(),                 # interactive
                    st.booleans())                 # guided by a grammar (jump-forward appends forced tokens)

# long forced runs (keys, punctuation) between free choices: jump-forward chunks under KV pressure
GRAMMAR = json_schema_grammar({"type": "object", "properties": {
    "a_rather_long_property_name": {"enum": ["first", "second"]},
    "another_long_property_name": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a_rather_long_property_name", "another_long_property_name"]})


def _run(engine, reqs):
    vocab = engine.model_config.vocab_size
    pending = sorted(enumerate(reqs), key=lambda r: r[1][2])
    added: dict[str, tuple[int, int | None]] = {}
    done: set[str] = set()
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][1][2] <= step:
            i, (plen, mt, _, abort_at, prio, inter, guided) = pending.pop(0)
            seq = engine.add_request([(i * 17 + j) % (vocab - 5) + 5 for j in range(plen)],
                                     SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True,
                                                    grammar=GRAMMAR if guided else None),
                                     priority=prio, interactive=inter, request_id=f"r{i}")
            added[seq.request_id] = (step, abort_at)
        for rid, (t, abort_at) in list(added.items()):
            if abort_at is not None and step - t == abort_at and rid not in done:
                if engine.abort(rid):
                    done.add(rid)
        for ev in engine.step():
            if ev.finished:
                done.add(ev.request_id)
        step += 1
        assert step < 2000, "no progress: scheduler deadlocked"
    return added, done


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    return {p: LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", warmup=False, policy=p,
                                      num_kv_blocks=16, block_size=8, max_num_batched_tokens=48, max_num_seqs=6))
            for p in ("pfsd", "fcfs")}


@pytest.mark.parametrize("policy", ["pfsd", "fcfs"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=10))
def test_random_workloads_leak_no_blocks(engines, policy, reqs):
    eng = engines[policy]
    added, done = _run(eng, reqs)
    assert set(added) == done
    stats = eng.stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert all(b.ref_count == 0 for b in eng.pool.blocks)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["pfsd", "fcfs"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=16))
def test_random_workloads_leak_no_blocks_long(engines, policy, reqs):
    eng = engines[policy]
    added, done = _run(eng, reqs)
    assert set(added) == done
    assert eng.stats().num_free_blocks == eng.stats().num_kv_blocks
