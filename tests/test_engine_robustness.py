"""One request's numbers never break the engine: extreme sampling values, non-finite logits, a
failing step. Every sampled id is in the vocabulary, and the engine serves the next request."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sits.engine.async_engine import AsyncEngine
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.sampler import Sampler
from sits.engine.sampling_params import MIN_TEMPERATURE, SamplingParams

VOCAB = 50


def _sample(logits, params):
    n = len(params)
    return Sampler().sample(logits, params, [[]] * n, [[1, 2]] * n, [None] * n)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_without_a_finite_distribution_fails_alone(temperature):
    logits = torch.randn(4, VOCAB)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf") if temperature else float("nan")
    r = _sample(logits, [SamplingParams(temperature=temperature)] * 4)
    assert r.failed_rows == [1, 2, 3]
    assert all(0 <= t < VOCAB for t in r.token_ids)


def test_overflowing_logits_fail_the_row_instead_of_giving_the_vocab_size():
    logits = torch.full((2, VOCAB), 3e38)        # / a small temperature -> inf -> NaN probabilities
    r = _sample(logits, [SamplingParams(temperature=0.011), SamplingParams(temperature=0.0)])
    assert r.failed_rows == [0]
    assert all(0 <= t < VOCAB for t in r.token_ids)


def test_a_temperature_that_underflows_is_raised_to_the_documented_floor():
    assert SamplingParams(temperature=5e-324).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("value", [1e-300, 5e-324, 0.0, -1.0, math.nan, math.inf])
def test_a_repetition_penalty_that_would_divide_by_zero_is_refused(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(repetition_penalty=value)
    assert e.value.param == "repetition_penalty" and e.value.code == "invalid_parameter"


extreme_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-8, 0.009999, 0.01, 1.0, 2.0, 10.0, 1e38, 3.4e38,
                     -1e-300, -2.0, 2.0000001]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=extreme_floats, top_p=extreme_floats, min_p=extreme_floats, presence=extreme_floats,
       frequency=extreme_floats, repetition=extreme_floats,
       top_k=st.one_of(st.integers(-5, 100), st.sampled_from([2**31, 2**63 - 1])), seed=st.integers(0, 2**32))
def test_random_extreme_parameters_never_yield_an_id_outside_the_vocabulary(
        shared_engine, temperature, top_p, min_p, presence, frequency, repetition, top_k, seed):
    engine = shared_engine
    try:
        params = SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, min_p=min_p,
                                presence_penalty=presence, frequency_penalty=frequency,
                                repetition_penalty=repetition, top_k=top_k, seed=seed, ignore_eos=True)
    except InvalidRequestError:
        params = None                 # refused at the edge, with a typed error: fine
    if params is not None:
        seq = engine.add_request([1, 5, 9, 5, 1], params)
        while engine.has_unfinished:
            for ev in engine.step():
                assert 0 <= ev.token_id < engine.model_config.vocab_size
            assert engine.take_failures() == []       # the tiny model's logits are finite: nothing fails
        assert len(seq.output_token_ids) == 4
    # the engine is alive and right for the next request
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out[0]["finish_reason"] == "length" and len(out[0]["token_ids"]) == 3


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir):
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", warmup=False, kv_cache_memory_mb=16))


def test_non_finite_logits_end_that_request_and_the_engine_serves_on(make_engine):
    engine = make_engine()
    ok = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    head = engine.model.lm_head.weight if hasattr(engine.model, "lm_head") else None
    assert head is not None
    saved = head.detach().clone()
    engine.step()                                  # `ok` has its first token
    with torch.no_grad():
        head.fill_(float("nan"))                   # every row's logits are NaN from now on
    bad = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, temperature=0.8))
    events = engine.step()
    failures = dict(engine.take_failures())
    assert set(failures) == {ok.request_id, bad.request_id}
    assert all(e.code == "non_finite_logits" and e.http_status == 500 for e in failures.values())
    assert not [ev for ev in events if ev.token_id is not None and ev.token_id >= engine.model_config.vocab_size]
    assert not engine.has_unfinished and engine.pool.num_free == engine.pool.num_blocks   # blocks freed
    with torch.no_grad():
        head.copy_(saved)
    out = engine.generate([[7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 2


def test_a_step_that_raises_ends_its_requests_with_internal_error_and_the_loop_lives(make_engine):
    engine = make_engine()
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):          # a device error in one step (the real runner otherwise)
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(batch)

    engine.runner.execute = flaky
    aengine = AsyncEngine(engine)

    async def run(prompt, max_tokens):
        text, err = [], None
        try:
            async for ev in aengine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True)):
                text.append(ev.token_id)
        except SitsError as e:
            err = e
        return text, err

    async def main():
        first = await run([1, 2, 3], 4)            # step 1 ok, step 2 raises
        second = await run([4, 5, 6], 3)
        await aengine.shutdown()
        return first, second

    (toks1, err1), (toks2, err2) = asyncio.run(main())
    assert err1 is not None and err1.code == "internal_error" and "illegal memory access" in err1.message
    assert len(toks1) == 1
    assert err2 is None and len(toks2) == 3
    assert engine.pool.num_free == engine.pool.num_blocks
