"""The served OpenAPI schema is accurate: a bounded schemathesis run against a live server finds no
5xx, and every response matches its documented status code, content type and body schema.

Each operation's cases come from schemathesis' Hypothesis strategy and are driven by plain
``@given`` (schemathesis' lazy pytest loader does not support pytest >= 9.2 yet)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from sits.api.context import ServerSettings

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 15      # per operation and mode in the fast suite; the slow suite sends 60


@pytest.fixture(scope="module")
def api_schema(serve_tiny):
    # a short context bounds the work any generated request can ask for
    srv = serve_tiny(ServerSettings(drain_grace_s=0.5, request_retention_s=5), max_model_len=48,
                     kv_cache_memory_mb=16)
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


def test_schema_lists_every_route(api_schema):
    labels = {op.label for op in _operations(api_schema)}
    for expected in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /v1/requests",
                     "GET /v1/requests/{request_id}", "GET /v1/requests/{request_id}/events",
                     "DELETE /v1/requests/{request_id}", "GET /health", "GET /ready", "GET /metrics"):
        assert expected in labels, labels


@pytest.mark.parametrize("examples", [EXAMPLES_PER_OPERATION, pytest.param(60, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_served_schema_holds(api_schema, mode, examples):
    failures = []
    for op in _operations(api_schema):
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            run()
        except Unsatisfiable:   # negative mode: an operation without inputs has no invalid request
            assert mode is GenerationMode.NEGATIVE, op.label
        except Exception as e:  # collect every operation's failure, then report them all
            failures.append(f"{op.label}: {e}")
    assert not failures, "\n\n".join(failures)
