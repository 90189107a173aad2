"""The CPU decode-attention kernel (``layers.cpu_attention``) against the reference gather + SDPA, and
the engine serving through it (``attention="cpp"``) against the reference path."""

from __future__ import annotations

import pytest
import torch

from sits.engine.config import EngineConfig, resolve_attention
from sits.engine.errors import UnsupportedModelError
from sits.engine.layers import cpu_attention, cpu_kernels
from sits.engine.layers.attention import decode_attention
from conftest import dense_greedy, greedy_mixed, require_cpu_kernel


@pytest.fixture(scope="module")
def kernel():
    return require_cpu_kernel()


def _reference(q, kv_cache, tables, lens, window):
    """The reference path's decode: the blocks gathered into a padded copy, a mask, SDPA."""
    b, w = tables.shape
    _, _, bs, kv_heads, dim = kv_cache.shape
    kv = kv_cache.flatten(2).index_select(1, tables.view(-1)).view(2, b, -1, kv_heads, dim).transpose(2, 3)
    k_pos = torch.arange(w * bs)[None, :]
    mask = k_pos < lens[:, None]
    if window:
        mask &= k_pos >= lens[:, None] - window
    return decode_attention(q.unsqueeze(2), kv[0], kv[1], mask[:, None, None, :]).squeeze(2)


def _case(batch, heads, kv_heads, dtype, seed=0, block_size=4, num_blocks=97, dim=16):
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    lens = torch.randint(1, 41, (batch,), generator=g)
    lens[0] = 1                                       # a sequence's first decode over one key
    width = int(-(-lens.max() // block_size)) + 1     # one padding block past the longest
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)   # scattered blocks
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, kv_cache, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (4, 4), (2, 1)])
@pytest.mark.parametrize("batch", [1, 2, 7])           # fewer sequences than threads: a task per KV head
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_equals_the_gathered_reference(kernel, dtype, heads, kv_heads, batch, window):
    q, kv_cache, tables, lens = _case(batch, heads, kv_heads, dtype, seed=batch * 31 + heads)
    got = cpu_attention.paged_decode(q, kv_cache, tables, lens, 16 ** -0.5, window)
    ref = _reference(q, kv_cache, tables, lens, window)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 5])     # 1: a task per KV head once threads > 1; 5: per sequence
def test_kernel_results_do_not_depend_on_the_thread_count(kernel, threads, batch):
    q, kv_cache, tables, lens = _case(batch, 8, 2, torch.float32, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode(q, kv_cache, tables, lens, 0.25, None)
        torch.set_num_threads(threads)
        assert torch.equal(cpu_attention.paged_decode(q, kv_cache, tables, lens, 0.25, None), one)
    finally:
        torch.set_num_threads(before)


def test_kernel_reads_strided_queries(kernel):
    q, kv_cache, tables, lens = _case(3, 4, 2, torch.float32, seed=5)
    wide = torch.cat([q, torch.zeros_like(q)], dim=1)[:, :4]       # rows of a wider tensor, as after a split
    assert not wide.is_contiguous()
    assert torch.equal(cpu_attention.paged_decode(wide, kv_cache, tables, lens, 0.25, None),
                       cpu_attention.paged_decode(q.contiguous(), kv_cache, tables, lens, 0.25, None))


def test_kernel_refuses_what_it_would_read_out_of_bounds(kernel):
    q, kv_cache, tables, lens = _case(2, 4, 2, torch.float32)
    bad = tables.clone()
    bad[1, 0] = kv_cache.shape[1]                     # a block past the cache's end
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_attention.paged_decode(q, kv_cache, bad, lens, 0.25, None)
    long = lens.clone()
    long[0] = tables.shape[1] * kv_cache.shape[2] + 1  # longer than its block table covers
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.paged_decode(q, kv_cache, tables, long, 0.25, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_attention.paged_decode(q.bfloat16(), kv_cache, tables, lens, 0.25, None)


def test_engine_serves_through_the_kernel_as_the_reference_does(kernel, make_engine):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 29, 11, 50, 1)]
    cpp = make_engine(attention="cpp", block_size=4, max_num_batched_tokens=16)
    ref = make_engine(attention="torch", block_size=4, max_num_batched_tokens=16)
    assert (cpp.attention, ref.attention) == ("cpp", "torch")
    got = greedy_mixed(cpp, prompts, 24)
    assert got == greedy_mixed(ref, prompts, 24)
    assert got[1] == dense_greedy(ref, prompts[1], 24)


def test_attention_resolves_to_the_kernel_on_a_cpu_only_where_it_is_on(kernel, monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu) == "cpp"
    monkeypatch.setenv("SITS_CPU_KERNELS", "0")
    assert resolve_attention("auto", cpu) == "torch"
    with pytest.raises(UnsupportedModelError, match="attention 'cpp'"):
        resolve_attention("cpp", cpu)
    with pytest.raises(ValueError, match="'cpp'"):
        EngineConfig(model="x", attention="paged")


def _load_in(cache: str, build: bool) -> str:
    """``kernel(build)`` in a fresh process with the kernel cache at ``cache``: what it loaded, or why not."""
    import os
    import subprocess
    import sys
    code = ("from sits.engine.layers import cpu_kernels as c\n"
            f"m = c.kernel(build={build})\n"
            "print('loaded' if m is not None else f'none: {c.kernel_error()}')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SITS_KERNEL_CACHE=cache))
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def test_a_broken_build_is_refused_and_a_whole_one_loads(kernel, tmp_path):
    """A library that does not load (a truncated file) leaves the reference path, not a crash; the
    published library loads from any cache directory."""
    name = cpu_kernels.build_name()
    (tmp_path / "broken" / name).mkdir(parents=True)
    (tmp_path / "broken" / name / f"{name}.so").write_bytes(b"\x7fELF truncated")
    assert _load_in(str(tmp_path / "broken"), build=False).startswith("none: ImportError")
    assert _load_in(str(tmp_path / "missing"), build=False) == "none: None"     # not built: no compile
    (tmp_path / "whole" / name).mkdir(parents=True)
    import shutil
    shutil.copyfile(kernel.__file__, tmp_path / "whole" / name / f"{name}.so")
    assert _load_in(str(tmp_path / "whole"), build=False) == "loaded"
