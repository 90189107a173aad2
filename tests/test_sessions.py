"""Sessions: one contract suite run against both stores (SQLite, and a real redis-server), then
X-Session-ID through both HTTP dialects with the official openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from sits.api.context import ServerSettings
from sits.memory.sessions import RedisSessionStore, SqliteSessionStore, open_session_store, with_history


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request, tmp_path):
    made = []

    def make(**kw):
        if request.param == "sqlite":
            s = SqliteSessionStore(tmp_path / f"s{len(made)}.db", **kw)
        else:
            s = RedisSessionStore(request.getfixturevalue("redis_url"), **kw)
        made.append(s)
        return s
    yield make


def run(coro):
    return asyncio.run(coro)


def test_store_contract(store_factory):
    async def go():
        store = store_factory()
        sid = f"sess-{time.monotonic_ns()}"
        assert await store.get(sid) is None
        s = await store.append(sid, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                               unit="chat", instance="chat-1")
        assert s.turns == 1 and s.unit == "chat" and s.instance == "chat-1"
        s = await store.append(sid, [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}],
                               unit="chat", memory_refs=["notes"])
        got = await store.get(sid)
        assert got.to_dict() == s.to_dict()
        assert [m["content"] for m in got.messages] == ["hi", "hello", "more", "ok"]
        assert got.instance == "chat-1" and got.memory_refs == ["notes"] and got.turns == 2
        assert await store.delete(sid) is True and await store.get(sid) is None
        assert await store.delete(sid) is False
        await store.close()
    run(go())


def test_concurrent_appends_lose_nothing(store_factory):
    async def go():
        store = store_factory()
        sid = f"busy-{time.monotonic_ns()}"
        await asyncio.gather(*(store.append(sid, [{"role": "user", "content": str(i)},
                                                  {"role": "assistant", "content": f"a{i}"}]) for i in range(20)))
        s = await store.get(sid)
        assert s.turns == 20 and len(s.messages) == 40
        assert sorted(int(m["content"]) for m in s.messages if m["role"] == "user") == list(range(20))
        await store.close()
    run(go())


def test_expiry_and_trimming(store_factory):
    async def go():
        store = store_factory(ttl_s=1, max_messages=4)
        sid = f"short-{time.monotonic_ns()}"
        for i in range(3):
            await store.append(sid, [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}])
        s = await store.get(sid)
        assert [m["content"] for m in s.messages] == ["u1", "a1", "u2", "a2"]      # oldest turns dropped
        await asyncio.sleep(2.1)
        assert await store.get(sid) is None
        await store.close()
    run(go())


def test_history_is_prepended_unless_the_client_sent_it():
    h = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    new = [{"role": "user", "content": "c"}]
    assert with_history(h, new) == (h + new, new)
    assert with_history(h, h + new) == (h + new, new)
    assert with_history([], new) == (new, new)


def test_store_specs(tmp_path):
    assert open_session_store(None, None) is None
    assert open_session_store("none", tmp_path) is None
    assert open_session_store(None, tmp_path).describe() == f"sqlite:{tmp_path / 'sessions.db'}"
    assert open_session_store(f"sqlite:///{tmp_path}/x.db", None).describe() == f"sqlite:{tmp_path}/x.db"
    with pytest.raises(ValueError):
        open_session_store("mongodb://x", None)


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "redis"])
def session_server(request, serve_tiny, tmp_path):
    spec = None if request.param == "sqlite" else request.getfixturevalue("redis_url")
    return serve_tiny(ServerSettings(drain_grace_s=0.5, data_dir=str(tmp_path), session_store=spec),
                      engine_mode="thread")


def test_x_session_id_keeps_the_conversation(session_server):
    url = session_server.url
    sid = f"conv-{time.monotonic_ns()}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    first = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "My name is Ada."}], max_tokens=4, temperature=0,
        extra_headers={"X-Session-ID": sid})
    assert first.headers["x-session-id"] == sid
    first = first.parse()
    answer1 = first.choices[0].message.content
    # the next turn alone: the server runs it after the stored conversation
    alone = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "And yours?"}],
                                           max_tokens=4, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "And yours?"}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-ID": sid}))
    with_session = chunks[-1].usage.prompt_tokens
    full = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": answer1},
            {"role": "user", "content": "And yours?"}]
    explicit = client.chat.completions.create(model="tiny", messages=full, max_tokens=4, temperature=0)
    assert with_session == explicit.usage.prompt_tokens > alone.usage.prompt_tokens
    answer2 = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    s = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert [m["content"] for m in s["messages"]] == ["My name is Ada.", answer1, "And yours?", answer2]
    assert s["turns"] == 2 and s["unit"] == "tiny"
    # a client that resends the whole history (as OpenAI clients do) is not doubled
    again = client.chat.completions.create(model="tiny", messages=full + [{"role": "assistant", "content": answer2},
                                                                          {"role": "user", "content": "Bye"}],
                                           max_tokens=2, temperature=0, extra_headers={"X-Session-ID": sid})
    assert again.choices[0].finish_reason in ("length", "stop")
    assert len(httpx.get(f"{url}/v1/sessions/{sid}").json()["messages"]) == 6
    assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"] is True
    r = httpx.get(f"{url}/v1/sessions/{sid}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_sits_requests_join_the_session(session_server):
    url = session_server.url
    sid = f"async-{time.monotonic_ns()}"
    for prompt in ("first question", "second question"):
        v = httpx.post(url + "/v1/requests", json={"prompt": prompt, "constraints": {"max_tokens": 3}},
                       headers={"X-Session-ID": sid}).json()
        deadline = time.monotonic() + 30
        while v["state"] not in ("RESOLVED", "REJECTED"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
            v = httpx.get(f"{url}/v1/requests/{v['id']}").json()
        assert v["state"] == "RESOLVED", v
    s = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert [m["role"] for m in s["messages"]] == ["user", "assistant", "user", "assistant"]
    assert s["messages"][2]["content"] == "second question" and s["turns"] == 2


def test_sessions_off_without_a_store(serve_tiny):
    srv = serve_tiny(ServerSettings(drain_grace_s=0.5), engine_mode="thread")
    r = httpx.get(srv.url + "/v1/sessions/x")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sessions_disabled"
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "x"}]},
                   headers={"X-Session-ID": "abc"})
    assert r.status_code == 200 and "x-session-id" not in r.headers


def test_a_trimmed_session_still_recognises_a_resent_history():
    from sits.memory.sessions import Session
    s = Session("t")
    u = lambda c: {"role": "user", "content": c}      # noqa: E731
    a = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    sent = [{"role": "system", "content": "be brief"}]
    for i in range(4):                                  # the client always resends everything
        sent = sent + [u(f"q{i}")]
        full, new = with_history(s.messages, sent)
        assert full == sent                             # never doubled, even once the store trimmed
        s.apply(new + [a(f"a{i}")], unit=None, instance=None, memory_refs=None, max_messages=5)
        sent = sent + [a(f"a{i}")]
    assert s.messages[0]["role"] == "system" and len(s.messages) == 5     # the system prompt is kept
