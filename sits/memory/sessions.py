"""Conversation sessions behind ``X-Session-ID``: the messages so far, the unit and the instance.

A client may send only its new turn with ``X-Session-ID`` and the server puts the stored
conversation in front of it; a client that sends the whole history (as OpenAI clients do) is
recognised (its messages start with the stored ones) and nothing is doubled. After a response,
the new turns and the assistant's answer are appended atomically, so two requests of one session
in flight at once lose neither's turns.

Two stores with one contract (and one test suite): ``SqliteSessionStore`` (the embedded default,
in the data directory; one transaction per append) and ``RedisSessionStore`` (``redis://...``,
redis-py asyncio; WATCH/MULTI per append; Redis expires idle sessions itself).
"""

from __future__ import annotations

import abc
import asyncio
import json
import re
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_MAX_MESSAGES = 512       # the oldest turns are dropped beyond this (a session is not an archive)
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
INVALID_SESSION_ID = ("X-Session-ID must be 1 to 128 characters of [A-Za-z0-9._:-], and not '.' or '..', "
                      "so that /v1/sessions/{id} can name it")


def valid_session_id(sid: str) -> bool:
    """Whether ``sid`` is one URL path segment that comes back unchanged: no '/', '%', '?', '#' or
    spaces, and not a dot segment (clients resolve those away before sending)."""
    return _SESSION_ID.fullmatch(sid) is not None and sid not in (".", "..")


@dataclass
class Session:
    id: str
    messages: list[dict] = field(default_factory=list)     # {"role", "content"[, "name"]}
    unit: str | None = None
    instance: str | None = None                            # where it ran last (affinity)
    memory_refs: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    turns: int = 0                                         # responses appended

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Session":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def apply(self, new_messages: list[dict], *, unit: str | None, instance: str | None,
              memory_refs: list[str] | None, max_messages: int) -> None:
        self.messages.extend(new_messages)
        if len(self.messages) > max_messages:       # the oldest turns go; a leading system prompt stays
            keep = 1 if self.messages and self.messages[0].get("role") == "system" else 0
            del self.messages[keep:keep + len(self.messages) - max_messages]
        self.unit = unit or self.unit
        self.instance = instance or self.instance
        for ref in memory_refs or []:
            if ref not in self.memory_refs:
                self.memory_refs.append(ref)
        self.updated_at = time.time()
        self.turns += 1


def with_history(history: list[dict], messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the conversation to run, the new messages it adds to the session).

    A client that resends its history (as OpenAI clients do) is recognised wherever the stored
    history sits in what it sent (the store may have trimmed older turns the client still sends);
    otherwise the stored history goes in front of the new turns."""
    runs = [history]
    if len(history) > 1 and history[0].get("role") == "system" and messages[:1] == history[:1]:
        runs.append(history[1:])         # trimming keeps the system prompt and drops the turns after it
    for run in runs:
        n = len(run)
        for j in range(len(messages) - n, -1, -1) if n else ():   # the latest place it fits
            if messages[j:j + n] == run:
                return messages, messages[j + n:]
    return history + messages, messages


class SessionStore(abc.ABC):
    kind = ""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_messages: int = DEFAULT_MAX_MESSAGES):
        self.ttl_s = ttl_s
        self.max_messages = max_messages

    @abc.abstractmethod
    async def get(self, session_id: str) -> Session | None:
        """The session, or None if there is none (or it expired)."""

    @abc.abstractmethod
    async def append(self, session_id: str, messages: list[dict], *, unit: str | None = None,
                     instance: str | None = None, memory_refs: list[str] | None = None) -> Session:
        """Add turns to the session (created if new), atomically; returns it as stored."""

    @abc.abstractmethod
    async def delete(self, session_id: str) -> bool: ...

    async def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.kind


class SqliteSessionStore(SessionStore):
    kind = "sqlite"

    def __init__(self, path: str | Path, **kw):
        super().__init__(**kw)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, data TEXT NOT NULL, "
                         "updated_at REAL NOT NULL)")
        self._lock = threading.Lock()      # one connection, used from worker threads one at a time

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def _get(self, sid: str) -> Session | None:
        row = self._db.execute("SELECT data, updated_at FROM sessions WHERE id = ?", (sid,)).fetchone()
        if row is None:
            return None
        if time.time() - row[1] > self.ttl_s:
            self._db.execute("DELETE FROM sessions WHERE id = ?", (sid,))
            return None
        return Session.from_dict(json.loads(row[0]))

    async def get(self, session_id: str) -> Session | None:
        def run():
            with self._lock:
                return self._get(session_id)
        return await asyncio.to_thread(run)

    async def append(self, session_id, messages, *, unit=None, instance=None, memory_refs=None) -> Session:
        def run():
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    s = self._get(session_id) or Session(session_id)
                    s.apply(messages, unit=unit, instance=instance, memory_refs=memory_refs,
                            max_messages=self.max_messages)
                    self._db.execute("INSERT OR REPLACE INTO sessions (id, data, updated_at) VALUES (?, ?, ?)",
                                     (session_id, json.dumps(s.to_dict()), s.updated_at))
                    self._db.execute("DELETE FROM sessions WHERE updated_at < ?", (time.time() - self.ttl_s,))
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                return s
        return await asyncio.to_thread(run)

    async def delete(self, session_id: str) -> bool:
        def run():
            with self._lock:
                return self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount > 0
        return await asyncio.to_thread(run)

    async def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisSessionStore(SessionStore):
    kind = "redis"
    PREFIX = "sits:session:"

    def __init__(self, url: str, **kw):
        super().__init__(**kw)
        import redis.asyncio as aioredis       # optional at import time: only this store needs it
        self.url = url
        self._redis = aioredis.from_url(url, decode_responses=True)

    def describe(self) -> str:
        return f"redis:{self.url}"

    async def get(self, session_id: str) -> Session | None:
        raw = await self._redis.get(self.PREFIX + session_id)
        return None if raw is None else Session.from_dict(json.loads(raw))

    async def append(self, session_id, messages, *, unit=None, instance=None, memory_refs=None) -> Session:
        from redis.exceptions import WatchError
        key = self.PREFIX + session_id
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:                   # optimistic: retried if another append changed the key meanwhile
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    s = Session(session_id) if raw is None else Session.from_dict(json.loads(raw))
                    s.apply(messages, unit=unit, instance=instance, memory_refs=memory_refs,
                            max_messages=self.max_messages)
                    pipe.multi()
                    pipe.set(key, json.dumps(s.to_dict()), ex=max(1, int(self.ttl_s)))
                    await pipe.execute()
                    return s
                except WatchError:
                    continue

    async def delete(self, session_id: str) -> bool:
        return bool(await self._redis.delete(self.PREFIX + session_id))

    async def close(self) -> None:
        await self._redis.aclose()


def open_session_store(spec: str | None, data_dir: str | Path | None, **kw) -> SessionStore | None:
    """``redis://...`` / ``rediss://...``, ``sqlite:///relative.db`` / ``sqlite:////absolute.db``, ``none``;
    default: SQLite in ``data_dir`` (no store without one)."""
    if spec is None:
        return SqliteSessionStore(Path(data_dir) / "sessions.db", **kw) if data_dir is not None else None
    if spec == "none":
        return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisSessionStore(spec, **kw)
    if spec.startswith("sqlite:///"):
        return SqliteSessionStore(spec[len("sqlite:///"):], **kw)     # sqlite:///rel.db, sqlite:////abs.db
    raise ValueError(f"unknown session store {spec!r}: redis://host:port/db, sqlite:///path or none")
