"""Frames between a front end and an instance process (or the zygote) over a Unix socket.

A frame is a 4-byte big-endian length, a 1-byte codec tag and the body. The engine's messages
(``sits.engine.messages``: a request per request, a ``StepOutput`` per step) are MessagePack by
msgspec with a typed decoder per message type, as in vLLM: 3 to 6 times faster than pickle for
them (``sits bench wire``). Anything else (the zygote's control tuples, embeddings' arrays) is
pickled; that is safe here because both ends are SITS processes of the same user: a Unix socket
lives in a 0700 directory, and an instance on another Ray node listens on TCP but reads no frame
before its peer has sent the instance's one-time token (``instance_worker.serve_instance``).
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

import msgspec

from sits.engine.messages import (AbortRequest, EngineRequest, EngineStats, Fatal, FaultDirectives, Hello, Ping,
                                  Pong, Ready, RequestError, Shutdown, StepOutput)

_LEN = struct.Struct(">I")
MAX_FRAME = 256 << 20
_PICKLE = 0
# tag -> type for msgspec; the order is the wire format (append only)
_TYPED = (EngineRequest, StepOutput, AbortRequest, EngineStats, RequestError, Ping, Pong, FaultDirectives,
          Shutdown, Hello, Ready, Fatal)
_TAG = {t: i + 1 for i, t in enumerate(_TYPED)}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {i + 1: msgspec.msgpack.Decoder(t) for i, t in enumerate(_TYPED)}


def encode(msg: object) -> bytes:
    tag = _TAG.get(type(msg), _PICKLE)
    body = _ENCODER.encode(msg) if tag else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body) + 1) + bytes((tag,)) + body


def decode(frame: bytes | memoryview) -> object:
    """One frame's body (after the length) back into its message."""
    tag, body = frame[0], frame[1:]
    return _DECODERS[tag].decode(body) if tag else pickle.loads(body)


class FrameDecoder:
    """Incremental decoding of a byte stream into messages (for the blocking side)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(self._buf) < 4 + n:
                break
            out.append(decode(bytes(self._buf[4:4 + n])))
            del self._buf[:4 + n]
        return out


class FrameProtocol(asyncio.Protocol):
    """The asyncio side: frames handed on from ``data_received`` itself.

    Until ``attach(on_frame, on_lost)``, frames queue for ``next_frame`` (the start-up handshake).
    After, each frame goes straight to ``on_frame``: no reader task to wake between the socket and
    whoever waits for the frame. ``on_lost(reason)`` is told once when the connection ends (EOF, an
    error, or a frame that does not decode), also when it ended before ``attach``.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.on_frame = None
        self.on_lost = None
        self.lost: str | None = None
        self._decoder = FrameDecoder()
        self._early: asyncio.Queue = asyncio.Queue()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for msg in self._decoder.feed(data):
                if self.on_frame is None:
                    self._early.put_nowait(msg)
                else:
                    self.on_frame(msg)
        except Exception as e:  # noqa: BLE001 - a protocol bug: the connection is unusable
            self._lose(f"protocol error: {e!r}")
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose("the peer process exited" if exc is None else repr(exc))

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self._early.put_nowait(None)
            if self.on_lost is not None:
                self.on_lost(reason)

    def attach(self, on_frame, on_lost) -> None:
        """From now on hand every frame to ``on_frame`` (first any queued since the handshake) and the
        connection's end to ``on_lost``."""
        while not self._early.empty():
            msg = self._early.get_nowait()
            if msg is None:           # the end marker stays for next_frame
                self._early.put_nowait(None)
                break
            on_frame(msg)
        self.on_frame, self.on_lost = on_frame, on_lost
        if self.lost is not None:
            on_lost(self.lost)

    async def next_frame(self) -> tuple:
        """The next frame before ``attach``; raises asyncio.IncompleteReadError at EOF."""
        msg = await self._early.get()
        if msg is None:
            self._early.put_nowait(None)
            raise asyncio.IncompleteReadError(b"", None)
        return msg

    def write(self, data: bytes) -> bool:
        """Send ``data``; False when the connection is already closing or gone."""
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True


def send_blocking(sock: socket.socket, msg: object) -> None:
    sock.sendall(encode(msg))


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    """The next message; raises asyncio.IncompleteReadError at EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return decode(await reader.readexactly(n))
