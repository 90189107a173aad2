"""The paged Triton kernels compile for NVIDIA Hopper (sm_90: H100, H200) on a host without a GPU.

Triton's compiler and ``ptxas`` ship in its wheel, so the kernels can be lowered all the way to a
cubin here, with the constants the serving path picks for real models' shapes (``attention_constants``)
in every dtype, for decode and prefill steps. This catches what Triton's interpreter (which
``tests/test_cuda.py`` runs them through on a CPU) lets pass but the compiler refuses, and a launch
that would need more shared memory than the chip has. It runs in a child process: the interpreter is
chosen when Triton is imported, and this needs the compiler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sits.engine.layers import paged_attention as pa

kernels = pa._build()
target = GPUTarget("cuda", 90, 32)
DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ATTN_ARGS = ["out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "cu_seqlens_ptr", "seq_lens_ptr", "tables_ptr", "scale",
             "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h", "table_stride", "cache_stride_block",
             "cache_stride_pos", "cache_stride_head"]
results = []
# (model, heads, kv_heads, head_dim, window): SmolLM2, Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B, MHA + window
SHAPES = [("smollm2", 9, 3, 64, None), ("llama-1b", 32, 8, 64, None), ("llama-8b", 32, 8, 128, None),
          ("qwen2", 14, 2, 64, None), ("mha-window", 16, 16, 128, 4096)]
for name, heads, kv_heads, dim, window in SHAPES:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for query_len in (1, 512):
            const = pa.attention_constants(dtype, heads, kv_heads, dim, 16, query_len, window)
            sig = dict(zip(ATTN_ARGS, [f"*{DT[dtype]}"] * 4 + ["*i32"] * 3 + ["fp32"] + ["i32"] * 8))
            sig |= {c: "constexpr" for c in const}
            compiled = triton.compile(ASTSource(kernels["attention"], sig, constexprs=const), target=target)
            results.append({"kernel": "attention", "shape": name, "dtype": DT[dtype], "query_len": query_len,
                            "shared": compiled.metadata.shared})
    width = kv_heads * dim
    for dtype in (torch.bfloat16, torch.float32):
        sig = {"k_ptr": f"*{DT[dtype]}", "v_ptr": f"*{DT[dtype]}", "k_cache_ptr": f"*{DT[dtype]}",
               "v_cache_ptr": f"*{DT[dtype]}", "slot_ptr": "*i64", "k_stride": "i32", "v_stride": "i32",
               "WIDTH": "constexpr", "WIDTH_PAD": "constexpr"}
        const = dict(WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width))
        compiled = triton.compile(ASTSource(kernels["store_kv"], sig, constexprs=const), target=target)
        results.append({"kernel": "store_kv", "shape": name, "dtype": DT[dtype], "shared": compiled.metadata.shared})
print(json.dumps(results))
"""

HOPPER_SHARED_BYTES = 227 * 1024      # per block, opted in (H100/H200)


@pytest.mark.slow        # 40 kernels compiled from scratch: about 90 s on two cores
def test_paged_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 5 * 3 * 2 + 5 * 2
    too_big = [r for r in results if r["shared"] > HOPPER_SHARED_BYTES]
    assert not too_big, too_big
