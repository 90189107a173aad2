"""``sits bench peer``: llama.cpp's batched-bench table read as it prints it, and the refusals a run
without llama.cpp or without GGUF blocks gets (one line, exit 2)."""

from __future__ import annotations

import pytest

from sits.bench.peer_bench import parse_batched_bench, run_peer_bench

# llama-batched-bench's output on a 1B-shaped Q4_K_M file (2 threads), with the log lines around it
OUTPUT = """main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = auto, is_pp_shared = 0
llama_context: CPU compute buffer size =   262.51 MiB

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     32 |    1 |     96 |    0.248 |   258.55 |    0.471 |    67.89 |    0.719 |   133.54 |
|    64 |     32 |    4 |    384 |    0.961 |   266.48 |    1.293 |    98.99 |    2.254 |   170.38 |
|    64 |     32 |   16 |   1536 |    3.985 |   256.95 |    2.740 |   186.86 |    6.725 |   228.40 |

llama_perf_context_print:        load time =     181.52 ms
"""


def test_the_batched_bench_table_is_read_per_stream_count():
    assert parse_batched_bench(OUTPUT) == {1: 67.89, 4: 98.99, 16: 186.86}
    with pytest.raises(ValueError, match="no llama-batched-bench results"):
        parse_batched_bench("error: failed to load model\n")


def test_a_run_without_llama_cpp_or_without_blocks_is_refused(tmp_path, tiny_model_dir):
    from conftest import require_cpu_kernel
    from sits.cli import main

    require_cpu_kernel()
    with pytest.raises(ValueError, match="serves no GGUF blocks"):
        run_peer_bench(tiny_model_dir, str(tmp_path))          # a safetensors folder: nothing to compare
    with pytest.raises(ValueError, match="fp32 or int8"):
        run_peer_bench(tiny_model_dir, str(tmp_path), activations=("int4",))
    assert main(["bench", "peer", "--model", tiny_model_dir, "--llama-cpp", str(tmp_path)]) == 2
