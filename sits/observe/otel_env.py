"""Which exporter a signal uses, from an explicit choice or the standard OpenTelemetry variables."""

from __future__ import annotations

import os

CHOICES = ("none", "console", "otlp", "memory")


def exporter_choice(signal: str, choice: str | None) -> str:
    """``signal``: "traces" or "metrics". Default: ``OTEL_<SIGNAL>_EXPORTER`` when it names one, else
    otlp when ``OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else none."""
    if choice is None:
        names = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
        if names and names != "otlp":
            choice = names.split(",")[0].strip()
        elif os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") or \
                os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            choice = "otlp"
        else:
            choice = "none"
    if choice not in CHOICES:
        raise ValueError(f"unknown {signal} exporter {choice!r}: {', '.join(CHOICES)}")
    return choice
