"""Frames between a front end and an instance process over a Unix socket.

A frame is a 4-byte big-endian length and a pickled tuple ``(kind, *fields)``. Pickle is safe here
because both ends are SITS processes of the same user and the socket lives in a 0700 directory;
it is also the fastest codec for the slotted dataclasses (TokenEvent, EngineStats) that cross it.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

_LEN = struct.Struct(">I")
MAX_FRAME = 256 << 20


def encode(msg: tuple) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


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
            out.append(pickle.loads(bytes(self._buf[4:4 + n])))
            del self._buf[:4 + n]
        return out


def send_blocking(sock: socket.socket, msg: tuple) -> None:
    sock.sendall(encode(msg))


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    """The next message; raises asyncio.IncompleteReadError at EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return pickle.loads(await reader.readexactly(n))
