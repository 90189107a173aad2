"""The OpenAI dialect end to end: a real uvicorn server, the official `openai` client (sync + async)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module", params=["process", "thread"])
def server(serve_tiny, request):
    """Every test runs against both engine modes of `sits serve`."""
    return serve_tiny(engine_mode=request.param)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "sits"


def test_completion_non_streaming_usage_and_headers(client):
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello world", max_tokens=8,
                                                      temperature=0)
    c = raw.parse()
    assert c.object == "text_completion" and c.model == "tiny"
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0
    assert c.usage.total_tokens == c.usage.prompt_tokens + 8
    assert raw.headers["x-request-id"]
    timing = raw.headers["server-timing"]
    for stage in ("validate", "queue", "prefill"):
        assert f"{stage};dur=" in timing


def test_streaming_concatenates_to_the_non_streamed_text(client):
    full = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_sync_and_stream_agree(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, server):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 256   # the test server's max_model_len


def test_max_completion_tokens_alias(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_stop_string_ends_the_output_and_is_not_returned(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                     logprobs=0)
    tokens = base.choices[0].logprobs.tokens
    # a stop string that first appears at the 4th token: the output is what came before it
    stop = tokens[3].strip() or tokens[3]
    text = base.choices[0].text
    cut = text.index(stop)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                  stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:cut]
    assert stop not in r.choices[0].text


def test_seed_reproducibility(client):
    kw = dict(model="tiny", prompt="In the beginning", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b
    assert a != c


def test_n_choices_are_distinct_and_reproducible(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "tell me"}], max_tokens=10, temperature=1.0,
              seed=3, n=3)
    r1 = client.chat.completions.create(**kw)
    r2 = client.chat.completions.create(**kw)
    assert [c.index for c in r1.choices] == [0, 1, 2]
    texts = [c.message.content for c in r1.choices]
    assert len(set(texts)) == 3
    assert texts == [c.message.content for c in r2.choices]
    assert 3 <= r1.usage.completion_tokens <= 30
    # streamed n=2: every choice index gets its own role chunk and finish chunk
    chunks = list(client.chat.completions.create(stream=True, **{**kw, "n": 2}))
    finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finished == {0, 1}
    streamed = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i)
                for i in (0, 1)]
    assert streamed == texts[:2]


def test_several_prompts_and_token_id_prompts(client):
    r = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    single = client.completions.create(model="tiny", prompt="two", max_tokens=4, temperature=0)
    assert r.choices[2].text == single.choices[0].text
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_logprobs_completions_and_chat(client):
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text or len(lp.tokens) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):   # greedy: the chosen token is the best
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_unknown_fields_are_ignored_and_named_in_a_warning_header(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                           "suffix": "!", "zzz_custom": True})
    assert r.status_code == 200
    assert "suffix" in r.headers["warning"] and "zzz_custom" in r.headers["warning"]


def test_stream_meta_is_opt_in_and_does_not_break_the_client(client, server):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-SITS-Stream-Meta": "1"})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # the raw wire: every chunk carries "sits" with a running seq and a stage
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-SITS-Stream-Meta": "1"},
                      json={"model": "tiny", "prompt": "go", "max_tokens": 6, "temperature": 0,
                            "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    metas = [json.loads(ln[6:])["sits"] for ln in lines[:-1]]
    assert [m["seq"] for m in metas] == list(range(len(metas)))
    assert metas[0]["stage"] == "queue" and metas[1]["stage"] == "prefill"
    assert all(m["stage"] == "decode" for m in metas[2:])
    assert all(m["delay_us"] >= 0 for m in metas) and metas[1]["engine_ttft_us"] > 0
    # and without the header there is no "sits" field
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "go", "max_tokens": 3, "stream": True}) as r:
        plain = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    assert plain and all('"sits"' not in ln for ln in plain)


def test_async_client_stream_and_non_stream(server):
    asyncio.run(_async_client_checks(server))


async def _async_client_checks(server):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
    stream = await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=5, temperature=0, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    assert text == r.choices[0].message.content
    many = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=f"p{i}", max_tokens=4)
                                  for i in range(8)])
    assert all(m.usage.completion_tokens <= 4 for m in many)
    await aclient.close()


def test_metrics_endpoint_counts_what_was_served(client, server):
    client.completions.create(model="tiny", prompt="count me", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("sits:time_to_first_token_seconds_bucket", "sits:inter_token_latency_seconds_bucket",
                 "sits:e2e_request_latency_seconds_bucket", "sits:request_queue_time_seconds_bucket",
                 "sits:kv_cache_usage_perc", "sits:num_requests_running", "sits:num_requests_waiting",
                 "sits:prefix_cache_queries", "sits:prefix_cache_hits", "sits:num_preemptions",
                 "sits:prompt_tokens_total", "sits:generation_tokens_total"):
        assert name in text, name
    assert 'le="0.001"' in text and 'le="7.5"' in text   # the OTel GenAI TTFT buckets
    gen = [ln for ln in text.splitlines() if ln.startswith('sits:generation_tokens_total{model_name="tiny"}')]
    assert float(gen[0].split()[-1]) >= 3


def test_health_and_ready(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = httpx.get(server.url + "/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
