"""The OpenTelemetry GenAI semantic conventions SITS emits, in one place.

Bucket boundaries are the conventions' advised ones, so Prometheus histograms and OTel
histograms line up bucket for bucket.
"""

from __future__ import annotations

# gen_ai.server.time_to_first_token (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# gen_ai.server.time_per_output_token
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# gen_ai.server.request.duration
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

PROVIDER = "sits"

# attribute names
OPERATION = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICES = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT = "gen_ai.usage.input_tokens"
USAGE_OUTPUT = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"

# SITS latency annotations
LEVEL = "sits.latency_sensitivity_level"      # L1 (most sensitive) .. L4
ASYNC_BOUNDARY = "sits.async_boundary"        # the span's work continues past a hand-off
ASYNC_MECHANISM = "sits.async_mechanism"      # queue | stream | callback | fork
SLO_VIOLATED = "sits.slo_violated"
