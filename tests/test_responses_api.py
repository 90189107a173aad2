"""The Responses API (``POST /v1/responses``) through the real ``openai`` client: the same conversation
means the same prompt as in chat, typed output items and streamed events, tools, JSON answers,
stored responses continued by ``previous_response_id``, and typed errors for what is not served."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(engine_mode="thread")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_answers_as_chat_does(client):
    r = client.responses.create(model="tiny", input="Tell me a story", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_input_items_read_as_chat_messages(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"},
                                                             {"type": "input_text", "text": "second"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "first\nsecond"}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "again"}], 6)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content


def test_streamed_events_are_typed_and_ordered(client):
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=10,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text
    plain = client.responses.create(model="tiny", input="Hello there", max_output_tokens=10, temperature=0)
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    # the SDK's stream helper accumulates the events into its own snapshot (and checks their order)
    with client.responses.stream(model="tiny", input="Hello there", max_output_tokens=10, temperature=0) as s:
        last = list(s)[-1]
    assert last.type == final_type(plain) and last.response.output_text == plain.output_text


def final_type(response) -> str:
    return "response.completed" if response.status == "completed" else "response.incomplete"


TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                       "additionalProperties": False}}


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                max_output_tokens=40, temperature=0, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id and call.id.startswith("fc_")
    # streamed: the same call, with its arguments events
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL],
                                          tool_choice="required", max_output_tokens=40, temperature=0,
                                          parallel_tool_calls=False, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments and done[0].name == "get_weather"
    assert events[-1].type == "response.completed"
    # the client runs the function and sends its output back, by items
    follow = client.responses.create(model="tiny", max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    chat = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_previous_response_id_continues_a_stored_response(client, server):
    first = client.responses.create(model="tiny", input="My name is Ada.", instructions="Be kind.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], 6)   # instructions not carried over
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "hi", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_json_schema_answers_and_logprobs(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A number", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["n"], int)
    lp = client.responses.create(model="tiny", input="Hi", max_output_tokens=5, temperature=0, top_logprobs=2,
                                 include=["message.output_text.logprobs"])
    logprobs = lp.output[0].content[0].logprobs
    assert len(logprobs) == lp.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in logprobs)


@pytest.mark.parametrize("body, param, code", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_parameter"),
    ({"input": []}, "input", "empty_prompt"),
    ({"input": "hi", "background": True}, "background", "unsupported_parameter"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include", "unsupported_parameter"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "invalid_parameter"),
    ({"input": "hi " * 300}, "input", "context_length_exceeded"),
    ({"input": "hi", "max_output_tokens": 500}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format", "invalid_parameter"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "invalid_parameter"),
])
def test_what_is_not_served_is_a_typed_400(server, body, param, code):
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param


def test_a_lone_surrogate_in_input_is_invalid_text(server):
    r = httpx.post(server.url + "/v1/responses", timeout=30, headers={"content-type": "application/json"},
                   content=b'{"model": "tiny", "input": "bad \\ud800 text"}')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text"
    assert r.json()["error"]["param"] == "input"


def test_strict_types_and_unknown_models(server):
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "hi", "max_output_tokens": "5"})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
