"""Vector Memory Core: memory sets of texts with embeddings, queryable as they were at any time.

Every memory has ``created_at`` and, once forgotten, ``deleted_at``; nothing is overwritten, so
"the set as of t" is simply the memories alive at t (created at or before t, not yet deleted).
A snapshot is a name for a time; restoring it forgets what was added since and re-adds (as new
memories, pointing back at their originals) what was forgotten since, so the set again equals
its snapshot while its history stays queryable.

The causal chain index records, per response (a request id), which memories it retrieved and
which it wrote, so ``chain(id)`` answers "what influenced this" for a response and "what did this
influence" for a memory.

SQLite (``<data-dir>/memory.db``); search is exact cosine similarity over the set's alive rows
(numpy), which is what a few tens of thousands of memories need.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sits.engine.errors import InvalidRequestError, SitsError

SET_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}$"


class MemoryNotFoundError(SitsError):
    code = "memory_not_found"
    http_status = 404


@dataclass(frozen=True, slots=True)
class Hit:
    id: int
    text: str
    score: float
    created_at: float
    meta: dict

    def to_dict(self) -> dict:
        return {"id": f"m_{self.id}", "text": self.text, "score": round(self.score, 4),
                "created_at": self.created_at, "meta": self.meta}


def memory_id(text_id: str | int) -> int:
    s = str(text_id)
    s = s[2:] if s.startswith("m_") else s
    if not re.fullmatch(r"[0-9]{1,18}", s):
        raise InvalidRequestError(f"{str(text_id)[:40]!r} is not a memory id (m_<number>)", param="id",
                                  code="invalid_memory_id")
    return int(s)


class EmbedderUnavailableError(SitsError):
    code = "embedder_unavailable"
    http_status = 503


DEFAULT_EMBEDDER = "minilm"
_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sits-memory")


async def off_loop(fn, /, *args, **kwargs):
    """Run a memory call on memory's own threads: an embedder that waits for a unit's cold start
    (``unit:<name>``) must not hold the default pool the cold start itself needs."""
    return await asyncio.get_running_loop().run_in_executor(_THREADS, functools.partial(fn, *args, **kwargs))


class MemoryStore:
    """Memory sets in one SQLite file. Each set keeps the embedder it was first written with
    (vectors of two embedders are not comparable): the default MiniLM, or another registered by
    name, such as a unit's own model (``unit:<name>``, mean-pooled hidden states)."""

    def __init__(self, path: str | Path, embed):
        """``embed(texts) -> array [n, d]`` of unit vectors (e.g. ``MiniLMEmbedder.embed``): the default."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._embedders = {DEFAULT_EMBEDDER: embed}
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS memories (id INTEGER PRIMARY KEY AUTOINCREMENT, set_name TEXT NOT NULL,
                text TEXT NOT NULL, embedding BLOB NOT NULL, created_at REAL NOT NULL, deleted_at REAL,
                meta TEXT NOT NULL DEFAULT '{}');
            CREATE INDEX IF NOT EXISTS memories_set ON memories (set_name, created_at);
            CREATE TABLE IF NOT EXISTS snapshots (set_name TEXT NOT NULL, name TEXT NOT NULL, at REAL NOT NULL,
                PRIMARY KEY (set_name, name));
            CREATE TABLE IF NOT EXISTS chain (response_id TEXT NOT NULL, memory_id INTEGER NOT NULL,
                relation TEXT NOT NULL, at REAL NOT NULL, score REAL);
            CREATE INDEX IF NOT EXISTS chain_response ON chain (response_id);
            CREATE INDEX IF NOT EXISTS chain_memory ON chain (memory_id);
            CREATE TABLE IF NOT EXISTS set_embedders (set_name TEXT PRIMARY KEY, embedder TEXT NOT NULL);
        """)
        self._lock = threading.Lock()

    @staticmethod
    def _now(at: float | None = None) -> float:
        return time.time() if at is None else at

    # -- embedders -----------------------------------------------------------------------------------
    def register_embedder(self, name: str, embed) -> None:
        """``embed(texts) -> [n, d]`` unit vectors under ``name``; None removes it (its sets then
        answer 503 ``embedder_unavailable`` until it is back)."""
        if embed is None:
            self._embedders.pop(name, None)
        else:
            self._embedders[name] = embed

    def _embed(self, set_name: str, texts: list[str], requested: str | None = None, *,
               writing: bool = False) -> np.ndarray:
        """Vectors of ``texts`` by the set's embedder; a write to a new set records its embedder
        (``requested``, else the default) once the vectors exist. A set with memories and no record
        predates the record: it is the default's."""
        with self._lock:
            row = self._db.execute("SELECT embedder FROM set_embedders WHERE set_name = ?", (set_name,)).fetchone()
            has = row is None and self._db.execute("SELECT 1 FROM memories WHERE set_name = ? LIMIT 1",
                                                   (set_name,)).fetchone() is not None
        name = row[0] if row else (DEFAULT_EMBEDDER if has else (requested or DEFAULT_EMBEDDER))
        if requested is not None and requested != name:
            raise InvalidRequestError(f"memory set {set_name!r} is embedded with {name!r}, not {requested!r}; "
                                      "use another set (vectors of two embedders are not comparable)",
                                      param="embedder", code="embedder_mismatch")
        embed = self._embedders.get(name)
        if embed is None:
            raise EmbedderUnavailableError(f"memory set {set_name!r} is embedded with {name!r}, which is not "
                                           "available now (its unit is not deployed)", param="embedder")
        vecs = np.asarray(embed(texts), dtype=np.float32)
        if row is None and writing:
            with self._lock:
                self._db.execute("INSERT OR IGNORE INTO set_embedders VALUES (?, ?)", (set_name, name))
        return vecs

    # -- writing -------------------------------------------------------------------------------------
    def add(self, set_name: str, texts: list[str], metas: list[dict] | None = None, *,
            at: float | None = None, response_id: str | None = None, embedder: str | None = None) -> list[int]:
        """``embedder``: the set's embedder (checked against it; a new set takes it, default MiniLM)."""
        if not texts:
            return []
        vecs = self._embed(set_name, texts, embedder, writing=True)
        now = self._now(at)
        metas = metas or [{} for _ in texts]
        ids = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for text, vec, meta in zip(texts, vecs, metas):
                    cur = self._db.execute("INSERT INTO memories (set_name, text, embedding, created_at, meta) "
                                           "VALUES (?, ?, ?, ?, ?)", (set_name, text, vec.tobytes(), now,
                                                                      json.dumps(meta)))
                    ids.append(cur.lastrowid)
                    if response_id is not None:
                        self._db.execute("INSERT INTO chain VALUES (?, ?, 'wrote', ?, NULL)",
                                         (response_id, cur.lastrowid, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ids

    def forget(self, set_name: str, mid: int, *, at: float | None = None) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE memories SET deleted_at = ? WHERE id = ? AND set_name = ? AND "
                                   "deleted_at IS NULL", (self._now(at), mid, set_name))
            return cur.rowcount > 0

    # -- reading -------------------------------------------------------------------------------------
    def _alive(self, set_name: str, at: float) -> list[tuple]:
        return self._db.execute(
            "SELECT id, text, embedding, created_at, meta FROM memories WHERE set_name = ? AND created_at <= ? "
            "AND (deleted_at IS NULL OR deleted_at > ?) ORDER BY id", (set_name, at, at)).fetchall()

    def list(self, set_name: str, *, as_of: float | None = None) -> list[Hit]:
        with self._lock:
            rows = self._alive(set_name, self._now(as_of))
        return [Hit(r[0], r[1], 1.0, r[3], json.loads(r[4])) for r in rows]

    def search(self, set_name: str, query: str, k: int = 4, *, as_of: float | None = None,
               response_id: str | None = None) -> list[Hit]:
        """The ``k`` memories most similar to ``query`` among those alive at ``as_of`` (default now);
        with ``response_id``, each one returned is recorded as retrieved by that response."""
        at = self._now(as_of)
        with self._lock:
            rows = self._alive(set_name, at)
        if not rows:
            return []
        q = self._embed(set_name, [query])[0]
        mat = np.stack([np.frombuffer(r[2], dtype=np.float32) for r in rows])
        scores = mat @ q
        order = np.argsort(-scores)[:max(1, k)]
        hits = [Hit(rows[i][0], rows[i][1], float(scores[i]), rows[i][3], json.loads(rows[i][4])) for i in order]
        if response_id is not None:
            self.record_retrieval(response_id, hits)
        return hits

    def record_retrieval(self, response_id: str, hits: list[Hit]) -> None:
        now = time.time()
        with self._lock:
            self._db.executemany("INSERT INTO chain VALUES (?, ?, 'retrieved', ?, ?)",
                                 [(response_id, h.id, now, h.score) for h in hits])

    def sets(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT set_name, COUNT(*), SUM(deleted_at IS NULL), MAX(created_at) "
                                    "FROM memories GROUP BY set_name ORDER BY set_name").fetchall()
            embedders = dict(self._db.execute("SELECT set_name, embedder FROM set_embedders").fetchall())
        return [{"set": r[0], "memories": r[2], "ever": r[1], "updated_at": r[3],
                 "embedder": embedders.get(r[0], DEFAULT_EMBEDDER)} for r in rows]

    # -- time slices ---------------------------------------------------------------------------------
    def snapshot(self, set_name: str, name: str, *, at: float | None = None) -> dict:
        at = self._now(at)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?)", (set_name, name, at))
        return {"set": set_name, "name": name, "at": at}

    def snapshots(self, set_name: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT name, at FROM snapshots WHERE set_name = ? ORDER BY at",
                                    (set_name,)).fetchall()
        return [{"set": set_name, "name": n, "at": a} for n, a in rows]

    def restore(self, set_name: str, name: str, *, at: float | None = None) -> dict:
        """Make the set (as of now) equal to the snapshot; returns what changed."""
        now = self._now(at)
        with self._lock:
            row = self._db.execute("SELECT at FROM snapshots WHERE set_name = ? AND name = ?",
                                   (set_name, name)).fetchone()
            if row is None:
                raise MemoryNotFoundError(f"set {set_name!r} has no snapshot {name!r}", param="name",
                                          code="snapshot_not_found")
            then = {r[0]: r for r in self._alive(set_name, row[0])}
            current = {r[0]: r for r in self._alive(set_name, now)}
            for mid, r in list(current.items()):       # a copy made by an earlier restore stands for its original
                origin = json.loads(r[4]).get("restored_from")
                if origin and memory_id(origin) in then and memory_id(origin) not in current:
                    current[memory_id(origin)] = current.pop(mid) + (mid,)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = [r[5] if len(r) > 5 else mid for mid, r in current.items() if mid not in then]
                for mid in gone:
                    self._db.execute("UPDATE memories SET deleted_at = ? WHERE id = ?", (now, mid))
                back = []
                for mid, r in then.items():
                    if mid not in current:
                        meta = {**json.loads(r[4]), "restored_from": f"m_{mid}", "snapshot": name}
                        cur = self._db.execute("INSERT INTO memories (set_name, text, embedding, created_at, meta) "
                                               "VALUES (?, ?, ?, ?, ?)", (set_name, r[1], r[2], now, json.dumps(meta)))
                        back.append(cur.lastrowid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return {"set": set_name, "snapshot": name, "at": row[0], "forgotten": [f"m_{m}" for m in gone],
                "restored": [f"m_{m}" for m in back]}

    # -- the causal chain ----------------------------------------------------------------------------
    def chain(self, node: str) -> dict:
        """For a memory (``m_<n>``): who wrote it, who retrieved it. For a response id: what it
        retrieved and wrote, and the responses that wrote what it retrieved (one step further back)."""
        with self._lock:
            if node.startswith("m_"):
                mid = memory_id(node)
                row = self._db.execute("SELECT set_name, text, created_at, deleted_at, meta FROM memories "
                                       "WHERE id = ?", (mid,)).fetchone()
                if row is None:
                    raise MemoryNotFoundError(f"no memory {node}", param="id")
                links = self._db.execute("SELECT response_id, relation, at, score FROM chain WHERE memory_id = ? "
                                         "ORDER BY at", (mid,)).fetchall()
                return {"id": node, "kind": "memory", "set": row[0], "text": row[1], "created_at": row[2],
                        "deleted_at": row[3], "meta": json.loads(row[4]),
                        "written_by": [r[0] for r in links if r[1] == "wrote"],
                        "retrieved_by": [{"response": r[0], "at": r[2], "score": r[3]} for r in links
                                         if r[1] == "retrieved"]}
            links = self._db.execute("SELECT memory_id, relation, at, score FROM chain WHERE response_id = ? "
                                     "ORDER BY at", (node,)).fetchall()
            if not links:
                raise MemoryNotFoundError(f"nothing is recorded for {node!r}", param="id")
            retrieved = [r[0] for r in links if r[1] == "retrieved"]
            upstream = sorted({r[0] for r in self._db.execute(
                f"SELECT response_id FROM chain WHERE relation = 'wrote' AND memory_id IN "
                f"({','.join('?' * len(retrieved))})", retrieved).fetchall()} - {node}) if retrieved else []
            return {"id": node, "kind": "response",
                    "retrieved": [{"memory": f"m_{r[0]}", "score": r[3]} for r in links if r[1] == "retrieved"],
                    "wrote": [f"m_{r[0]}" for r in links if r[1] == "wrote"],
                    "influenced_by": upstream}

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_memory_store(data_dir: str | Path) -> MemoryStore:
    """The data directory's memory (``memory.db``), embedding with the shared MiniLM (loaded on first use)."""
    from sits.memory.embedder import shared_embedder
    return MemoryStore(Path(data_dir) / "memory.db", lambda texts: shared_embedder().embed(texts).numpy())
