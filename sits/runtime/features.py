"""What a backend offers besides tokens, declared by the backend itself: the HTTP layer reads these
and never probes a backend for attributes it may or may not have.

A bare engine (``sits serve``) has none of them; a unit declares its SLO, its tools and the
directories behind them, and the memory set it retrieves from by itself (a RAG unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sits.tenancy.cost import ModelShape
from sits.tenancy.spec import PricingSpec

DEFAULT_MEMORY_TOP_K = 4


@dataclass(frozen=True, slots=True)
class BackendFeatures:
    ttft_slo_ms: float | None = None          # responses slower than this are SLO violations (traces keep them)
    tools: tuple[str, ...] = ()               # tool contracts requests may ask for (semver constraints)
    tool_dirs: dict[str, str] = field(default_factory=dict)   # declared guest directory -> host directory
    python_tools: bool = False                # runtime: python tools allowed
    memory_set: str | None = None             # a RAG unit retrieves from this set for every request
    memory_top_k: int = DEFAULT_MEMORY_TOP_K
    pricing: PricingSpec | None = None        # the unit's price table (cost per token, FLOP, GB-hour)
    shape: ModelShape | None = None           # what a token costs to compute (FLOPs) and to hold (KV bytes)
    kv_block_size: int = 16
    message_prompts: bool = False             # prompts cross as messages or text, never token ids: the serving
                                              # side renders its own template (a remote endpoint, a mesh of units)


NO_FEATURES = BackendFeatures()


def model_shape(model: str, dtype: str, device: str, mc=None) -> ModelShape:
    """The cost shape of ``model`` served in ``dtype`` on ``device`` (KV bytes per element: 16-bit on
    CUDA, asked without creating a CUDA context; on a CPU what ``auto`` resolves to)."""
    from sits.engine.config import ModelConfig, resolve_device, resolve_dtype

    mc = mc if mc is not None else ModelConfig.from_dir(model)
    dev = resolve_device(device)
    elem = 2 if dev.type == "cuda" else resolve_dtype(dtype, dev, mc.torch_dtype).itemsize
    return ModelShape.of(mc, kv_bytes_per_elem=elem)
