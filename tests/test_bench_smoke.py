"""The engine benchmark runs end to end and writes the documented JSON keys and markdown section
(a smoke run of the code path, not a timing test: numbers on a shared CI host mean nothing)."""

from __future__ import annotations

import json

import pytest

from sits.bench.engine_bench import DOC_BEGIN, DOC_END, run_engine_bench


@pytest.mark.slow
def test_quick_engine_bench_writes_json_and_docs(tiny_model_dir, tmp_path):
    out, docs = tmp_path / "engine.json", tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro kept\n")
    run_engine_bench(tiny_model_dir, json_out=str(out), docs_out=str(docs), quick=True)
    data = json.loads(out.read_text())
    assert set(data["bursty"]) >= {"fcfs", "pfsd"}
    for pol in ("fcfs", "pfsd"):
        for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_cv", "itl_p50_ms", "itl_p99_ms", "throughput_tok_s"):
            assert data["bursty"][pol][key] > 0
        assert data["bursty"][pol]["num_requests"] == 12
    assert set(data["decode"]) == {"1", "8"}
    assert data["prefix"]["on"]["prefix_hit_rate"] > 0.5 and data["prefix"]["off"]["prefix_hit_rate"] == 0
    text = docs.read_text()
    assert "intro kept" in text and text.count(DOC_BEGIN) == 1 and DOC_END in text
    assert (tmp_path / "img" / "engine_bench.png").stat().st_size > 1000
    run_engine_bench(tiny_model_dir, docs_out=str(docs), quick=True, only=["prefix"])
    assert docs.read_text().count(DOC_BEGIN) == 1          # the section is replaced, not appended
