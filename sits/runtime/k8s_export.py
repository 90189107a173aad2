"""A unit as a Kubernetes resource that runs ``sits serve`` for it: a Knative Service, or a KServe
InferenceService (serverless mode, which runs on Knative). Scale-to-zero and the replica bounds come
from the unit's ``scale`` block, CPU, memory and GPU from its ``resources`` block.

What one ``sits serve`` cannot carry (the gateway's features: SLA breaker and fallback, tools,
memory, faults, LLM-native triggers) is listed in the result's ``notes`` rather than dropped silently.
Knative scales on in-flight requests: the unit's trigger has no equivalent there, so the
concurrency target is a parameter.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from sits.engine.errors import InvalidRequestError
from sits.runtime.unit_spec import UnitSpec

PORT = 8080
MIB = 1024 * 1024
RUNTIME_OVERHEAD_MIB = 768      # the interpreter, torch and the HTTP front end of one `sits serve`
KNATIVE_WINDOW_S = (6.0, 3600.0)    # the autoscaler window Knative accepts


@dataclass(slots=True)
class ExportOptions:
    image: str = "sits:latest"
    namespace: str | None = None
    model_path: str | None = None        # the model inside the container (default: /models/<its folder name>)
    pvc: str | None = None               # a PersistentVolumeClaim holding the models, mounted at /models
    storage_uri: str | None = None       # KServe: where its storage initializer fetches the model (to /mnt/models)
    concurrency_target: int = 8          # in-flight requests per replica before Knative adds one


@dataclass(slots=True)
class Export:
    manifest: dict
    notes: list[str] = field(default_factory=list)


def export_unit(spec: UnitSpec, fmt: str, opts: ExportOptions | None = None) -> Export:
    """The ``fmt`` (``knative`` or ``kserve``) resource for ``spec``, and what it leaves out."""
    opts = opts or ExportOptions()
    if spec.kind != "local":
        raise InvalidRequestError(f"unit {spec.name} is a {spec.kind} unit: it has no model of its own to serve "
                                  "from a pod (export its tiers or its endpoint's own deployment)",
                                  param="name", code="unit_not_exportable")
    if fmt not in ("knative", "kserve"):
        raise InvalidRequestError(f"format {fmt!r}: knative or kserve", param="format", code="invalid_parameter")
    notes = _left_out(spec)
    model_path = opts.model_path or ("/mnt/models" if fmt == "kserve" and opts.storage_uri
                                     else f"/models/{os.path.basename(os.path.normpath(spec.model))}")
    container = _container(spec, model_path, opts, notes, "kserve-container" if fmt == "kserve" else "sits")
    volumes = []
    if opts.pvc:
        container["volumeMounts"] = [{"name": "models", "mountPath": "/models", "readOnly": True}]
        volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": opts.pvc, "readOnly": True}}]
    elif not (fmt == "kserve" and opts.storage_uri):
        notes.append(f"the model is expected inside the image at {model_path} (or pass --pvc / --storage-uri)")
    annotations = _scale_annotations(spec, opts)
    meta = {"name": spec.name, "labels": {"app.kubernetes.io/name": "sits", "sits.dev/unit": spec.name}}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    sc = spec.scale
    if fmt == "knative":
        pod: dict = {"containerConcurrency": 0, "timeoutSeconds": 600, "containers": [container]}
        if volumes:
            pod["volumes"] = volumes
        manifest = {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": meta,
                    "spec": {"template": {"metadata": {"annotations": annotations}, "spec": pod}}}
    else:
        if opts.storage_uri:
            container.setdefault("env", []).append({"name": "STORAGE_URI", "value": opts.storage_uri})
        predictor: dict = {"minReplicas": sc.min_instances, "maxReplicas": sc.max_instances,
                           "scaleMetric": "concurrency", "scaleTarget": opts.concurrency_target,
                           "containerConcurrency": 0, "timeout": 600, "containers": [container]}
        if volumes:
            predictor["volumes"] = volumes
        meta["annotations"] = {"serving.kserve.io/deploymentMode": "Serverless", **annotations}
        manifest = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
                    "spec": {"predictor": predictor}}
    return Export(manifest, notes)


def _container(spec: UnitSpec, model_path: str, opts: ExportOptions, notes: list[str], name: str) -> dict:
    r = spec.resources
    args = ["serve", "--model", model_path, "--host", "0.0.0.0", "--port", str(PORT),
            "--served-model-name", spec.name, "--policy", r.policy, "--dtype", r.dtype,
            # the pod sees its one GPU as cuda:0, whatever cuda:N the unit names on its own host
            "--device", "cuda" if r.device.startswith("cuda") else r.device,
            "--kv-cache-mb", str(r.kv_cache_mb)]
    if r.threads is not None:
        args += ["--threads", str(r.threads)]
    if r.max_model_len is not None:
        args += ["--max-model-len", str(r.max_model_len)]
    if r.quantization is not None:
        args += ["--quantization", r.quantization]
    if r.gguf_weights != "auto":
        args += ["--gguf-weights", r.gguf_weights]
    if r.block_activations != "fp32":
        args += ["--block-activations", r.block_activations]
    if r.warmup is False:
        args += ["--no-warmup"]
    for adapter, path in spec.adapters.items():
        args += ["--lora", f"{adapter}=/models/adapters/{os.path.basename(os.path.normpath(path))}"]
    if spec.adapters:
        notes.append("LoRA adapters are expected under /models/adapters/<folder name> in the container")
    if r.lora and not spec.adapters:
        args += ["--enable-lora", "--max-loras", str(r.max_loras), "--max-lora-rank", str(r.max_lora_rank)]
    cpus = r.cpu_quota or r.threads or 1
    footprint = _memory_bytes(spec)
    if footprint is None:
        footprint = r.kv_cache_mb * MIB
        notes.append(f"the model {spec.model} is not on this host: the memory request counts the KV pool and the "
                     "runtime only; add the weights' size to it")
    memory_mib = RUNTIME_OVERHEAD_MIB + math.ceil(footprint / MIB)
    resources = {"requests": {"cpu": _cpu(cpus), "memory": f"{memory_mib}Mi"},
                 "limits": {"cpu": _cpu(cpus), "memory": f"{memory_mib}Mi"}}
    if r.device.startswith("cuda"):
        resources["limits"]["nvidia.com/gpu"] = "1"
        resources["requests"]["nvidia.com/gpu"] = "1"
    probe = {"httpGet": {"path": "/ready", "port": PORT}, "periodSeconds": 2, "failureThreshold": 3}
    return {"name": name, "image": opts.image, "command": ["sits"], "args": args,
            "ports": [{"name": "http1", "containerPort": PORT, "protocol": "TCP"}],
            "readinessProbe": probe, "resources": resources}


def _cpu(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


def _memory_bytes(spec: UnitSpec) -> int | None:
    """Weights plus the KV pool, as the gateway's host check counts them, the weights no less than their
    files (mapped while loading, also for a GPU) (None: the model is not here)."""
    from sits.engine.config import ModelConfig
    from sits.runtime.host_fit import file_weight_bytes, instance_weight_bytes, kv_pool_bytes
    try:
        mc = ModelConfig.from_dir(spec.model)
        return max(file_weight_bytes(spec.model), instance_weight_bytes(spec, mc)) + kv_pool_bytes(spec, mc)
    except Exception:  # noqa: BLE001 - exporting for a model that lives elsewhere
        return None


def _scale_annotations(spec: UnitSpec, opts: ExportOptions) -> dict[str, str]:
    sc = spec.scale
    window = min(max(sc.window_s, KNATIVE_WINDOW_S[0]), KNATIVE_WINDOW_S[1])
    return {"autoscaling.knative.dev/min-scale": str(sc.min_instances),
            "autoscaling.knative.dev/max-scale": str(sc.max_instances),
            "autoscaling.knative.dev/metric": "concurrency",
            "autoscaling.knative.dev/target": str(opts.concurrency_target),
            "autoscaling.knative.dev/window": f"{window:g}s",
            "autoscaling.knative.dev/scale-down-delay": f"{sc.downscale_delay_s:g}s",
            "autoscaling.knative.dev/scale-to-zero-pod-retention-period": f"{sc.keep_alive_s:g}s"}


def _left_out(spec: UnitSpec) -> list[str]:
    out = []
    if spec.scale.trigger:
        out.append(f"scale.trigger {spec.scale.trigger!r}: Knative scales on concurrency (autoscaling.knative.dev/target)")
    if spec.fallback or spec.sla.model_dump() != type(spec.sla)().model_dump():
        out.append("sla / fallback: the SLA breaker is the gateway's (put the pod behind `sits up` as a remote unit)")
    for name, on in (("tools", spec.tools), ("memory", spec.memory), ("faults", spec.faults),
                     ("prompt_template", spec.prompt_template), ("sampling", spec.sampling.overrides()),
                     ("pricing", spec.pricing.model_dump(exclude_defaults=True))):
        if on:
            out.append(f"{name}: a gateway feature; `sits serve` does not take it")
    if spec.resources.cpu_quota is not None:
        out.append(f"resources.cpu_quota {spec.resources.cpu_quota:g} became the pod's CPU request and limit")
    return out
