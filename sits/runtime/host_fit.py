"""Will a unit fit this host? Checked at deploy, so a spec whose instances can never start is a 400
with the numbers, not a unit whose requests wait for starts that keep failing.

On a CPU host an instance needs its KV pool (allocated whole at start) plus the model's weights as
loaded (``instance_weight_bytes``), which forked instances share (counted once). Available memory
is the kernel's ``MemAvailable``, or less where a cgroup limit says so. GPU memory is not checked
here (asking would create a CUDA context in the gateway); an instance that does not fit there fails
its start and is retried with backoff.
"""

from __future__ import annotations

from pathlib import Path

from sits.engine.config import ModelConfig, resolve_device, resolve_dtype, resolve_gguf_blocks
from sits.engine.errors import InvalidRequestError
from sits.engine.gguf_model import open_gguf
from sits.engine.kv_cache import bytes_per_block
from sits.engine.loader import weight_files
from sits.runtime.unit_spec import UnitSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
MIB = 2**20


def available_memory_bytes() -> int | None:
    """What this process may still allocate: MemAvailable, capped by its cgroup's limit; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cg / "memory.current").read_text().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def file_weight_bytes(model: str) -> int:
    """Bytes of the weights' files: a model file itself, or the checkpoint's files (what a load maps)."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    files = weight_files(path) or [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    return sum(p.stat().st_size for p in files)


def instance_weight_bytes(spec: UnitSpec, mc: ModelConfig) -> int:
    """The weights one instance holds once loaded, from the model's matmul and embedding values (norms
    are noise): a byte a value for int8 projections (the embeddings and LM head stay in the compute
    dtype); a GGUF's block-quantized weights their file's bytes where they are served as blocks;
    everything else a value of the compute dtype (what a dequantized GGUF or a converted checkpoint
    takes, where its file may be several times smaller)."""
    from sits.runtime.features import model_shape

    cfg = spec.engine_config()
    shape = model_shape(spec.model, cfg.dtype, cfg.device, mc)
    params, elem = shape.weight_params, shape.kv_bytes_per_elem
    if cfg.quantization == "int8":
        return shape.layer_params + (params - shape.layer_params) * elem
    gguf = open_gguf(spec.model)
    if gguf is None:
        return params * elem
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, mc.torch_dtype)
    if not resolve_gguf_blocks(cfg.gguf_weights, spec.model, device, dtype, cfg.quantization, build=False):
        return params * elem
    values, nbytes = gguf.block_tensors()
    return nbytes + max(0, params - values) * elem


def kv_pool_bytes(spec: UnitSpec, mc: ModelConfig) -> int:
    cfg = spec.engine_config()
    if cfg.num_kv_blocks is not None:
        dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device), mc.torch_dtype)
        return cfg.num_kv_blocks * bytes_per_block(mc, cfg.block_size, dtype)
    return cfg.kv_cache_memory_mb * MIB


def check_fits_host(spec: UnitSpec, mc: ModelConfig, available: int | None = None) -> None:
    """Raise ``insufficient_memory`` if ``min_instances`` (at least one) instances of ``spec`` cannot
    fit in the memory available now."""
    if resolve_device(spec.resources.device).type != "cpu":
        return
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    n = max(1, spec.scale.min_instances)
    kv, weights = kv_pool_bytes(spec, mc), instance_weight_bytes(spec, mc)
    need = weights + n * kv
    if need > available:
        raise InvalidRequestError(
            f"unit {spec.name} needs {need / MIB:,.0f} MiB ({n} instance(s) x a {kv / MIB:,.0f} MiB KV pool "
            f"+ {weights / MIB:,.0f} MiB of weights) but this host has {available / MIB:,.0f} MiB available; "
            f"lower resources.kv_cache_mb / kv_blocks or scale.min_instances",
            param="resources.kv_cache_mb", code="insufficient_memory")
