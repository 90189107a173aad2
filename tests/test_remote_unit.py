"""Remote units (issue 21): a unit backed by an OpenAI-compatible endpoint, here a second SITS server
started by the test, gets the gateway's features: the same answers as the endpoint called directly
(chat, streamed or not, completions, tool calls), sessions, the runtime's tool loop, metrics, the
SLA breaker with its fallback, trace context passed on, and the endpoint's errors as typed errors."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from conftest import free_port, start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import wait_for
from test_tool_calling import OPENAI_TOOLS, SPECS, TEST_TOOLS

UPSTREAM_KEY = "upstream-secret"
KEY_ENV = "SITS_TEST_REMOTE_KEY"
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


def remote(name: str, url: str, **kw) -> UnitSpec:
    backend = {"openai": url, "model": "tiny", "api_key_env": KEY_ENV, **kw.pop("backend", {})}
    return UnitSpec.model_validate({"name": name, "backend": backend, **kw})


@pytest.fixture(scope="module")
def upstream(serve_tiny):
    return serve_tiny(ServerSettings(drain_grace_s=1.0, api_keys=(UPSTREAM_KEY,), trace_exporter="memory",
                                     trace_level_rates={"L1": 1.0, "L2": 1.0, "L3": 1.0}),
                      max_model_len=1024)


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    os.environ[KEY_ENV] = UPSTREAM_KEY
    dead = f"http://127.0.0.1:{free_port()}/v1"          # nothing listens there
    units = [remote("big", upstream.url + "/v1", tools=["test.sum@^1"]),
             remote("flaky", dead, fallback="big", backend={"connect_timeout_s": 2},
                    sla={"min_requests": 2, "success_rate": 0.9, "window_s": 60, "open_s": 60})]
    data = tmp_path_factory.mktemp("remote-gw")
    gw = Gateway(data, tick_s=0.2, zygote=False)
    app = build_gateway_app(gw, units, ServerSettings(drain_grace_s=0.5, tool_dirs=(str(TEST_TOOLS),), data_dir=str(data),
                                                      trace_exporter="memory",
                                                      trace_level_rates={"L1": 1.0, "L2": 1.0, "L3": 1.0}))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    yield srv, gw
    srv.stop()
    os.environ.pop(KEY_ENV, None)


def clients(upstream, gateway):
    return (openai.OpenAI(base_url=gateway[0].url + "/v1", api_key="x", max_retries=0),
            openai.OpenAI(base_url=upstream.url + "/v1", api_key=UPSTREAM_KEY, max_retries=0))


def test_chat_through_a_remote_unit_is_the_endpoints_answer(upstream, gateway):
    via, direct = clients(upstream, gateway)
    kw = dict(messages=MESSAGES, max_tokens=12, temperature=0)
    a = via.chat.completions.create(model="big", **kw)
    b = direct.chat.completions.create(model="tiny", **kw)
    assert a.model == "big" and a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
    # streamed: the same text, and the usage chunk carries the endpoint's own counts
    chunks = list(via.chat.completions.create(model="big", stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == b.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == b.usage.completion_tokens
    assert {m.id for m in via.models.list().data} >= {"big", "flaky"}
    # n choices: one endpoint call each, seeded apart as a local unit does
    n = via.chat.completions.create(model="big", messages=MESSAGES, max_tokens=6, n=2, seed=5)
    assert len(n.choices) == 2 and n.usage.completion_tokens == sum(
        direct.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=5 + i).usage.completion_tokens
        for i in range(2))


def test_completions_and_the_endpoints_errors_pass_through_typed(upstream, gateway):
    via, direct = clients(upstream, gateway)
    a = via.completions.create(model="big", prompt="The river", max_tokens=8, temperature=0)
    b = direct.completions.create(model="tiny", prompt="The river", max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.total_tokens == b.usage.total_tokens
    url = gateway[0].url
    cases = [
        ("/v1/completions", {"model": "big", "prompt": [1, 2, 3]}, 400, "token_prompt_unsupported"),
        ("/v1/chat/completions", {"model": "big", "messages": MESSAGES, "logprobs": True}, 400, "unsupported_parameter"),
        ("/v1/embeddings", {"model": "big", "input": "x"}, 400, "embeddings_unsupported"),
        # the endpoint's own refusal (its context is 1024 tokens), with its code
        ("/v1/chat/completions", {"model": "big", "messages": [{"role": "user", "content": "word " * 3000}],
                                  "max_tokens": 4}, 400, "context_length_exceeded"),
    ]
    for path, body, status, code in cases:
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["code"] == code, (path, r.text)
    r = httpx.post(url + "/v1/units/big/scale", json={"instances": 2}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unit_not_scalable"


def test_tool_calls_come_back_as_tool_calls(upstream, gateway):
    via, direct = clients(upstream, gateway)
    kw = dict(messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=OPENAI_TOOLS,
              tool_choice="required", max_tokens=80, temperature=0)
    a = via.chat.completions.create(model="big", **kw)
    b = direct.chat.completions.create(model="tiny", **kw)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "tool_calls"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in a.choices[0].message.tool_calls]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in b.choices[0].message.tool_calls]
    assert got == want and got[0][0] in {s.name for s in SPECS}


def test_a_session_keeps_its_history_across_remote_turns(upstream, gateway):
    via, direct = clients(upstream, gateway)
    h = {"X-Session-ID": "remote-s1"}
    first = via.chat.completions.create(model="big", messages=MESSAGES, max_tokens=8, temperature=0, extra_headers=h)
    follow = [{"role": "user", "content": "And then?"}]
    second = via.chat.completions.create(model="big", messages=follow, max_tokens=8, temperature=0, extra_headers=h)
    whole = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content}] + follow
    assert second.choices[0].message.content == direct.chat.completions.create(
        model="tiny", messages=whole, max_tokens=8, temperature=0).choices[0].message.content


def test_the_runtimes_tool_loop_runs_over_a_remote_unit(gateway):
    srv, _ = gateway
    rid = httpx.post(srv.url + "/v1/requests", json={
        "unit": "big", "prompt": "What is 2+3?", "allowed_tools": ["test.sum@^1"], "tool_choice": "test.sum",
        "constraints": {"max_tokens": 64}, "seed": 1}, timeout=30).json()["id"]
    view = wait_for(lambda: (v := httpx.get(f"{srv.url}/v1/requests/{rid}").json())["state"]
                    in ("RESOLVED", "REJECTED") and v, timeout=120, what=f"request {rid}")
    assert view["state"] == "RESOLVED", view
    call = view["tool_steps"][0]["calls"][0]
    expression = json.loads(call["function"]["arguments"])["expression"]
    assert call["function"]["name"] == "test_sum" and call["result"]["output"].strip() == str(eval(expression))
    assert view["usage"]["completion_tokens"] > 0


def test_the_trace_continues_on_the_endpoint_and_metrics_count_the_unit(upstream, gateway):
    srv, _ = gateway
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "big", "messages": MESSAGES, "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200, r.text
    ours = {s.context.trace_id for s in srv.app.state.sits.tracing.finished_spans() if s.name == "remote.call"}
    theirs = {s.context.trace_id for s in upstream.app.state.sits.tracing.finished_spans()}
    assert ours and ours & theirs
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'sits:time_to_first_token_seconds_count{model_name="big"}' in metrics


def test_an_unreachable_endpoint_opens_the_breaker_and_the_fallback_serves(gateway):
    srv, gw = gateway
    via = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as e:
            via.chat.completions.create(model="flaky", messages=MESSAGES, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "remote_unreachable"
    wait_for(lambda: gw.units["flaky"].breaker.state.value == "OPEN", timeout=10, what="breaker open")
    r = via.chat.completions.create(model="flaky", messages=MESSAGES, max_tokens=4)
    assert r.model == "big"           # served by the fallback while the breaker is open
    view = httpx.get(srv.url + "/v1/units/flaky").json()
    assert view["kind"] == "remote" and view["sla"]["state"] == "OPEN" and view["errors"]["remote_unreachable"] == 2


def test_a_remote_unit_spec_is_checked():
    with pytest.raises(ValueError, match="one of model"):
        UnitSpec.model_validate({"name": "x"})
    with pytest.raises(ValueError, match="takes no adapters"):
        UnitSpec.model_validate({"name": "x", "backend": {"openai": "http://h/v1"}, "adapters": {"a": "/p"}})
    with pytest.raises(ValueError, match="not model and backend"):
        UnitSpec.model_validate({"name": "x", "model": "/m", "backend": {"openai": "http://h/v1"}})


def test_a_missing_api_key_variable_is_refused_at_deploy(gateway):
    srv, _ = gateway
    body = remote("nokey", "http://127.0.0.1:1/v1", backend={"api_key_env": "SITS_TEST_UNSET_KEY"}).model_dump()
    r = httpx.post(srv.url + "/v1/units", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "remote_api_key_missing", r.text


def test_a_client_that_goes_away_aborts_the_endpoints_request(upstream, gateway):
    def aborted() -> float:
        for line in httpx.get(upstream.url + "/metrics").text.splitlines():
            if line.startswith("sits:request_success_total{") and 'finished_reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    with httpx.stream("POST", gateway[0].url + "/v1/chat/completions", timeout=30, json={
            "model": "big", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(x.startswith("data: ") for x in got)
    wait_for(lambda: aborted() > before, timeout=30, what="the endpoint's request aborted")


def test_tenants_are_charged_what_the_endpoint_counted(upstream, tmp_path):
    os.environ[KEY_ENV] = UPSTREAM_KEY
    spec = remote("priced", upstream.url + "/v1", pricing={"input_per_mtok": 1.0, "output_per_mtok": 4.0})
    gw = Gateway(tmp_path, tick_s=0.2, zygote=False)
    app = build_gateway_app(gw, [spec], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        url = srv.url
        httpx.post(f"{url}/v1/tenants", json={"name": "ops"})
        admin = httpx.post(f"{url}/v1/tenants/ops/keys", json={"role": "admin"}).json()["key"]
        h = {"authorization": f"Bearer {admin}"}
        assert httpx.post(f"{url}/v1/tenants", json={"name": "team"}, headers=h).status_code == 201
        key = httpx.post(f"{url}/v1/tenants/team/keys", json={}, headers=h).json()["key"]
        r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "priced", "messages": MESSAGES, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key=UPSTREAM_KEY, max_retries=0)
        want = direct.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0).usage
        assert (u["prompt_tokens"], u["completion_tokens"]) == (want.prompt_tokens, want.completion_tokens)
        assert u["sits"]["cost"] == pytest.approx((want.prompt_tokens * 1.0 + want.completion_tokens * 4.0) / 1e6)
        rows = wait_for(lambda: [x for x in httpx.get(f"{url}/v1/usage", headers=h).json()["data"]
                                 if x.get("unit") == "priced"], timeout=10, what="a usage row")
        assert rows[0]["prompt_tokens"] == want.prompt_tokens and rows[0]["completion_tokens"] == want.completion_tokens
    finally:
        srv.stop()


def test_retrieved_memories_reach_the_endpoint(gateway):
    srv, _ = gateway
    docs = ["The river festival starts at dawn on the first Sunday of June.",
            "Invoices are due thirty days after the billing date."]
    assert httpx.post(srv.url + "/v1/memory/kb", json={"texts": docs}, timeout=60).status_code == 201
    body = {"model": "big", "messages": [{"role": "user", "content": "When does the river festival start?"}],
            "max_tokens": 4, "temperature": 0}
    plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    grounded = httpx.post(srv.url + "/v1/chat/completions", json={**body, "memory_ref": "kb"}, timeout=60).json()
    assert grounded["citations"] and "river festival" in grounded["citations"][0]["text"]
    # the endpoint counted the retrieved context in its prompt
    assert grounded["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 10


def _hostile_endpoint():
    """An endpoint that answers 200 and then breaks the protocol, one way per model name."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    bodies = {
        "null-choice": ['{"choices": [null]}'],
        "string-delta": ['{"choices": [{"index": 0, "delta": "oops"}]}'],
        "not-json": ["{oops"],
        "no-done": ['{"choices": [{"index": 0, "delta": {"content": "half"}}]}'],
        "error-chunk": ['{"error": {"message": "draining", "code": "server_shutting_down"}}'],
        "bad-usage": ['{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}',
                      '{"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": -3}}', "[DONE]"],
    }

    async def ready(request):
        return JSONResponse({"ok": True})

    async def chat(request):
        model = (await request.json())["model"]

        async def gen():
            for b in bodies[model]:
                yield f"data: {b}\n\n".encode()
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/ready", ready), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize("model,status,code", [
    ("null-choice", 502, "remote_bad_response"), ("string-delta", 502, "remote_bad_response"),
    ("not-json", 502, "remote_bad_response"), ("no-done", 502, "remote_stream_broken"),
    ("error-chunk", 502, "remote_stream_error"), ("bad-usage", 200, None)])
def test_an_endpoint_that_breaks_the_protocol_is_a_typed_error(gateway, model, status, code):
    srv, gw = gateway
    hostile = start_server(_hostile_endpoint())
    try:
        spec = remote(f"hostile-{model}", hostile.url + "/v1", backend={"model": model}).model_dump()
        assert httpx.post(srv.url + "/v1/units", json=spec, timeout=30).status_code == 201
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": f"hostile-{model}", "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == status, r.text
        if status != 200:
            assert r.json()["error"]["code"] == code
        elif code is None:      # counts the endpoint got wrong fall back to what the gateway counted
            assert r.json()["choices"][0]["message"]["content"] == "ok" and r.json()["usage"]["completion_tokens"] == 1
        # streamed: the error is the stream's last event, typed; the breaker counted it
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30, json={
                "model": f"hostile-{model}", "messages": MESSAGES, "max_tokens": 4, "stream": True}) as s:
            text = s.read().decode()
        if code is not None:
            assert f'"code":"{code}"' in text.replace(" ", "") or f'"code": "{code}"' in text
            assert httpx.get(f"{srv.url}/v1/units/hostile-{model}").json()["errors"][code] >= 1
    finally:
        hostile.stop()
