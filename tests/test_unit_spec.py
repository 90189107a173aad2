"""Unit specs from YAML: defaults, relative model paths, and every error with file, line and field."""

from __future__ import annotations

import pytest

from sits.runtime.unit_spec import (RuntimeConfig, UnitSpec, UnitSpecError, load_runtime_config, load_unit_file,
                                    load_yaml_spec)

GOOD = """\
name: chat
model: ./models/tiny            # a local HF directory
prompt_template: "Q: {{ input }}\\nA:"
scale: {min_instances: 0, max_instances: 4, keep_alive_s: 300,
        trigger: "ttft_p95 > 800ms || kv_util > 85%"}
slo: {ttft_ms: 2000, itl_ms: 500, tps: 1200, target_health: 0.75}
resources: {device: auto, threads: 2, kv_blocks: auto}
"""


def test_the_documented_example_loads(tmp_path):
    f = tmp_path / "unit.yaml"
    f.write_text(GOOD)
    spec = load_unit_file(f)
    assert spec.name == "chat" and spec.scale.max_instances == 4 and spec.slo.tps == 1200
    assert spec.model == str((tmp_path / "models" / "tiny").resolve())      # relative to the file
    assert spec.render_prompt("hi") == "Q: hi\nA:"
    cfg = spec.engine_config()
    assert cfg.threads == 2 and cfg.num_kv_blocks is None and cfg.model == spec.model


def test_runtime_config_with_two_units(tmp_path):
    f = tmp_path / "sits.yaml"
    f.write_text("units:\n  - {name: a, model: /m/a}\n  - name: b\n    model: /m/b\n    scale: {min_instances: 1}\n")
    cfg = load_runtime_config(f)
    assert [u.name for u in cfg.units] == ["a", "b"] and cfg.units[1].scale.min_instances == 1


def _problems(text: str, root=UnitSpec):
    with pytest.raises(UnitSpecError) as e:
        load_yaml_spec(text, "u.yaml", root)
    return e.value.problems


@pytest.mark.parametrize("text,line,field,words", [
    ("name: chat\nmodel: m\nscal: {}\n", 3, "scal", "allowed: name, model"),
    ("name: chat\nmodel: m\nscale:\n  max_instance: 3\n", 4, "scale.max_instance", "allowed: min_instances"),
    ("name: Chat Bot\nmodel: m\n", 1, "name", "lowercase"),
    ("model: m\n", 1, "name", "required"),
    ("name: c\nmodel: m\nscale: {trigger: 'ttft_p95 > 800'}\n", 3, "scale.trigger", "ms or s"),
    ("name: c\nmodel: m\nscale: {min_instances: 5, max_instances: 2}\n", 3, "scale", "exceeds max_instances"),
    ("name: c\nmodel: m\nslo:\n  target_health: 2\n", 4, "slo.target_health", "less than or equal to 1"),
    ("name: c\nmodel: m\nresources: {device: tpu}\n", 3, "resources.device", "cuda:N"),
    ("name: c\nmodel: m\nresources: {kv_blocks: -3}\n", 3, "resources.kv_blocks", "positive"),
    ("name: c\nmodel: m\nprompt_template: '{{ input '\n", 3, "prompt_template", "Jinja"),
    ("name: c\nmodel: m\n  bad indent: [\n", 3, "", "not valid YAML"),
    ("", 1, "", "empty"),
])
def test_errors_name_file_line_and_field(text, line, field, words):
    p = _problems(text)[0]
    assert p.file == "u.yaml" and p.line == line, p
    assert p.field == field and words in p.message, p
    assert str(p).startswith(f"u.yaml:{line}:")


def test_all_problems_are_reported_at_once():
    probs = _problems("units:\n  - {name: a, model: m, scal: 1}\n  - {name: B, model: m}\n  - {name: a, model: m}\n",
                      RuntimeConfig)
    fields = [p.field for p in probs]
    assert "units.0.scal" in fields and "units.1.name" in fields
    dup = _problems("units:\n  - {name: a, model: m}\n  - {name: a, model: m}\n", RuntimeConfig)
    assert "two units are named 'a'" in dup[0].message
