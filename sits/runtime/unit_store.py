"""The deployed set of units, persisted in SQLite under the runtime's data directory.

A unit deployed through the control API is still deployed after the gateway restarts. One table,
one row per unit (the validated spec as JSON); every write is its own transaction.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from sits.runtime.unit_spec import UnitSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS units (
    name        TEXT PRIMARY KEY,
    spec        TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
)
"""


class UnitStore:
    def __init__(self, data_dir: str | Path):
        self.path = Path(data_dir) / "sits.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)

    def put(self, spec: UnitSpec) -> None:
        now = time.time()
        self._db.execute("INSERT INTO units (name, spec, created_at, updated_at) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, updated_at = excluded.updated_at",
                         (spec.name, spec.model_dump_json(), now, now))

    def delete(self, name: str) -> bool:
        return self._db.execute("DELETE FROM units WHERE name = ?", (name,)).rowcount > 0

    def all(self) -> list[UnitSpec]:
        rows = self._db.execute("SELECT spec FROM units ORDER BY created_at, name").fetchall()
        return [UnitSpec.model_validate(json.loads(r[0])) for r in rows]

    def close(self) -> None:
        self._db.close()
