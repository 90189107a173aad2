"""Units (Intelligence Units) declared in YAML, validated with errors that point at the line.

    name: chat
    model: ./models/tiny            # a local HF directory (relative to the YAML file)
    prompt_template: null           # optional Jinja template around the user input: {{ input }}
    scale: {min_instances: 0, max_instances: 4, keep_alive_s: 300,
            trigger: "ttft_p95 > 800ms || kv_util > 85%"}
    slo: {ttft_ms: 2000, itl_ms: 500, tps: 1200, target_health: 0.75}
    resources: {device: auto, threads: 2, kv_blocks: auto, cpu_quota: 1.5}
    sla: {success_rate: 0.85, window_s: 30, min_requests: 10, open_s: 5, half_open_probes: 3}
    fallback: chat-small            # where requests go while the SLA breaker is open (else 503)
    faults: {seed: 1, inject: [{kind: link_jitter, min_ms: 10, max_ms: 500}]}   # see sits.faults

A remote unit names an OpenAI-compatible endpoint instead of a model (``backend:`` in place of
``model:``); the gateway's features (SLA breaker, fallback, metrics, tracing, sessions, memory, the
tool loop, tenants) apply to it as to a local unit::

    name: large
    backend: {openai: https://api.example.com/v1, model: big-model, api_key_env: EXAMPLE_API_KEY}

A config for ``sits up`` holds ``units: [ ... ]`` of these. Every problem is reported as
``file:line:column: field: what is wrong (what is allowed)``; all problems at once, not the first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import jinja2.sandbox
import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      StringConstraints, model_validator)

from sits.engine.config import EngineConfig, resolve_device
from sits.engine.errors import SitsError
from sits.engine.sampling_params import MIN_REPETITION_PENALTY
from sits.faults.spec import FaultsSpec
from sits.runtime.sla import SlaSpec
from sits.runtime.trigger import TriggerError, parse_trigger
from sits.tenancy.spec import PricingSpec

UNIT_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"      # no ':' (model "<unit>:<adapter>") or '/'


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScaleSpec(_Strict):
    min_instances: int = Field(0, ge=0, le=64)
    max_instances: int = Field(1, ge=1, le=64)
    keep_alive_s: float = Field(300.0, ge=0, description="idle time before scaling to min_instances")
    trigger: str | None = Field(None, description='e.g. "ttft_p95 > 800ms || kv_util > 85%"')
    upscale_delay_s: float = Field(0.0, ge=0, description="the trigger must hold this long before a scale-up")
    downscale_delay_s: float = Field(30.0, ge=0, description="calm for this long before a scale-down")
    window_s: float = Field(30.0, gt=0, description="metrics look-back window")
    health_timeout_s: float = Field(10.0, gt=0, description="an instance silent this long is killed and replaced")
    start_backoff_s: float = Field(1.0, gt=0, le=3600, description="wait after a failed start; doubles per failure")
    start_backoff_max_s: float = Field(60.0, gt=0, le=3600, description="the longest wait between failed starts")

    @field_validator("trigger")
    @classmethod
    def _trigger_parses(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_trigger(v)
            except TriggerError as e:
                raise ValueError(e.message) from None
        return v

    @model_validator(mode="after")
    def _bounds(self) -> "ScaleSpec":
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) exceeds max_instances ({self.max_instances})")
        return self


class SloSpec(_Strict):
    ttft_ms: float = Field(2000.0, gt=0)
    itl_ms: float = Field(500.0, gt=0)
    tps: float = Field(100.0, gt=0, description="output tokens per second the unit should deliver")
    target_health: float = Field(0.75, ge=0, le=1, description="scale up when the SLO health score falls below")


class ResourcesSpec(_Strict):
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N")
    threads: int | None = Field(None, ge=1, le=1024)
    kv_blocks: int | Literal["auto"] = "auto"
    kv_cache_mb: int = Field(256, ge=1, description="KV pool size when kv_blocks is auto")
    max_model_len: int | None = Field(None, ge=16)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"   # auto: follow the checkpoint
    quantization: Literal["int8"] | None = Field(None, description="int8: weight-only, per channel, at load")
    gguf_weights: Literal["auto", "blocks", "dequantize"] = Field(
        "auto", description="a GGUF's block-quantized weights (Q4_0 to Q8_0, Q4_K/Q5_K/Q6_K): served as the "
                            "file's blocks (fp32 on a CPU) or dequantized at load; auto: blocks where usable")
    block_activations: Literal["fp32", "int8"] = Field(
        "fp32", description="what those blocks multiply in a step of up to 32 rows (decodes, short prefills): "
                            "fp32 activations (the dequantized model's sums, to rounding) or int8 (quantized per "
                            "block, integer dot products, as llama.cpp: faster, approximate)")
    policy: Literal["pfsd", "fcfs"] = "pfsd"
    warmup: bool | Literal["all", "minimal"] = Field(
        "all", description="warm-up at start: all serving shapes, minimal (one prefill, one decode), or false")
    lora: bool = Field(False, description="accept LoRA adapters loaded at run time (implied by adapters:)")
    max_loras: int = Field(4, ge=1, le=256, description="LoRA adapters resident, and in one step, at most")
    max_lora_rank: int = Field(64, ge=1, le=4096)
    standby: int | None = Field(
        None, ge=0, le=8, description="processes kept standing by on this unit's device for its next starts "
                                      "(context created, no weights): default 1 on a GPU, 0 on a CPU")
    cpu_quota: float | None = Field(None, gt=0, le=1024,
                                    description="CPU cores per instance (cgroup quota where the host allows it, "
                                                "a thread cap otherwise)")

    @field_validator("kv_blocks")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("kv_blocks is a positive integer or 'auto'")
        return v


class MemorySpec(_Strict):
    set: str = Field(..., pattern=UNIT_NAME, description="the memory set its requests retrieve from")
    ingest: str | None = Field(None, description="a folder of .md/.txt documents indexed at deploy (relative to the YAML)")
    chunk_chars: int = Field(600, ge=50, le=20_000)
    top_k: int = Field(4, ge=1, le=32, description="memories placed in front of each question")
    embedder: Literal["minilm", "unit"] = Field(
        "minilm", description="minilm (all-MiniLM-L6-v2, offline) or unit: this unit's own model, mean-pooled")


class RemoteBackendSpec(_Strict):
    """An OpenAI-compatible endpoint serving a unit (another SITS, a vLLM cluster, a cloud API)."""

    openai: str = Field(..., pattern=r"^https?://[^\s/]+(/\S*)?$",
                        description="the API's base URL, as the openai client takes it (e.g. http://host:8000/v1)")
    model: str | None = Field(None, min_length=1, description="the model name the endpoint serves (default: the unit's name)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="the environment variable holding its API key (sent as a Bearer token)")
    max_context: int = Field(32768, ge=16, description="the remote model's context length (prompt + output)")
    max_tokens: int = Field(1024, ge=1, description="new tokens for a request that asks for no limit (sent to the endpoint)")
    connect_timeout_s: float = Field(5.0, gt=0, le=600)
    read_timeout_s: float = Field(300.0, gt=0, le=3600, description="the longest silence within a response")
    max_connections: int = Field(64, ge=1, le=4096)


class MeshEscalationSpec(_Strict):
    """When a mesh gives up on a tier's answer and re-runs the request on the next tier."""

    deadline: bool = Field(True, description="no first token within the request's TTFT budget: the next tier")
    errors: bool = Field(True, description="a server-side error or a rate limit of the tier: the next tier")
    invalid_output: bool = Field(True, description="a malformed tool call, or an answer that is not the JSON "
                                                   "response_format asks for: the next tier (the answer is held "
                                                   "back until it is checked)")
    min_mean_logprob: float | None = Field(None, le=0, description="a local tier's answer whose mean token "
                                                                    "logprob is below this: the next tier (held "
                                                                    "back until it is checked)")


class MeshSpec(_Strict):
    """A unit that routes each request over tiers of other units by its SLA and their live state."""

    tiers: list[Annotated[str, StringConstraints(pattern=UNIT_NAME)]] = Field(
        ..., min_length=1, max_length=8, description="units in escalation order (e.g. small, medium, large)")
    ttft_budget_ms: float = Field(2000.0, gt=0, description="a request's TTFT budget unless it sends "
                                                            "X-SITS-TTFT-Budget-Ms")
    cost_cap: float | None = Field(None, gt=0, description="the most a request may cost on a tier (the tier's "
                                                           "pricing); X-SITS-Cost-Cap overrides")
    max_tokens: int = Field(1024, ge=1, description="new tokens for a request that asks for no limit")
    escalate: MeshEscalationSpec = Field(default_factory=MeshEscalationSpec)

    @field_validator("tiers")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("a tier is listed twice")
        return v


class SamplingDefaultsSpec(_Strict):
    """What a request that leaves a sampling parameter unset gets from this unit: over the model's own
    ``generation_config.json`` (as vLLM's ``--override-generation-config``)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    max_tokens: int | None = Field(None, ge=1, description="a default cap on new tokens")

    def overrides(self) -> dict[str, float]:
        return self.model_dump(exclude_none=True)


# host directories a tool must never be handed: trees of kernel interfaces, devices, configuration
# and secrets (at any depth), and directories that hold the whole system or everyone's files
_SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/boot", "/run")
_TOO_BROAD = ("/", "/root", "/home", "/usr", "/var", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/srv", "/mnt",
              "/media", "/tmp")


def _safe_host_dir(host: str, info: ValidationInfo) -> str:
    """Refuse a ``tool_dirs`` host directory that is (or, through ``..`` or a symlink, resolves to)
    the root or a system directory: ``file.read`` would read the whole disk or its secrets."""
    base = (info.context or {}).get("base") or os.getcwd()
    real = os.path.realpath(os.path.join(base, os.path.expanduser(host)))
    if (real in _TOO_BROAD or real == os.path.realpath(os.path.expanduser("~"))
            or any(real == t or real.startswith(t + "/") for t in _SYSTEM_TREES)):
        raise ValueError(f"{host!r} resolves to {real}: the root, a system directory or one holding far more "
                         "than a tool needs; map a directory made for the tool (e.g. ./data)")
    return host


HostDir = Annotated[str, AfterValidator(_safe_host_dir)]


class UnitSpec(_Strict):
    name: str = Field(..., pattern=UNIT_NAME, description="lowercase letters, digits, '.', '_', '-'")
    model: str | None = Field(None, min_length=1, description="a local Hugging Face model directory or .gguf file")
    backend: RemoteBackendSpec | None = Field(None, description="a remote unit: the OpenAI-compatible endpoint serving it")
    mesh: MeshSpec | None = Field(None, description="a mesh: requests routed over tiers of other units")
    prompt_template: str | None = Field(None, description="Jinja around the user input: {{ input }}")
    scale: ScaleSpec = Field(default_factory=ScaleSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    sla: SlaSpec = Field(default_factory=SlaSpec)
    fallback: str | None = Field(None, pattern=UNIT_NAME, description="the unit that serves while the breaker is open")
    faults: FaultsSpec | None = Field(None, description="fault injection (testing): see sits.faults")
    tools: list[str] = Field(default_factory=list, description='tool contracts it may call, e.g. "file.read@^1.2"')
    tool_dirs: dict[str, HostDir] = Field(default_factory=dict,
                                          description="host directory behind each guest directory a tool declares")
    python_tools: bool = Field(False, description="allow tools with runtime: python (a subprocess, not a sandbox)")
    memory: MemorySpec | None = Field(None, description="retrieval for every request (a RAG unit)")
    adapters: dict[Annotated[str, StringConstraints(pattern=ADAPTER_NAME)], str] = Field(
        default_factory=dict, description="LoRA adapters it serves: name -> PEFT folder (relative to the YAML); "
                                          "called as model '<unit>:<name>' or '<name>'")
    pricing: PricingSpec = Field(default_factory=PricingSpec,
                                 description="cost units per token, PFLOP and GB-hour (tenants' usage and budgets)")
    sampling: SamplingDefaultsSpec = Field(default_factory=SamplingDefaultsSpec,
                                           description="defaults for what a request leaves unset")

    @field_validator("tools")
    @classmethod
    def _tool_refs(cls, v: list[str]) -> list[str]:
        from sits.tools.semver import Constraint, SemverError, split_ref
        for ref in v:
            try:
                Constraint.parse(split_ref(ref)[1])
            except SemverError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _no_self_fallback(self) -> "UnitSpec":
        if self.fallback == self.name:
            raise ValueError(f"unit {self.name!r} cannot be its own fallback")
        return self

    @model_validator(mode="after")
    def _one_kind(self) -> "UnitSpec":
        kinds = [k for k in ("model", "backend", "mesh") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("a unit has one of model: (a local model), backend: (a remote endpoint) or mesh: "
                             "(tiers of other units)" + (f", not {' and '.join(kinds)}" if kinds else ""))
        if self.kind != "local":       # what runs on instances has no meaning for an endpoint or a mesh
            local_only = [f for f in ("adapters", "prompt_template") if getattr(self, f)]
            local_only += [f for f, default in (("scale", ScaleSpec()), ("resources", ResourcesSpec()))
                           if getattr(self, f) != default]
            if self.memory is not None and self.memory.embedder == "unit":
                local_only.append("memory.embedder: unit")
            if local_only:
                raise ValueError(f"a {self.kind} unit ({kinds[0]}:) takes no {', '.join(local_only)}: those "
                                 "configure a local model's instances")
        if self.mesh is not None and self.name in self.mesh.tiers:
            raise ValueError(f"mesh {self.name!r} cannot be one of its own tiers")
        return self

    @property
    def kind(self) -> Literal["local", "remote", "mesh"]:
        return "remote" if self.backend is not None else "mesh" if self.mesh is not None else "local"

    @property
    def remote(self) -> bool:
        return self.backend is not None

    @field_validator("prompt_template")
    @classmethod
    def _template_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(v)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"not a valid Jinja template: {e.message} (template line {e.lineno})") from None
        return v

    def standby_processes(self) -> int:
        """How many processes the zygote keeps ready for this unit's device (see ``ResourcesSpec.standby``)."""
        r = self.resources
        if r.standby is not None:
            return r.standby
        return 1 if resolve_device(r.device).type == "cuda" else 0

    def engine_config(self) -> EngineConfig:
        r = self.resources
        return EngineConfig(model=self.model, device=r.device, dtype=r.dtype, threads=r.threads, policy=r.policy,
                            num_kv_blocks=None if r.kv_blocks == "auto" else r.kv_blocks,
                            kv_cache_memory_mb=r.kv_cache_mb, max_model_len=r.max_model_len,
                            warmup=r.warmup is not False,
                            warmup_shapes="minimal" if r.warmup == "minimal" else "all",
                            quantization=r.quantization, gguf_weights=r.gguf_weights,
                            block_activations=r.block_activations, lora_adapters=tuple(self.adapters.items()),
                            enable_lora=r.lora, max_loras=r.max_loras, max_lora_rank=r.max_lora_rank)

    def render_prompt(self, user_input: str) -> str:
        if self.prompt_template is None:
            return user_input
        return jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(self.prompt_template).render(
            input=user_input)


class RuntimeConfig(_Strict):
    units: list[UnitSpec] = Field(default_factory=list)
    cluster: Literal["local", "ray"] = Field("local", description="local: instances forked on this host; ray: "
                                                                  "placed on the nodes of a Ray cluster")
    ray_address: str = Field("auto", min_length=1, description="with cluster: ray: auto (the running cluster), "
                                                               "an address, or local (start a one-node Ray here)")

    @model_validator(mode="after")
    def _unique(self) -> "RuntimeConfig":
        seen: set[str] = set()
        for u in self.units:
            if u.name in seen:
                raise ValueError(f"two units are named {u.name!r}")
            seen.add(u.name)
        return self


# -- YAML with positions --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SpecProblem:
    file: str
    line: int | None
    column: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = self.file + (f":{self.line}:{self.column}" if self.line is not None else "")
        return f"{where}: {self.field or '(top level)'}: {self.message}"


class UnitSpecError(SitsError):
    code = "invalid_unit_spec"
    http_status = 400

    def __init__(self, problems: list[SpecProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems), param=problems[0].field if problems else None)


def _to_python(node: yaml.Node, path: tuple, marks: dict[tuple, yaml.Mark]) -> Any:
    marks[path] = node.start_mark
    if isinstance(node, yaml.MappingNode):
        out = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise yaml.MarkedYAMLError(problem="a mapping key must be a plain value", problem_mark=k.start_mark)
            key = _scalar(k)
            marks[path + (key, "__key__")] = k.start_mark
            out[key] = _to_python(v, path + (key,), marks)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, path + (i,), marks) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: yaml.ScalarNode) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _allowed(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the last element of ``loc``."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        if inner:   # list[UnitSpec] and friends
            ann = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        model = ann
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def load_yaml_spec(text: str, file: str, root: type[BaseModel]) -> tuple[BaseModel, Path]:
    """Parse YAML text into ``root`` (UnitSpec or RuntimeConfig); raises UnitSpecError listing every problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise UnitSpecError([SpecProblem(file, mark.line + 1 if mark else None, mark.column + 1 if mark else None,
                                         "", f"not valid YAML: {e.problem or e}")]) from None
    except yaml.YAMLError as e:
        raise UnitSpecError([SpecProblem(file, None, None, "", f"not valid YAML: {e}")]) from None
    if node is None:
        raise UnitSpecError([SpecProblem(file, 1, 1, "", "the file is empty")])
    marks: dict[tuple, yaml.Mark] = {}
    try:
        data = _to_python(node, (), marks)
    except yaml.YAMLError as e:
        raise UnitSpecError([SpecProblem(file, None, None, "", f"not valid YAML: {e}")]) from None
    try:
        return root.model_validate(data, context={"base": str(Path(file).parent)}), Path(file).parent
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(err["loc"])
            mark = marks.get(loc + ("__key__",)) if err["type"] == "extra_forbidden" else None
            for cut in range(len(loc), -1, -1):
                if mark is not None:
                    break
                mark = marks.get(loc[:cut])
            field = ".".join(str(p) for p in loc)
            msg = err["msg"].removeprefix("Value error, ")
            owner = _model_at(root, loc)
            if err["type"] == "extra_forbidden":
                msg = f"unknown field {loc[-1]!r}" + (f"; allowed: {_allowed(owner)}" if owner else "")
            elif err["type"] == "missing":
                msg = "required"
            elif owner is not None and loc and loc[-1] in owner.model_fields:
                desc = owner.model_fields[loc[-1]].description
                if err["type"] == "string_pattern_mismatch" and desc:
                    msg = f"{err.get('input')!r} is not allowed; allowed: {desc}"
                elif desc and err["type"] != "value_error":
                    msg = f"{msg} ({desc})"
            problems.append(SpecProblem(file, mark.line + 1 if mark else None, mark.column + 1 if mark else None,
                                        field, msg))
        raise UnitSpecError(problems) from None


def _resolve_models(units: list[UnitSpec], base: Path) -> None:
    for u in units:
        u.tool_dirs = {g: str((base / h).resolve()) if not os.path.isabs(os.path.expanduser(h)) else
                       os.path.expanduser(h) for g, h in u.tool_dirs.items()}
        if u.memory is not None and u.memory.ingest and not os.path.isabs(os.path.expanduser(u.memory.ingest)):
            u.memory.ingest = str((base / u.memory.ingest).resolve())
        u.adapters = {n: str((base / p).resolve()) if not os.path.isabs(os.path.expanduser(p)) else
                      os.path.expanduser(p) for n, p in u.adapters.items()}
        if u.model is None:
            continue
        if not os.path.isabs(os.path.expanduser(u.model)):
            u.model = str((base / u.model).resolve())
        else:
            u.model = os.path.expanduser(u.model)


def load_unit_file(path: str | os.PathLike) -> UnitSpec:
    text = Path(path).read_text(encoding="utf-8")
    spec, base = load_yaml_spec(text, str(path), UnitSpec)
    _resolve_models([spec], base)   # type: ignore[list-item]
    return spec  # type: ignore[return-value]


def load_runtime_config(path: str | os.PathLike) -> RuntimeConfig:
    text = Path(path).read_text(encoding="utf-8")
    cfg, base = load_yaml_spec(text, str(path), RuntimeConfig)
    _resolve_models(cfg.units, base)   # type: ignore[attr-defined]
    return cfg  # type: ignore[return-value]
