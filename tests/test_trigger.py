"""Scale triggers: parsed safely, unit-checked, errors that point at the column; fuzzed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sits.runtime.trigger import METRICS, TriggerError, parse_trigger


@pytest.mark.parametrize("src,metrics,expected", [
    ("ttft_p95 > 800ms || kv_util > 85%", {"ttft_p95": 900, "kv_util": 0.1}, True),
    ("ttft_p95 > 800ms || kv_util > 85%", {"ttft_p95": 700, "kv_util": 0.9}, True),
    ("ttft_p95 > 800ms || kv_util > 85%", {"ttft_p95": 700, "kv_util": 0.5}, False),
    ("ttft_p95 > 0.8s", {"ttft_p95": 801}, True),
    ("kv_util >= 0.85", {"kv_util": 0.85}, True),
    ("queue_depth > 4 && rps >= 10", {"queue_depth": 5, "rps": 10}, True),
    ("queue_depth > 4 && rps >= 10", {"queue_depth": 5, "rps": 9}, False),
    ("!(queue_depth == 0)", {"queue_depth": 0}, False),
    ("!!(queue_depth == 0)", {"queue_depth": 0}, True),
    ("a || b".replace("a", "rps > 1").replace("b", "rps < 0"), {"rps": 0.5}, False),
    ("slo_health < 75%", {"slo_health": 0.5}, True),
    ("800ms < ttft_p95", {"ttft_p95": 900}, True),
    ("itl_p95 > latency_p95", {"itl_p95": 3, "latency_p95": 2}, True),
    ("gpu_util > 50%", {}, False),                         # no data (no GPU): false, not an error
    ("queue_depth > 1 || queue_depth > 2 && rps > 100", {"queue_depth": 5, "rps": 0}, True),  # && binds tighter
])
def test_evaluates(src, metrics, expected):
    assert parse_trigger(src).evaluate(metrics) is expected


@pytest.mark.parametrize("src,column,words", [
    ("ttft_p95 > 800", 12, "ms or s"),
    ("kv_util > 85ms", 11, "ratio"),
    ("queue_depth > 5%", 15, "count"),
    ("ttfb_p95 > 1s", 1, "unknown metric"),
    ("ttft_p95 > 1s &&", 17, "expected a metric"),
    ("(rps > 1", 9, "')'"),
    ("rps > 1 rps", 9, "'&&', '||'"),
    ("rps = 1", 5, "unexpected character"),
    ("1 > 2", 1, "needs a metric"),
    ("ttft_p95 > kv_util", 12, "cannot be compared"),
    ("ttft_p95 > 5m", 12, "unknown unit"),
    ("", 1, "empty"),
    ("rps", 4, "a comparison"),
])
def test_errors_point_at_the_column(src, column, words):
    with pytest.raises(TriggerError) as e:
        parse_trigger(src)
    assert e.value.column == column, e.value.message
    assert words in e.value.message
    assert e.value.code == "invalid_trigger"
    assert e.value.message.splitlines()[-1].index("^") - 2 == column - 1   # the caret is under the column


def test_metrics_listed():
    assert parse_trigger("ttft_p95 > 1s || !(kv_util < 50%)").metrics() == {"ttft_p95", "kv_util"}


ALPHABET = st.sampled_from(list("()!&|<>=%. 0123456789msx_") + list(METRICS) + ["&&", "||", ">=", "ms", "s"])


@settings(max_examples=600, deadline=None)
@given(st.lists(ALPHABET, max_size=30).map("".join))
def test_fuzz_only_ever_raises_its_own_error(src):
    try:
        trig = parse_trigger(src)
    except TriggerError:
        return
    trig.evaluate({name: 1.0 for name in METRICS})
    trig.evaluate({})


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_arbitrary_text(src):
    try:
        parse_trigger(src)
    except TriggerError:
        pass


def test_deep_nesting_is_a_typed_error():
    with pytest.raises(TriggerError):
        parse_trigger("(" * 400 + "rps > 1" + ")" * 400)
    with pytest.raises(TriggerError):
        parse_trigger("!" * 5000 + "rps > 1")
