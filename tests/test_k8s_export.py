"""`sits iu export` (issue 21): a unit as a Knative Service or a KServe InferenceService running
`sits serve`, checked offline against the resources' own schemas (tests/k8s_schemas/), strictly:
a field the schema does not declare is an error, as with `kubectl apply --validate=strict`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from sits.engine.errors import InvalidRequestError
from sits.runtime.k8s_export import ExportOptions, export_unit
from sits.runtime.unit_spec import UnitSpec, load_unit_file

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(__file__).parent / "k8s_schemas"


def _strict(schema):
    """Unknown fields refused wherever the schema lists an object's properties (and does not keep unknown ones)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def validator(fmt: str) -> jsonschema.Draft7Validator:
    doc = json.loads((SCHEMAS / ("knative-service.schema.json" if fmt == "knative"
                                 else "kserve-inferenceservice.schema.json")).read_text())
    return jsonschema.Draft7Validator(_strict(doc["openAPIV3Schema"]))


def check(fmt: str, manifest: dict) -> None:
    errors = sorted(validator(fmt).iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def gpu_unit(tiny_model_dir) -> UnitSpec:
    return UnitSpec.model_validate({
        "name": "gpu-chat", "model": tiny_model_dir, "adapters": {"fruit": "/somewhere/fruit-lora"},
        "scale": {"min_instances": 1, "max_instances": 6, "keep_alive_s": 90, "downscale_delay_s": 20, "window_s": 3},
        "resources": {"device": "cuda", "threads": 4, "cpu_quota": 2.5, "max_model_len": 2048, "quantization": "int8",
                      "kv_cache_mb": 512}})


@pytest.mark.parametrize("fmt", ["knative", "kserve"])
def test_every_example_unit_exports_to_a_valid_resource(fmt):
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        spec = load_unit_file(path)
        if spec.kind != "local":
            continue
        check(fmt, export_unit(spec, fmt).manifest)


@pytest.mark.parametrize("fmt", ["knative", "kserve"])
def test_scale_and_resources_map_onto_the_resource(fmt, tiny_model_dir):
    spec = gpu_unit(tiny_model_dir)
    out = export_unit(spec, fmt, ExportOptions(image="registry.example/sits:1", namespace="llm", pvc="models",
                                               concurrency_target=4))
    m = out.manifest
    check(fmt, m)
    if fmt == "knative":
        annotations = m["spec"]["template"]["metadata"]["annotations"]
        pod = m["spec"]["template"]["spec"]
    else:
        annotations = m["metadata"]["annotations"]
        pod = m["spec"]["predictor"]
        assert (pod["minReplicas"], pod["maxReplicas"], pod["scaleTarget"]) == (1, 6, 4)
        assert annotations["serving.kserve.io/deploymentMode"] == "Serverless"
    assert annotations["autoscaling.knative.dev/min-scale"] == "1"
    assert annotations["autoscaling.knative.dev/max-scale"] == "6"
    assert annotations["autoscaling.knative.dev/scale-to-zero-pod-retention-period"] == "90s"
    assert annotations["autoscaling.knative.dev/scale-down-delay"] == "20s"
    assert annotations["autoscaling.knative.dev/window"] == "6s"        # Knative's smallest window
    c = pod["containers"][0]
    assert c["image"] == "registry.example/sits:1" and m["metadata"]["namespace"] == "llm"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["limits"]["cpu"] == "2500m"
    mem_mib = int(c["resources"]["limits"]["memory"].removesuffix("Mi"))
    weights = sum(p.stat().st_size for p in Path(tiny_model_dir).glob("*.safetensors"))
    assert mem_mib * 2**20 >= weights + 512 * 2**20          # weights + the KV pool + the runtime
    args = c["args"]
    assert args[:3] == ["serve", "--model", "/models/" + Path(tiny_model_dir).name]
    for flag, value in (("--device", "cuda"), ("--threads", "4"), ("--max-model-len", "2048"),
                        ("--quantization", "int8"), ("--served-model-name", "gpu-chat"),
                        ("--lora", "fruit=/models/adapters/fruit-lora")):
        assert args[args.index(flag) + 1] == value
    assert c["volumeMounts"][0]["mountPath"] == "/models" and pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert any("cpu_quota" in n for n in out.notes)


def test_the_strict_check_has_teeth(tiny_model_dir):
    m = export_unit(gpu_unit(tiny_model_dir), "kserve").manifest
    bad = copy.deepcopy(m)
    bad["spec"]["predictor"]["minReplica"] = 1            # a typo of minReplicas
    assert list(validator("kserve").iter_errors(bad))
    bad = copy.deepcopy(m)
    bad["spec"]["predictor"]["containers"][0]["resources"]["limits"]["cpu"] = "two"
    assert list(validator("kserve").iter_errors(bad))
    k = export_unit(gpu_unit(tiny_model_dir), "knative").manifest
    k["spec"]["template"]["spec"]["containers"][0]["port"] = 8080
    assert list(validator("knative").iter_errors(k))


def test_what_cannot_be_exported_is_refused_or_noted(tiny_model_dir):
    remote = UnitSpec.model_validate({"name": "r", "backend": {"openai": "http://h/v1"}})
    with pytest.raises(InvalidRequestError) as e:
        export_unit(remote, "knative")
    assert e.value.code == "unit_not_exportable"
    spec = UnitSpec.model_validate({"name": "x", "model": tiny_model_dir, "tools": ["math.eval@^1"], "fallback": "y",
                                    "scale": {"trigger": "ttft_p95 > 800ms"}})
    notes = " ".join(export_unit(spec, "kserve").notes)
    assert "scale.trigger" in notes and "tools" in notes and "fallback" in notes


def test_the_cli_writes_the_resource(tmp_path):
    out = tmp_path / "chat.yaml"
    r = subprocess.run([sys.executable, "-m", "sits.cli", "iu", "export", "--format", "kserve", "--file",
                        str(ROOT / "examples" / "chat-unit.yaml"), "--storage-uri", "s3://bucket/smollm2", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = yaml.safe_load(out.read_text())
    check("kserve", m)
    c = m["spec"]["predictor"]["containers"][0]
    assert {"name": "STORAGE_URI", "value": "s3://bucket/smollm2"} in c["env"] and "/mnt/models" in c["args"]
