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
    iso = data["bursty"]["isolated"]          # the floor: each request alone on an idle engine
    assert iso["num_requests"] == 12 and iso["ttft_cv"] > 0
    assert iso["ttft_p50_ms"] <= data["bursty"]["fcfs"]["ttft_p50_ms"]
    assert set(data["decode"]) == {"1", "8"}
    assert data["prefix"]["on"]["prefix_hit_rate"] > 0.5 and data["prefix"]["off"]["prefix_hit_rate"] == 0
    text = docs.read_text()
    assert "Each request alone on an idle engine" in text
    assert "intro kept" in text and text.count(DOC_BEGIN) == 1 and DOC_END in text
    assert (tmp_path / "img" / "engine_bench.png").stat().st_size > 1000
    run_engine_bench(tiny_model_dir, docs_out=str(docs), quick=True, only=["prefix"])
    assert docs.read_text().count(DOC_BEGIN) == 1          # the section is replaced, not appended


@pytest.mark.slow       # a benchmark's smoke run: minutes of the fast suite on 2 cores (CI runs it)
def test_serve_bench_against_a_running_server_writes_json_and_docs(serve_tiny, tmp_path):
    """`sits bench serve --url` on a live server: every level completes, overhead is measured per request."""
    from sits.bench import serve_bench
    srv = serve_tiny()
    out, docs = tmp_path / "serve.json", tmp_path / "benchmarks.md"
    result = serve_bench.run_serve_bench(url=srv.url, model_dir=None, model=None, concurrency=[1, 4],
                                         num_requests=8, prompt_words=16, max_tokens=8, chat=True, repeats=1,
                                         json_out=str(out), docs_out=str(docs))
    levels = json.loads(out.read_text())["modes"]["server"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["errors"] == 0 and lv["requests"] == 8
        assert lv["throughput_tok_s"] > 0 and lv["prompt_tokens_mean"] > 0
        assert 0 < lv["engine_ttft_p50_ms"] <= lv["ttft_p50_ms"]
        assert lv["overhead_p50_ms"] >= 0 and lv["overhead_p99_ms"] < lv["ttft_p99_ms"]
    text = docs.read_text()
    assert text.count(serve_bench.DOC_BEGIN) == 1 and "engine mode `server`" in text
    assert (tmp_path / "img" / "serve_bench.png").stat().st_size > 1000
    assert result["modes"]["server"][0]["itl_p50_ms"] > 0


@pytest.mark.slow
def test_coldstart_bench_measures_naive_cold_and_warm(tiny_model_dir, tmp_path):
    from sits.bench import coldstart_bench
    out, docs = tmp_path / "coldstart.json", tmp_path / "benchmarks.md"
    r = coldstart_bench.run_coldstart_bench(tiny_model_dir, repeats=1, json_out=str(out), docs_out=str(docs))
    data = json.loads(out.read_text())
    for key in ("naive_ms", "sits_cold_ms", "sits_warm_ms", "ratio_cold_vs_naive", "phases_ms"):
        assert data[key], key
    assert r["sits_cold_ms"] < r["naive_ms"] and "fork" in r["phases_ms"]
    assert coldstart_bench.DOC_BEGIN in docs.read_text()


@pytest.mark.slow
def test_tracing_bench_compares_off_and_on(tiny_model_dir, tmp_path):
    from sits.bench.tracing_bench import DOC_BEGIN, run_tracing_bench
    docs = tmp_path / "bench.md"
    r = run_tracing_bench(tiny_model_dir, concurrency=[1], repeats=1, rounds=1, json_out=str(tmp_path / "t.json"),
                          docs_out=str(docs), engine="thread")
    [row] = r["table"]
    assert row["ttft_p50_ms_off"] > 0 and row["ttft_p50_ms_on"] > 0 and row["ttft_ratio"] > 0
    text = docs.read_text()
    assert DOC_BEGIN in text and "| 1 |" in text and "sits bench tracing" in text


def test_guided_bench_compares_free_guided_and_jump_forward(tiny_model_dir, tmp_path):
    from sits.bench.guided_bench import DOC_BEGIN as G_BEGIN, run_guided_bench
    docs = tmp_path / "benchmarks.md"
    r = run_guided_bench(tiny_model_dir, concurrency=2, rounds=1, max_tokens=64, threads=1,
                         json_out=str(tmp_path / "g.json"), docs_out=str(docs))
    assert r["free_ms_per_token"] > 0 and r["guided_ms_per_token"] > 0 and r["jf_wall_s"] > 0
    assert json.loads((tmp_path / "g.json").read_text())["jump_forward_speedup"] == r["jump_forward_speedup"]
    assert docs.read_text().count(G_BEGIN) == 1


@pytest.mark.slow       # a benchmark's smoke run (about 10 s on 2 cores; CI runs it)
def test_sampler_bench_runs_every_variant_in_its_own_process(tmp_path):
    """`sits bench sampler`: the heap and mmap variants (and an old checkout, here this one) each
    measure every case; the docs section carries the table and the plot."""
    from pathlib import Path

    from sits.bench import sampler_bench
    checkout = str(Path(sampler_bench.__file__).resolve().parents[2])
    docs = tmp_path / "benchmarks.md"
    r = sampler_bench.run_sampler_bench(batch=4, vocab=2048, rounds=1, seconds=0.01, baseline_code=checkout,
                                        docs_out=str(docs))
    assert r["variants"][:2] == ["heap", "mmap"] and len(r["variants"]) == 3
    for variant in r["variants"]:
        assert set(r["median_us"][variant]) == set(sampler_bench.CASES)
        assert all(us > 0 for us in r["median_us"][variant].values())
    text = docs.read_text()
    assert text.count(sampler_bench.DOC_BEGIN) == 1 and "mmap / heap" in text
    assert (tmp_path / "img" / "sampler_bench.png").stat().st_size > 1000


@pytest.mark.slow       # a benchmark's smoke run: minutes of the fast suite on 2 cores (CI runs it)
def test_dtype_bench_measures_each_dtype_against_fp32(tiny_model_dir, tmp_path):
    """`sits bench dtype`: every dtype measured in its own process; auto is reported as what it resolved to."""
    from sits.bench import dtype_bench
    docs = tmp_path / "benchmarks.md"
    r = dtype_bench.run_dtype_bench(tiny_model_dir, dtypes=["float32", "bfloat16", "auto", "bfloat16+int8"],
                                    threads=1, rounds=1, prompt=32, steps=2, docs_out=str(docs), quality_tokens=300)
    assert r["resolved"] == {"float32": "float32", "bfloat16": "bfloat16", "auto": "float32",   # an fp32 checkpoint
                             "bfloat16+int8": "bfloat16+int8"}
    q = r["quality"]["bfloat16+int8"]
    assert q["tokens"] == 300 and 0 < q["greedy_agreement"] <= 1 and q["mean_kl"] >= 0
    assert all(r["median"][d][m] > 0 for d in r["dtypes"] for m in dtype_bench.METRICS)
    text = docs.read_text()
    assert text.count(dtype_bench.DOC_BEGIN) == 1 and "auto (= float32)" in text and "greedy agreement" in text
    assert (tmp_path / "img" / "dtype_bench.png").stat().st_size > 1000


def test_a_docs_tag_keeps_a_section_per_model(tmp_path):
    from sits.bench.common import publish
    begin, end = "<!-- sits bench x: begin -->", "<!-- sits bench x: end -->"

    def markdown(result, command):
        return f"{begin}\n## X\n\n{result['v']}\n\n{end}"

    docs = tmp_path / "b.md"
    for v, target in ((1, docs), (2, f"{docs}#big"), (3, docs), (4, f"{docs}#big")):
        publish({"v": v}, "x", markdown, begin, end, None, str(target))
    text = docs.read_text()
    assert text.count("## X") == 1 and text.count("## [big] X") == 1
    assert "\n3\n" in text and "\n4\n" in text and "\n1\n" not in text and "\n2\n" not in text
    assert text.count("<!-- sits bench x [big]: begin -->") == 1


@pytest.mark.slow
def test_fairness_bench_runs_both_variants(tiny_model_dir, tmp_path):
    from sits.bench import fairness_bench
    out, docs = tmp_path / "fairness.json", tmp_path / "benchmarks.md"
    r = fairness_bench.run_fairness_bench(tiny_model_dir, duration_s=2.0, flood_rps=4.0, interactive_rps=2.0, repeats=1,
                                          threads=1, dtype="float32", max_num_batched_tokens=64,
                                          json_out=str(out), docs_out=str(docs))
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"off", "on", "ratios"} and data["requests"]["b"] > 0
    assert r["runs"]["on"][0]["b"]["requests"] == data["requests"]["b"]
    assert fairness_bench.DOC_BEGIN in docs.read_text() and (tmp_path / "img" / "fairness_bench.png").exists()


@pytest.mark.slow       # a benchmark's smoke run: minutes of the fast suite on 2 cores (CI runs it)
def test_mesh_bench_compares_the_large_tier_directly_and_the_mesh(tiny_model_dir, tmp_path):
    """`sits bench mesh`: both phases run against real servers and the docs section has its table."""
    from sits.bench.mesh_bench import DOC_BEGIN as M_BEGIN, run_mesh_bench
    docs = tmp_path / "benchmarks.md"
    r = run_mesh_bench(tiny_model_dir, rounds=1, requests=4, concurrency=2, max_tokens=4, block_ms=1500, share=1.0,
                       docs_out=str(docs))
    assert set(r["phases"]) == {"large directly", "mesh [large, small]"}
    assert r["phases"]["large directly"]["attainment"] == 0.0      # every request blocked past the SLO
    assert r["phases"]["mesh [large, small]"]["attainment"] >= 0.75    # the mesh gives up on large in time
    assert sum(r["mesh_served_by"].values()) == 4 and r["phases"]["mesh [large, small]"]["requests"] == 4
    assert M_BEGIN in docs.read_text() and (tmp_path / "img" / "mesh_bench.png").stat().st_size > 1000


@pytest.mark.slow       # a benchmark's smoke run: minutes of the fast suite on 2 cores (CI runs it)
def test_ray_bench_compares_a_remote_node_with_the_local_host(tiny_model_dir, tmp_path):
    """`sits bench ray`: both gateways (local zygote, a Ray worker node) serve, and both transports are timed."""
    pytest.importorskip("ray")
    from sits.bench.ray_bench import DOC_BEGIN as R_BEGIN, run_ray_bench
    docs = tmp_path / "benchmarks.md"
    r = run_ray_bench(tiny_model_dir, rounds=1, tokens=8, docs_out=str(docs))
    assert set(r["gateways"]) == {"local", "ray node"}
    assert all(g["cold_start_first_token_ms"] > 0 and g["itl_p50_ms"] > 0 for g in r["gateways"].values())
    assert r["transport"]["wire_tcp"]["n"] == r["transport"]["ray_streaming_generator"]["n"] == 400
    assert R_BEGIN in docs.read_text()


def test_step_bench_times_each_available_path_against_hf(tiny_model_dir, tmp_path):
    """On a CPU the reference path and the C++ kernels' paths run, taking turns (the paged ones need
    CUDA); the HF baseline runs beside them."""
    from sits.bench import step_bench
    out, docs = tmp_path / "step.json", tmp_path / "benchmarks.md"
    step_bench.run_step_bench(tiny_model_dir, dtype="float32", batch_sizes=(1, 4), context=16, steps=8, repeats=2,
                              json_out=str(out), docs_out=str(docs))
    data = json.loads(out.read_text())
    from sits.engine.layers import cpu_kernels
    cpp = cpu_kernels.kernel(build=False) is not None        # `make install` builds it
    assert data["paths"] == (["reference", "cpp_attention", "cpp"] if cpp else ["reference"]) and set(data["batches"]) == {"1", "4"}
    for row in data["batches"].values():
        assert row["reference_step_ms"] > 0 and row["hf_tok_s"] > 0 and row["reference_vs_hf"] > 0
        if cpp:
            assert row["cpp_step_ms"] > 0 and row["cpp_attention_step_ms"] > 0
            fastest = min(row["cpp_step_ms"], row["cpp_attention_step_ms"])
            assert row["speedup_vs_reference"] == row["reference_step_ms"] / fastest
    text = docs.read_text()
    assert step_bench.DOC_BEGIN in text and "| 4 |" in text
    assert (tmp_path / "img" / "step_bench.png").stat().st_size > 1000


def test_step_bench_runs_in_bf16_on_a_cpu(tiny_model_dir, tmp_path):
    """The cpp path takes what the dtype allows: bf16 keeps torch's matmuls and norms (the device
    check's CPU dry run times bf16)."""
    from sits.bench import step_bench
    out = tmp_path / "step.json"
    step_bench.run_step_bench(tiny_model_dir, dtype="bfloat16", batch_sizes=(2,), context=8, steps=4, repeats=1,
                              json_out=str(out), hf=False)
    data = json.loads(out.read_text())
    assert all(data["batches"]["2"][f"{p}_step_ms"] > 0 for p in data["paths"])


def test_shaped_models_have_the_real_parameter_counts_and_load(tmp_path, monkeypatch, tiny_model_dir):
    """Llama-3.2-1B and Llama-3.1-8B shapes count their published parameters; a small shape built by
    the same code loads into the engine and generates."""
    import math

    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    from sits.engine.sampling_params import SamplingParams
    from sits.modelbuild import shaped

    counts = {s: sum(math.prod(d) for d in shaped.parameter_shapes(shaped.shaped_config(s)).values())
              for s in shaped.SHAPES}
    assert counts == {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}
    monkeypatch.setitem(shaped.SHAPES, "mini", dict(shaped.SHAPES["llama-3.2-1b"], vocab_size=6000, hidden_size=64,
                                                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=16))
    path = shaped.build_shaped_model(tmp_path / "mini", "mini", max_positions=512, progress=None)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", warmup=False, kv_cache_memory_mb=8))
    assert eng.model_config.torch_dtype == "bfloat16" and eng.model_config.rope_scaling["rope_type"] == "llama3"
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 4 and max(out["token_ids"]) < 6000


def test_coldstart_bench_without_a_server_forks_the_engine(tiny_model_dir, tmp_path):
    """`--no-server` (a GPU host without the HTTP stack): cold = an engine forked from the benchmark's
    process to its first token, warm = the same engine's next request; run as a command (a fork from
    this test process, which has run torch's thread pools, would not be safe)."""
    import subprocess
    import sys

    out = tmp_path / "cold.json"
    subprocess.run([sys.executable, "-m", "sits.cli", "bench", "coldstart", "--model", tiny_model_dir, "--no-server",
                    "--skip-naive", "--repeats", "2", "--warmup", "minimal", "--json", str(out)],
                   check=True, capture_output=True, timeout=240)
    data = json.loads(out.read_text())
    assert len(data["sits_cold_runs_ms"]) == 2 and data["sits_cold_ms"] > data["sits_warm_ms"] > 0
    assert {"weights", "kv_allocation", "warmup_operator", "first_token"} <= set(data["phases_ms"])
    assert "no server" in data["host"]


@pytest.mark.slow       # a benchmark's smoke run (about 10 s on 2 cores; CI runs it)
def test_standby_bench_times_forked_and_standby_starts_alternating(tiny_model_dir, tmp_path):
    """`sits bench standby`: starts from a real zygote, one forked and one handed to a standby per
    round (the benchmark checks each start took the path it names), with a table and a plot."""
    import subprocess
    import sys

    out, docs = tmp_path / "standby.json", tmp_path / "benchmarks.md"
    subprocess.run([sys.executable, "-m", "sits.cli", "bench", "standby", "--model", tiny_model_dir, "--repeats", "1",
                    "--threads", "1", "--json", str(out), "--write-docs", str(docs)],
                   check=True, capture_output=True, timeout=240)
    data = json.loads(out.read_text())
    for mode in ("fork", "standby"):
        assert data["modes"][mode]["cold_ms"] > 0 and "kv_allocation" in data["modes"][mode]["phases_ms"]
    assert data["ratio_standby_vs_fork"] > 0
    text = docs.read_text()
    assert "| standby |" in text and (tmp_path / "img" / "standby_bench.png").exists()
