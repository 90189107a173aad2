"""Concurrency and connection life: 64 streams at once, disconnects free KV blocks, shutdown drains."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from sits.api.context import ServerSettings


# a request that outlasts any timeout below on a fast host too: the tiny model's whole context
LONG = dict(max_model_len=2048)
LONG_TOKENS = 2000


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(kv_cache_memory_mb=64, **LONG)


def _backend(srv):
    return srv.app.state.sits.registry.get("tiny")


def _wait_idle(srv, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        s = _backend(srv).stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


def test_64_concurrent_streams_complete_without_error(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i: int):
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"stream number {i}"}], max_tokens=16,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            text, usage = [], None
            async for ch in stream:
                if ch.choices:
                    text.append(ch.choices[0].delta.content or "")
                if ch.usage:
                    usage = ch.usage
            return "".join(text), usage

        results = await asyncio.gather(*[one(i) for i in range(64)])
        await client.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(u is not None and u.completion_tokens == 16 for _, u in results)
    assert all(text for text, _ in results)
    _wait_idle(server)


def test_a_disconnecting_client_frees_its_blocks(server):
    _wait_idle(server)
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "a long one", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = 0
        for ln in lines:
            if ln.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        # an instance's stats follow its events at most every 50 ms: wait for the first that shows it
        deadline = time.monotonic() + 2.0
        while (s := _backend(server).stats()).num_running != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.num_running == 1 and s.kv_usage > 0
    # the connection is closed: the engine request is aborted and its blocks are free again
    t0 = time.monotonic()
    _wait_idle(server, timeout=5)
    assert time.monotonic() - t0 < 5
    text = httpx.get(server.url + "/metrics").text
    assert 'sits:request_success_total{finished_reason="abort",model_name="tiny"}' in text


def test_non_streaming_client_that_leaves_frees_its_blocks(server):
    _wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={"model": "tiny", "prompt": "wait for me", "max_tokens": LONG_TOKENS, "ignore_eos": True})
    _wait_idle(server, timeout=5)


def test_shutdown_tells_streams_why_they_end(serve_tiny):
    srv = serve_tiny(ServerSettings(drain_grace_s=0.3), **LONG)
    events: list[str] = []
    going = threading.Event()          # two chunks delivered: the stream is really under way
    failed: list[BaseException] = []

    def reader():
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "never ending", "max_tokens": LONG_TOKENS,
                                    "stream": True, "ignore_eos": True}) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[6:])
                        if len(events) == 2:
                            going.set()
        except BaseException as e:     # noqa: BLE001 -- reported by the test thread
            failed.append(e)
        finally:
            going.set()                # an early end must not leave the test waiting

    t = threading.Thread(target=reader)
    t.start()
    assert going.wait(60)
    assert not failed and len(events) >= 2, (failed, events)
    srv.stop()                         # drains: 0.3 s of grace, then the stream is cut short
    t.join(30)
    assert not t.is_alive() and not failed, failed
    *chunks, err, done = events
    assert done == "[DONE]"
    assert json.loads(err)["error"]["code"] == "server_shutting_down"
    assert len(chunks) >= 2 and all("text" in json.loads(c)["choices"][0] for c in chunks), chunks


def test_a_dead_instance_ends_its_streams_with_a_reason(serve_tiny):
    """SIGKILL the engine process mid-stream: the stream ends with an error chunk; the server does not
    stay in front of a dead engine (it is restarted, and serves again)."""
    import os
    import signal
    srv = serve_tiny(ServerSettings(drain_grace_s=0.3), **LONG)
    backend = _backend(srv)
    events: list[str] = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "doomed", "max_tokens": 240, "stream": True,
                            "ignore_eos": True}) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                events.append(ln[6:])
                if len(events) == 3:
                    os.kill(backend.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    deadline = time.monotonic() + 60
    while not (backend.restarts and backend.ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_instance_ignores_a_terminal_ctrl_c(serve_tiny):
    """SIGINT reaches the whole process group on Ctrl-C; the engine must outlive it so the server can drain."""
    import os
    import signal
    srv = serve_tiny(ServerSettings(drain_grace_s=0.3), **LONG)
    backend = _backend(srv)
    os.kill(backend.pid, signal.SIGINT)
    time.sleep(0.3)
    assert backend.proc.poll() is None
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_the_instance_runs_behind_its_front_end(server):
    """The engine process steps back (nice) so the front end's short, per-token work gets a core first."""
    import os
    from sits.runtime.instance_worker import DEFAULT_NICE
    backend = _backend(server)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, backend.pid) == min(19, mine + DEFAULT_NICE)


def test_the_response_head_leaves_with_the_first_chunk():
    """uvicorn writes a head and its first body bytes separately; the server's protocol joins them
    (one write, so the client wakes once), and a head written alone still leaves within the turn."""
    from sits.api.http_protocol import _HeadWithBody

    class Transport:
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, data):
            self.writes.append(data)

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

        def get_extra_info(self, name):
            return ("127.0.0.1", 1) if name == "peername" else None

    async def run():
        loop = asyncio.get_running_loop()
        t = Transport()
        w = _HeadWithBody(t, loop)
        w.write(b"HEAD")
        w.write(b"chunk-1")
        w.write(b"chunk-2")
        assert t.writes == [b"HEADchunk-1", b"chunk-2"]
        await asyncio.sleep(0)
        assert t.writes == [b"HEADchunk-1", b"chunk-2"]        # nothing held, nothing written twice
        t2 = Transport()
        w2 = _HeadWithBody(t2, loop)
        w2.write(b"HEAD")
        assert t2.writes == []
        await asyncio.sleep(0)                                  # the end of the turn flushes it
        assert t2.writes == [b"HEAD"]
        t3 = Transport()
        w3 = _HeadWithBody(t3, loop)
        w3.write(b"HEAD")
        w3.close()                                              # closing never drops a held head
        assert t3.writes == [b"HEAD"] and t3.closed
        assert w3.get_extra_info("peername") == ("127.0.0.1", 1)
    asyncio.run(run())
