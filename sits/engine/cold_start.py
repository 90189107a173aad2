"""ColdStartReport: where the time from "no engine" to "first token" went, phase by phase."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("imports", "config", "weights", "tokenizer", "kv_allocation",
          "warmup_model", "warmup_operator", "warmup_hardware", "first_token")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), so 'imports' covers interpreter start too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(slots=True)
class ColdStartReport:
    """Phase durations in milliseconds, in the order they happened.

    ``imports``: process start to engine construction (interpreter, torch, sits). ``first_token``:
    engine ready to the first token of the first request (0 until one is served).
    """

    phases_ms: dict[str, float] = field(default_factory=dict)
    ready_at: float | None = None       # time.monotonic() when the engine finished starting

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases_ms[name] = self.phases_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def record(self, name: str, ms: float) -> None:
        self.phases_ms[name] = ms

    def mark_first_token(self) -> None:
        if "first_token" not in self.phases_ms and self.ready_at is not None:
            self.phases_ms["first_token"] = (time.monotonic() - self.ready_at) * 1e3

    @property
    def total_ms(self) -> float:
        return sum(self.phases_ms.values())

    def to_dict(self) -> dict:
        return {"phases_ms": {k: round(v, 2) for k, v in self.phases_ms.items()}, "total_ms": round(self.total_ms, 2)}

    @classmethod
    def from_dict(cls, d: dict) -> "ColdStartReport":
        """The inverse of ``to_dict`` (a report that crossed a process boundary)."""
        return cls(phases_ms=dict(d.get("phases_ms") or {}))

    def format(self) -> str:
        width = max(len(k) for k in self.phases_ms) if self.phases_ms else 5
        lines = [f"  {k:<{width}}  {v:9.1f} ms" for k, v in self.phases_ms.items()]
        lines.append(f"  {'total':<{width}}  {self.total_ms:9.1f} ms")
        return "cold start:\n" + "\n".join(lines)
