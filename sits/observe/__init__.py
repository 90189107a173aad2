"""Observability shared by every layer: OpenTelemetry spans per request stage, GenAI metrics.

Cross-cutting (DESIGN.md): ``api`` and ``runtime`` record into it; it imports neither.
"""
