"""Engine configuration: one home for every knob of the data plane, with documented defaults."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sits.engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(slots=True)
class ModelConfig:
    """The subset of a Hugging Face ``config.json`` the native Llama-family model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # bias on q/k/v (Qwen2 always; Llama's attention_bias)
    o_proj_bias: bool = False          # ... and on o_proj (Llama's attention_bias; not Qwen2)
    mlp_bias: bool = False             # Llama's mlp_bias: gate/up/down
    sliding_window: int | None = None  # a windowed layer attends to the last `sliding_window` positions
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention"/"full_attention"; None: all alike
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        quantization = raw.get("quantization_config")
        if quantization:
            method = (quantization.get("quant_method") if isinstance(quantization, dict) else None) or "unknown"
            raise UnsupportedModelError(
                f"{source}: the checkpoint is quantized with {method!r}, which SITS does not load; use the "
                "unquantized (bf16/fp16/fp32) checkpoint or a GGUF file of the model",
                param="quantization_config", code="unsupported_quantization")
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"SITS runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
                param="architectures")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            family = SUPPORTED_ARCHITECTURES[arch]
            window = raw.get("sliding_window")
            if family == "qwen2" and not raw.get("use_sliding_window", False):
                window = None
            # transformers >= 5 folds rope_theta / rope_scaling into one `rope_parameters` dict.
            rope = dict(raw.get("rope_parameters") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            rope_scaling = raw.get("rope_scaling")
            if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
                rope_scaling = rope
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", family == "qwen2")) or family == "qwen2",
                o_proj_bias=family == "llama" and bool(raw.get("attention_bias", False)),
                mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
                sliding_window=window,
                layer_types=_layer_types(raw, family, window),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos_list,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}", param=e.args[0]) from None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return int(self.sliding_window)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """From ``config.json`` in a Hugging Face folder, or from a GGUF file's metadata."""
        from sits.engine.gguf_model import open_gguf

        gguf = open_gguf(model_dir)
        if gguf is not None:
            return gguf.model_config()
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found; a model directory needs config.json, "
                                 "*.safetensors and tokenizer.json", param="model")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        return cls.from_dict(raw, source=str(path))


def _layer_types(raw: dict[str, Any], family: str, window: Any) -> tuple[str, ...] | None:
    """Which layers slide, as transformers decides it: a config's own ``layer_types``; Qwen2 slides
    from layer ``max_window_layers`` on; Mistral slides everywhere (None)."""
    if raw.get("layer_types"):
        return tuple(str(t) for t in raw["layer_types"])
    if family == "qwen2" and window:
        first = int(raw.get("max_window_layers", 28))
        return tuple("sliding_attention" if i >= first else "full_attention"
                     for i in range(int(raw["num_hidden_layers"])))
    return None


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def cpu_computes_bf16() -> bool:
    """This CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where bf16 weights were measured
    faster than fp32 (docs/benchmarks.md, ``sits bench dtype``); elsewhere bf16 is emulated."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in info for flag in (" avx512_bf16", " amx_bf16"))


def resolve_dtype(name: str, device: torch.device | None = None, stored: str | None = None) -> torch.dtype:
    """The compute dtype for ``name``; ``auto`` follows the checkpoint's stored dtype (``stored``):
    a bf16 or fp16 checkpoint runs in bf16 where ``device`` computes it natively (fp16 stays fp16 on
    CUDA), else in fp32; an fp32 checkpoint stays fp32 on a CPU (its weights are then mapped, not
    copied) and runs in bf16 on CUDA, as vLLM does."""
    if name == "auto":
        return _auto_dtype(device or torch.device("cpu"), _DTYPES.get(stored or "float32", torch.float32))
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedModelError(f"dtype {name!r} is not supported; use auto or one of {sorted(_DTYPES)}",
                                    param="dtype") from None


def _auto_dtype(device: torch.device, stored: torch.dtype) -> torch.dtype:
    if device.type == "cuda":
        if stored == torch.float16:
            return torch.float16
        if not torch.cuda.is_initialized():
            # a planner (the gateway, the zygote) must not create a CUDA context to ask: bf16 and the
            # fp16 a pre-Ampere GPU would get instead are both 2 bytes, so the plan is the same
            return torch.bfloat16
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if stored in (torch.bfloat16, torch.float16) and cpu_computes_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_attention(name: str, device: torch.device) -> str:
    """``torch``, ``triton`` or ``cpp`` for the engine's attention (``EngineConfig.attention``): ``auto``
    takes the paged Triton kernels on a CUDA device where Triton is installed, the C++ decode kernel on
    a CPU where it is built (``layers.cpu_kernels``; ``auto`` never compiles it, so a start never
    waits for g++, while ``cpp`` builds it if needed), the reference path elsewhere."""
    from sits.engine.layers import cpu_kernels, paged_attention

    if name == "triton" and not paged_attention.available(device):
        raise UnsupportedModelError(f"attention 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); "
                                    f"this is {device}", param="attention")
    if name == "cpp" and (device.type != "cpu" or cpu_kernels.kernel() is None):
        why = (f"this is {device}" if device.type != "cpu"
               else cpu_kernels.kernel_error() or "turned off by SITS_CPU_KERNELS")
        raise UnsupportedModelError(f"attention 'cpp' needs a CPU device and its compiled kernel ({why})",
                                    param="attention")
    if name == "auto":
        if device.type == "cuda" and paged_attention.available(device):
            return "triton"
        return "cpp" if device.type == "cpu" and cpu_kernels.kernel(build=False) is not None else "torch"
    return name


def resolve_cpu_kernel(knob: str, name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``torch`` or ``cpp`` for one of the engine's fp32 CPU kernel choices (``knob``: ``linear`` or
    ``elementwise`` of ``EngineConfig``): ``auto`` takes the C++ kernels for fp32 weights on a CPU where
    they are built (and never compiles them), ``cpp`` builds them if needed and refuses other devices
    and dtypes."""
    from sits.engine.layers import cpu_kernels

    if name == "cpp" and (device.type != "cpu" or dtype != torch.float32 or cpu_kernels.kernel() is None):
        why = (f"this is {device}" if device.type != "cpu" else f"the weights are {dtype}" if dtype != torch.float32
               else cpu_kernels.kernel_error() or "turned off by SITS_CPU_KERNELS")
        raise UnsupportedModelError(f"{knob} 'cpp' needs fp32 weights on a CPU and its compiled kernels ({why})",
                                    param=knob)
    if name == "auto":
        usable = device.type == "cpu" and dtype == torch.float32
        return "cpp" if usable and cpu_kernels.kernel(build=False) is not None else "torch"
    return name


def resolve_gguf_blocks(name: str, model: str, device: torch.device, dtype: torch.dtype,
                        quantization: str | None, build: bool = True) -> bool:
    """Whether a GGUF model's block-quantized weights (``block_quant.BLOCK_TYPES``) serve as their
    blocks (``EngineConfig.gguf_weights``): ``auto`` takes them for an fp32 engine on a CPU where the
    kernels are built (never compiling them) and no load-time quantization is asked; ``blocks``
    builds the kernels if needed (``build`` False: assumes the instance will) and refuses what cannot
    serve them; a model that is not a GGUF file has none."""
    from sits.engine.gguf_model import gguf_file
    from sits.engine.layers import cpu_kernels

    if name == "dequantize" or gguf_file(model) is None:
        return False
    usable = device.type == "cpu" and dtype == torch.float32 and quantization is None
    if name == "blocks" and usable and not build:
        return True
    if name == "blocks" and (not usable or cpu_kernels.kernel() is None):
        why = (f"this is {device}" if device.type != "cpu" else f"the compute dtype is {dtype}"
               if dtype != torch.float32 else f"quantization {quantization!r} is asked" if quantization
               else cpu_kernels.kernel_error() or "turned off by SITS_CPU_KERNELS")
        raise UnsupportedModelError(f"gguf_weights 'blocks' needs fp32 on a CPU and the compiled CPU kernels ({why})",
                                    param="gguf_weights")
    return usable and cpu_kernels.kernel(build=False) is not None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to run one model on one device.

    Defaults follow the device: a step's token budget is 256 on a CPU and 2048 on a GPU (where a
    step's launches cost more than its arithmetic until it is large); on a GPU,
    ``gpu_memory_utilization`` sizes the KV pool from the device's free memory.
    """

    model: str
    device: str = "auto"                 # "cpu", "cuda", "cuda:1", or "auto"
    dtype: str = "auto"                  # weights and KV cache; auto follows the checkpoint (resolve_dtype)
    quantization: str | None = None      # "int8": projections' weights quantized at load (engine/quantization.py)
    pack_weights: bool = True            # bf16 on a bf16 CPU: linears pre-packed for oneDNN (faster steps; the
                                         # weights are then a private copy, not views of the mapped file)
    threads: int | None = None           # intra-op threads on CPU (None: all cores)
    block_size: int = 16                 # tokens per KV block
    num_kv_blocks: int | None = None     # None: derived from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512        # KV pool size when num_kv_blocks is None (and no gpu_memory_utilization)
    gpu_memory_utilization: float | None = None  # on CUDA: the share of the device's memory this engine may
                                         # fill; its KV pool takes what is free of it after the weights and an
                                         # activation reserve (then kv_cache_memory_mb is not used)
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    max_num_seqs: int = 64               # sequences in one step at most
    max_num_batched_tokens: int | None = None  # per-step token budget (prefill chunks + decodes); None: the
                                         # device's (default_step_budget), set by the engine that runs it
    policy: str = "pfsd"                 # "pfsd" (default) or "fcfs" (vLLM-style baseline)
    enable_prefix_caching: bool = True
    guided_jump_forward: bool = True     # a grammar's forced tokens join the output without a step each
    min_decode_window: int = 1           # pfsd: decodes always get at least this many slots a step
    aging_per_s: float = 1.0             # pfsd: priority bonus per second waited (no starvation)
    fair_share: bool = True              # pfsd: a tenant served a step's budget beyond another waits behind it
    warmup: bool = True                  # run multi-level warm-up at start
    kv_touch: str = "eager"              # "eager" (touch the KV pool at start) or "background" (while idle)
    warmup_shapes: str = "all"           # "all" serving shapes, or "minimal" (one prefill, one decode: cold starts)
    seed: int = 0                        # default generator seed for unseeded sampling
    lora_adapters: tuple[tuple[str, str], ...] = ()   # (name, PEFT folder) loaded at start (sits.engine.lora)
    enable_lora: bool = False            # adapters may be loaded at run time (implied by lora_adapters)
    max_loras: int = 4                   # adapters resident on the device, and in one step, at most
    max_lora_rank: int = 64
    linear: str = "auto"                 # "torch", or "cpp" (fp32 few-row matmuls through the C++ CPU kernel);
                                         # auto: cpp for fp32 on a CPU where it is built
    elementwise: str = "auto"            # "torch", or "cpp" (fp32 norms with their residual adds, and RoPE with
                                         # the K/V store, in one C++ call each); auto: as linear
    attention: str = "auto"              # "torch" (reference), "triton" (paged kernels), "cpp" (CPU decode
                                         # kernel); auto: triton on CUDA, cpp on a CPU where it is built
    decode_graphs: bool = True           # with triton attention: decode steps replayed from CUDA graphs
    gguf_weights: str = "auto"           # a GGUF's block-quantized weights: "blocks" (kept as the file's blocks,
                                         # multiplied in place by the C++ CPU kernels; fp32 on a CPU) or
                                         # "dequantize" (to the compute dtype at load); auto: blocks where usable
    block_activations: str = "fp32"      # what those blocks multiply in steps of <= 32 rows: "fp32"
                                         # activations (the dequantized model's sums, to rounding) or "int8"
                                         # (quantized per block, integer dot products: llama.cpp's
                                         # arithmetic, faster, approximate)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters)

    def __post_init__(self) -> None:
        if self.kv_touch not in ("eager", "background"):
            raise ValueError(f"kv_touch must be 'eager' or 'background', got {self.kv_touch!r}")
        if self.warmup_shapes not in ("all", "minimal"):
            raise ValueError(f"warmup_shapes must be 'all' or 'minimal', got {self.warmup_shapes!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be 'int8' or None, got {self.quantization!r}")
        if self.policy not in ("pfsd", "fcfs"):
            raise ValueError(f"policy must be 'pfsd' or 'fcfs', got {self.policy!r}")
        for knob in ("linear", "elementwise"):
            if getattr(self, knob) not in ("auto", "torch", "cpp"):
                raise ValueError(f"{knob} must be 'auto', 'torch' or 'cpp', got {getattr(self, knob)!r}")
        if self.gguf_weights not in ("auto", "blocks", "dequantize"):
            raise ValueError(f"gguf_weights must be 'auto', 'blocks' or 'dequantize', got {self.gguf_weights!r}")
        if self.block_activations not in ("fp32", "int8"):
            raise ValueError(f"block_activations must be 'fp32' or 'int8', got {self.block_activations!r}")
        if self.attention not in ("auto", "torch", "triton", "cpp"):
            raise ValueError(f"attention must be 'auto', 'torch', 'triton' or 'cpp', got {self.attention!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size < 1 or (self.max_num_batched_tokens or 1) < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")


def default_step_budget(device: torch.device) -> int:
    """Tokens per step when the config leaves it open: 256 on a CPU, 2048 on a GPU (where a step's
    launches cost more than its arithmetic until the step is large)."""
    return 2048 if device.type == "cuda" else 256


def activation_reserve_bytes(mc: ModelConfig, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """Device memory a step needs beside weights and KV: the largest step's activations (its tokens
    through the widest layer, a few live at once), the sampler's fp32 copies of the logits, the LoRA
    slot stacks at their largest, and a fixed allowance for kernels' workspaces and CUDA graphs."""
    elem = torch.empty((), dtype=dtype).element_size()
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    per_token = (4 * h + q + 2 * kv + 3 * i) * elem
    logits = cfg.max_num_seqs * mc.vocab_size * 4 * 4
    lora = 0
    if cfg.lora_enabled:        # every projection's A and B, per slot, at the largest rank
        widths = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        lora = cfg.max_loras * cfg.max_lora_rank * widths * mc.num_hidden_layers * elem
    budget = cfg.max_num_batched_tokens or 2048
    return 2 * budget * per_token + logits + lora + 512 * 2**20


def kv_blocks_for_device(free: int, total: int, utilization: float, reserve: int, per_block: int) -> int:
    """KV blocks that fit in ``utilization`` of a device of ``total`` bytes of which ``free`` are free
    (the weights already loaded count as used, and so does what other processes hold)."""
    return max(0, (int(total * utilization) - (total - free) - reserve) // per_block)


# generation_config.json keys that are request defaults (as vLLM reads them), and their request names
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str | os.PathLike) -> dict[str, float]:
    """The model author's sampling defaults from ``generation_config.json`` beside the weights (none for
    a single model file), under request parameter names: applied where a request leaves one unset."""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, float] = {}
    for key, name in _GENERATION_DEFAULTS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out
