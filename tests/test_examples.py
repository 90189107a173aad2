"""The unit files in examples/ load as `sits iu deploy` loads them, and every one the README names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sits.runtime.unit_spec import load_unit_file
from sits.tools import ToolRegistry

ROOT = Path(__file__).resolve().parent.parent
UNIT_FILES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", UNIT_FILES, ids=[p.name for p in UNIT_FILES])
def test_example_unit_loads_and_its_tools_resolve(path):
    spec = load_unit_file(path)
    if spec.remote:       # an endpoint, not a local model
        assert spec.backend.openai.startswith("http://127.0.0.1:") and spec.model is None
    else:
        assert spec.model == str((ROOT / "models" / "default").resolve())    # `make run` builds it
    for ref in spec.tools:
        ToolRegistry().resolve(ref)          # raises tool_not_found


def test_calc_unit_allows_what_the_readme_request_asks_for():
    spec = load_unit_file(ROOT / "examples" / "calc-unit.yaml")
    assert spec.name == "calc"
    assert [c.id for c in ToolRegistry().allowed(["math.eval@^1"], spec.tools)] == ["math.eval"]


def test_every_example_the_readme_names_exists():
    named = set(re.findall(r"examples/[\w./-]+\.yaml", (ROOT / "README.md").read_text()))
    assert named and all((ROOT / n).is_file() for n in named), sorted(n for n in named if not (ROOT / n).is_file())
