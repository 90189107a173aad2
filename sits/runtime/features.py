"""What a backend offers besides tokens, declared by the backend itself: the HTTP layer reads these
and never probes a backend for attributes it may or may not have.

A bare engine (``sits serve``) has none of them; a unit declares its SLO, its tools and the
directories behind them, and the memory set it retrieves from by itself (a RAG unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MEMORY_TOP_K = 4


@dataclass(frozen=True, slots=True)
class BackendFeatures:
    ttft_slo_ms: float | None = None          # responses slower than this are SLO violations (traces keep them)
    tools: tuple[str, ...] = ()               # tool contracts requests may ask for (semver constraints)
    tool_dirs: dict[str, str] = field(default_factory=dict)   # declared guest directory -> host directory
    python_tools: bool = False                # runtime: python tools allowed
    memory_set: str | None = None             # a RAG unit retrieves from this set for every request
    memory_top_k: int = DEFAULT_MEMORY_TOP_K


NO_FEATURES = BackendFeatures()
