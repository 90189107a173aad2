"""Frames between a front end and an instance: the asyncio side (``FrameProtocol``) over a real socket."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
import uvloop

from sits.runtime.wire import FrameProtocol, encode, send_blocking


async def _connected() -> tuple[FrameProtocol, socket.socket]:
    ours, theirs = socket.socketpair()
    _, conn = await asyncio.get_running_loop().create_unix_connection(FrameProtocol, sock=ours)
    return conn, theirs


LOOPS = pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop],
                                ids=["asyncio", "uvloop"])     # sits serve runs on uvloop


@LOOPS
def test_handshake_frames_queue_then_frames_go_straight_to_on_frame(loop_factory):
    async def main():
        conn, peer = await _connected()
        send_blocking(peer, ("hello", {"pid": 1}))
        send_blocking(peer, ("ready", {"max_model_len": 64}))
        assert await conn.next_frame() == ("hello", {"pid": 1})
        assert await conn.next_frame() == ("ready", {"max_model_len": 64})
        send_blocking(peer, ("stats", 1))          # sent before the receiver took over: not lost
        await asyncio.sleep(0.05)
        got: list[tuple] = []
        conn.attach(got.append, lambda reason: None)
        assert got == [("stats", 1)]
        got.clear()
        # three frames in one send, the last one split across two: each delivered whole, in order
        burst = encode(("events", [1], None)) + encode(("stats", 7)) + encode(("pong", 3))
        peer.sendall(burst[:-3])
        await asyncio.sleep(0.05)
        assert got == [("events", [1], None), ("stats", 7)]
        peer.sendall(burst[-3:])
        await asyncio.sleep(0.05)
        assert got[-1] == ("pong", 3)
        assert conn.write(encode(("ping", 1)))
        peer.setblocking(False)
        await asyncio.sleep(0.05)
        data = peer.recv(1 << 16)
        assert data == encode(("ping", 1))
        peer.close()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


@LOOPS
@pytest.mark.parametrize("corrupt", [False, True])
def test_the_end_of_the_connection_is_told_once_with_a_reason(corrupt, loop_factory):
    async def main():
        conn, peer = await _connected()
        lost: list[str] = []
        conn.attach(lambda msg: None, lost.append)
        if corrupt:        # a length prefix and bytes that are no pickle
            peer.sendall(struct.pack(">I", 3) + b"\xff\xfe\xfd")
        else:
            peer.close()
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert len(lost) == 1
        assert lost[0].startswith("protocol error") if corrupt else lost[0] == "the peer process exited"
        with pytest.raises(asyncio.IncompleteReadError):
            await conn.next_frame()
        with pytest.raises(asyncio.IncompleteReadError):     # and again: the end stays the end
            await conn.next_frame()
        assert conn.write(b"x") is False
        if corrupt:
            peer.close()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


def test_engine_messages_travel_as_msgpack_and_anything_else_pickled():
    import numpy as np

    from sits.bench.wire_bench import _messages
    from sits.engine.messages import (AbortRequest, Embedded, EngineLimits, Fatal, FaultDirectives, Hello, Ping,
                                      Pong, Ready, RequestError, Shutdown)
    from sits.runtime.wire import FrameDecoder, encode

    typed = list(_messages().values()) + [AbortRequest("r"), Ping(4), Pong(4), Shutdown(), Hello(7),
                                          FaultDirectives((1.0, 2.0), 0.5, True), Fatal("c", "m"),
                                          Ready(7, EngineLimits(10, 20, 16, 8), {"phases_ms": {"weights": 1.5}}, True),
                                          RequestError("r", "c", "m", None, 400)]
    other = [("preload", {"model": "m"}), Embedded("e", np.arange(6, dtype=np.float32).reshape(2, 3))]
    stream = b"".join(encode(m) for m in typed + other)
    decoder, got = FrameDecoder(), []
    for i in range(0, len(stream), 7):                 # arbitrary chunking
        got += decoder.feed(stream[i:i + 7])
    assert got[:len(typed)] == typed and all(type(a) is type(b) for a, b in zip(got, typed))
    assert got[len(typed)] == other[0] and np.array_equal(got[-1].vectors, other[1].vectors)
    assert encode(typed[1])[4] != 0 and encode(other[0])[4] == 0       # codec tags: msgpack, pickle


def test_wire_bench_measures_both_codecs(tmp_path):
    from sits.bench import wire_bench
    docs = tmp_path / "benchmarks.md"
    r = wire_bench.run_wire_bench(rounds=1, seconds=0.01, docs_out=str(docs))
    assert r["codecs"] == ["pickle", "msgspec"]
    assert all(r["median_us"][c][m] > 0 for c in r["codecs"] for m in r["messages"])
    assert docs.read_text().count(wire_bench.DOC_BEGIN) == 1
