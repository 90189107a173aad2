"""AsyncEngine: streaming, concurrency, abort on disconnect, typed errors before queuing."""

from __future__ import annotations

import asyncio

import pytest

from conftest import dense_greedy
from sits.engine.async_engine import AsyncEngine
from sits.engine.config import EngineConfig
from sits.engine.errors import SitsError
from sits.engine.sampling_params import SamplingParams


@pytest.fixture
def async_engine(tiny_model_dir):
    async def make():
        return await AsyncEngine.start(EngineConfig(model=tiny_model_dir, device="cpu", warmup=False,
                                                    kv_cache_memory_mb=32))
    return make


def test_concurrent_streams_match_the_reference(async_engine):
    async def main():
        eng = await async_engine()
        prompts = [[5 + (i * 11 + j) % 300 for j in range(10 + 7 * i)] for i in range(5)]

        async def one(p, i):
            evs = [ev async for ev in eng.generate(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                                   priority=i % 2, interactive=bool(i % 2))]
            return evs

        results = await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
        for p, evs in zip(prompts, results):
            assert [e.index for e in evs] == list(range(12))
            assert evs[-1].finished and evs[-1].finish_reason == "length"
            assert [e.token_id for e in evs] == dense_greedy(eng.engine, p, 12)
            assert evs[0].ttft_s is not None and evs[0].ttft_s >= 0
        await eng.shutdown()
    asyncio.run(main())


def test_consumer_that_stops_early_aborts_and_frees_blocks(async_engine):
    async def main():
        eng = await async_engine()
        agen = eng.generate("a long story", SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        for _ in range(100):
            st = eng.stats()
            if st.num_running == 0 and st.num_free_blocks == st.num_kv_blocks:
                break
            await asyncio.sleep(0.02)
        assert st.num_free_blocks == st.num_kv_blocks and st.num_running == 0
        await eng.shutdown()
    asyncio.run(main())


def test_cancelled_task_aborts(async_engine):
    async def main():
        eng = await async_engine()

        async def consume():
            async for _ in eng.generate("x", SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if eng.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert eng.stats().num_free_blocks == eng.stats().num_kv_blocks
        await eng.shutdown()
    asyncio.run(main())


def test_invalid_input_raises_before_queuing(async_engine):
    async def main():
        eng = await async_engine()
        with pytest.raises(SitsError) as e:
            async for _ in eng.generate("", SamplingParams()):
                pass
        assert e.value.code == "empty_prompt"
        # the engine is unharmed
        evs = [ev async for ev in eng.generate("ok", SamplingParams(max_tokens=2, temperature=0.0))]
        assert evs[-1].finished
        await eng.shutdown()
    asyncio.run(main())
