"""Tool calling and structured output: grammar-constrained decoding in the engine, the Hermes
tool-call format read back (malformed calls reported, never raised), OpenAI ``tools`` /
``tool_choice`` / ``response_format`` through the official client, and the runtime's own tool loop
for ``allowed_tools`` (events, spans, sandboxed results back to the model)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.engine.errors import InvalidRequestError
from sits.engine.guided import json_schema_grammar, vocabulary_for
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer
from sits.engine.tool_format import ToolSpec, parse_tool_calls, prose_grammar, tool_call_grammar
from sits.observe import genai
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import wait_for

TEST_TOOLS = Path(__file__).parent / "tools"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
SPECS = [ToolSpec("get_weather", "Weather for a city", WEATHER), ToolSpec("add", "Add two integers", ADD)]
OPENAI_TOOLS = [s.openai() for s in SPECS]
REPORT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["id"]}},
    "required": ["title", "ok", "tags", "score", "owner"]}


def _chat_prompt(engine, tools=SPECS, question: str = "What is the weather in Oslo?") -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools)
    return engine.tokenizer.encode(text)


# -- the engine ---------------------------------------------------------------------------------
def test_json_schema_output_always_parses_and_validates(make_engine):
    eng = make_engine()
    g = json_schema_grammar(REPORT)
    params = [SamplingParams(max_tokens=120, temperature=0, grammar=g)] + [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g) for s in range(6)]
    for out in eng.generate(["Write a report:"] * len(params), params):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), REPORT)
    assert eng.stats().num_free_blocks == eng.stats().num_kv_blocks


def test_a_guided_neighbour_leaves_free_rows_unchanged(make_engine):
    eng = make_engine()
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = eng.generate(["The quick brown fox"], free)[0]["token_ids"]
    both = eng.generate(["The quick brown fox", "Write a report:"],
                        [free, SamplingParams(max_tokens=60, temperature=0, grammar=json_schema_grammar(REPORT))])
    assert both[0]["token_ids"] == alone
    json.loads(both[1]["text"])


def test_guided_output_is_the_same_under_preemption(make_engine):
    g = tool_call_grammar(SPECS, "required")
    roomy = make_engine(enable_prefix_caching=False)
    prompts = [_chat_prompt(roomy, question=f"Weather in city number {i}?") for i in range(4)]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, grammar=g) for s in range(4)]
    ref = roomy.generate(prompts, params)
    # two prompts fit, their outputs do not: the second is preempted and recomputed
    tight = make_engine(num_kv_blocks=2 * -(-len(prompts[0]) // 8) + 4, block_size=8, enable_prefix_caching=False)
    tight.scheduler.model.output_len = 1.0
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]


def test_a_resumed_stream_continues_under_its_grammar(make_engine):
    """What failover does: the tokens already sent join the prompt and replay into the grammar."""
    eng = make_engine()
    g = tool_call_grammar(SPECS, "required")
    prompt = _chat_prompt(eng)
    full = eng.generate([prompt], SamplingParams(max_tokens=60, temperature=0, grammar=g))[0]
    k = len(full["token_ids"]) // 2
    sent = full["token_ids"][:k]
    rest = eng.generate([prompt + sent], SamplingParams(max_tokens=60 - k, temperature=0, grammar=g,
                                                        grammar_prefix=sent))[0]
    assert sent + rest["token_ids"] == full["token_ids"]


def test_auto_allows_prose_then_calls_and_the_prose_grammar_no_call(make_engine):
    eng = make_engine()
    vocab = vocabulary_for(eng.tokenizer, eng.model_config.vocab_size)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

    def accepts(grammar: str, text: str) -> bool:
        guide = vocab.guide(grammar)
        for tok in eng.tokenizer.encode(text):
            if not guide.allowed()[tok]:
                return False
            guide.accept(tok)
        return bool(guide.allowed()[eng.tokenizer.eos_token_ids[0]])      # and it may end there

    auto = tool_call_grammar(SPECS, "auto")
    for text in (call, f"Sure.\n{call}", f"Let me add.\n{call}\n{call}", "just prose, <tool_ no call"):
        assert accepts(auto, text), text
    assert not accepts(auto, f"Sure.\n{call}\n</tool_call>")
    assert accepts(prose_grammar(), "plain text < tool_call >") and not accepts(prose_grammar(), f"x {call}")


def test_a_grammar_that_cannot_compile_is_a_typed_error(make_engine):
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("x", SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: nope"}]}'))
    assert e.value.code == "invalid_grammar"


# -- the Hermes format --------------------------------------------------------------------------
def test_calls_are_read_and_malformed_ones_reported():
    ok = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    text = (f"Let me check.\n<tool_call>\n{ok}\n</tool_call>\n<tool_call>\n{{not json}}\n</tool_call>\n"
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": "one"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')
    parsed = parse_tool_calls(text, SPECS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]
    assert [e["code"] for e in parsed.errors] == ["invalid_tool_call_json", "unknown_tool", "invalid_tool_arguments",
                                                 "incomplete_tool_call"]
    assert parsed.content.startswith("Let me check.") and "{not json}" in parsed.content
    assert json.loads(parsed.calls[0].openai()["function"]["arguments"]) == {"a": 1, "b": 2}
    assert parse_tool_calls("no calls here", SPECS).calls == []


def test_a_template_without_tools_gets_them_in_the_hermes_format(tiny_model_dir, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"}))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"}], tools=SPECS)
    assert text.startswith("[system] Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in text and '"name": "add"' in text
    assert '[assistant] <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>' in text
    assert "[user] <tool_response>\n4\n</tool_response>" in text


# -- the OpenAI dialect -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(serve_tiny):
    srv = serve_tiny(engine_mode="thread", max_model_len=1024, kv_cache_memory_mb=48)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _schema_of(name: str) -> dict:
    return {"get_weather": WEATHER, "add": ADD}[name]


def test_required_tool_choice_returns_calls_that_match_their_schemas(client):
    for seed in (None, 1, 2):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=OPENAI_TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80,
                                           **({"seed": seed} if seed is not None else {"temperature": 0}))
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


def test_a_named_function_is_called_once_and_streaming_agrees(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=OPENAI_TOOLS, max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "add"}})
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"] and r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, "add", calls[0].function.arguments)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_the_client_side_loop_with_the_openai_client(client):
    """model -> call -> the client runs it -> result back -> the model answers."""
    messages = list(MESSAGES)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, seed=7)
    msg = r.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    final = client.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=12, seed=3)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_format_json_schema_and_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, seed=4, response_format={
        "type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), REPORT)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_call_cut_off_by_max_tokens_is_reported_not_raised(client):
    r = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, tools=OPENAI_TOOLS, tool_choice="required", max_tokens=6, temperature=0)
    body = r.http_response.json()
    ch = body["choices"][0]
    assert ch["finish_reason"] == "length" and not ch["message"].get("tool_calls")
    assert ch["tool_call_errors"][0]["code"] == "incomplete_tool_call"
    assert ch["message"]["content"].startswith("<tool_call>")


@pytest.mark.parametrize("extra,param,code", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "invalid_parameter"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "invalid_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters", "invalid_schema"),
    ({"tools": OPENAI_TOOLS * 2}, "tools[2]", "invalid_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "invalid_parameter"),
    ({"tools": None, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "invalid_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, None, None),
])
def test_bad_tool_requests_are_400s(client, extra, param, code):
    body = {"model": "tiny", "messages": MESSAGES, "tools": OPENAI_TOOLS, "max_tokens": 4, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(str(client.base_url) + "chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if code is not None:
        assert (err["param"], err["code"]) == (param, code), err


@pytest.mark.parametrize("message", [
    {"role": "tool", "tool_call_id": "c1"},                                   # no content
    {"role": "tool", "tool_call_id": "never-called", "content": "4"},         # answers no call
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    {"role": "assistant", "tool_calls": "add"},
])
def test_malformed_tool_turns_are_400s(client, message):
    r = httpx.post(str(client.base_url) + "chat/completions", timeout=30,
                   json={"model": "tiny", "messages": MESSAGES + [message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


# -- the runtime's tool loop (SITS dialect) -----------------------------------------------------
@pytest.fixture(scope="module")
def tool_gateway(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("tool-gw")
    gw = Gateway(data, tick_s=0.2)
    spec = UnitSpec.model_validate({
        "name": "calc", "model": tiny_model_dir, "tools": ["test.sum@^1", "math.eval@^1"],
        "scale": {"min_instances": 0, "max_instances": 1, "keep_alive_s": 300},
        "resources": {"device": "cpu", "kv_cache_mb": 32, "max_model_len": 1024, "warmup": False, "threads": 1}})
    app = build_gateway_app(gw, [spec], ServerSettings(drain_grace_s=0.5, tool_dirs=[str(TEST_TOOLS)],
                                                       trace_exporter="memory", trace_level_rates={"L3": 1.0}))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    yield srv
    srv.stop()


def _follow(srv, body) -> tuple[dict, list[tuple[str, dict]]]:
    rid = httpx.post(srv.url + "/v1/requests", json={"unit": "calc", **body}, timeout=30).json()["id"]
    view = wait_for(lambda: (v := httpx.get(f"{srv.url}/v1/requests/{rid}").json())["state"]
                    in ("RESOLVED", "REJECTED") and v, timeout=180, what=f"request {rid}")
    events, kind = [], None
    for line in httpx.get(f"{srv.url}/v1/requests/{rid}/events", timeout=30).text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:])))
    return view, events


def test_the_runtime_runs_the_tool_and_gives_the_result_back(tool_gateway):
    view, events = _follow(tool_gateway, {"prompt": "What is 2+3?", "allowed_tools": ["test.sum@^1"],
                                          "tool_choice": "test.sum", "constraints": {"max_tokens": 64}, "seed": 1})
    assert view["state"] == "RESOLVED", view
    step = view["tool_steps"][0]
    assert step["calls"], json.dumps(view["tool_steps"])
    call = step["calls"][0]
    expression = json.loads(call["function"]["arguments"])["expression"]
    assert call["function"]["name"] == "test_sum" and expression in ("2+3", "40+2", "7*6")
    assert call["result"]["output"].strip() == str(eval(expression))        # the sandbox ran math_eval.wat
    kinds = [k for k, _ in events]
    assert kinds.index("tool_call") < kinds.index("tool_result") < len(kinds) - 1
    result = next(d for k, d in events if k == "tool_result")
    assert result["ok"] and result["tool"] == "test.sum@1.0.0" and result["id"] == call["id"]
    assert events[-1][1]["state"] == "RESOLVED" and events[-1][1]["payload"]["tool_steps"][0]["calls"][0]["id"] == call["id"]
    # the answer is the last step's text; the usage counts every step
    answer = "".join(d["text"] for k, d in events if k == "delta" and d.get("step") == len(view["tool_steps"]))
    assert view["output"] == answer
    assert view["usage"]["completion_tokens"] >= sum(1 for k, _ in events if k == "delta")    # every step
    spans = [s for s in tool_gateway.app.state.sits.tracing.finished_spans()
             if s.attributes.get(genai.TOOL_CALL_ID) == call["id"]]
    assert [s.name for s in spans] == ["execute_tool test.sum"]
    assert spans[0].attributes[genai.OPERATION] == "execute_tool"


def test_a_failing_tool_goes_back_to_the_model_and_the_step_limit_holds(tool_gateway):
    view, events = _follow(tool_gateway, {"prompt": "Compute something", "allowed_tools": ["math.eval@^1", "test.sum@^1"],
                                          "tool_choice": "required", "max_tool_steps": 1,
                                          "constraints": {"max_tokens": 64}, "seed": 11})
    assert view["state"] == "RESOLVED", view
    assert len(view["tool_steps"]) <= 1
    results = [d for k, d in events if k == "tool_result"]
    assert results and all(("output" in r) == r["ok"] for r in results)
    for r in results:
        if not r["ok"]:
            assert r["error"]["code"] in ("tool_failed", "invalid_tool_arguments", "tool_trap")


@pytest.mark.parametrize("body,code", [
    ({"allowed_tools": ["test.sum@^1"], "tool_choice": "math.eval"}, "tool_not_allowed"),
    ({"allowed_tools": ["file.read@^1"]}, "tool_not_allowed"),
])
def test_tools_outside_the_grant_are_rejected_while_validating(tool_gateway, body, code):
    view, _ = _follow(tool_gateway, {"prompt": "x", "constraints": {"max_tokens": 2}, **body})
    assert view["state"] == "REJECTED" and view["error"]["code"] == code
    assert [t["state"] for t in view["transitions"]] == ["PENDING", "VALIDATING", "REJECTED"]
