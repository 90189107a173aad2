"""The C++ few-row matmul (``cpu_kernels.few_rows_linear``) against ``F.linear``, the ``Linear`` layer
routing through it, and the engine serving through it (``linear="cpp"``) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.engine.config import EngineConfig, resolve_cpu_kernel
from sits.engine.errors import UnsupportedModelError
from sits.engine.layers.linear import FEW_ROWS_MAX, Linear, split_linears, use_cpu_kernel
from conftest import dense_greedy, greedy_mixed, require_cpu_kernel


@pytest.fixture(scope="module")
def kernel():
    return require_cpu_kernel()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to rounding: the kernel sums in another order than the BLAS."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item() + 1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, FEW_ROWS_MAX])
@pytest.mark.parametrize("out_f, in_f", [(1, 16), (3, 37), (130, 64), (257, 576), (64, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(kernel, rows, out_f, in_f, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_f + in_f)
    x = torch.randn(rows, in_f, generator=g)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    _close(kernel.few_rows_linear(x, w, b), F.linear(x, w, b))


def test_kernel_takes_any_leading_shape_and_strided_rows(kernel):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    x3 = torch.randn(2, 3, 24, generator=g)
    _close(kernel.few_rows_linear(x3, w), F.linear(x3, w))
    wide = torch.randn(5, 48, generator=g)[:, ::2]           # rows not contiguous
    _close(kernel.few_rows_linear(wide, w), F.linear(wide, w))
    assert kernel.few_rows_linear(torch.empty(0, 24), w).shape == (0, 40)


def test_kernel_results_do_not_depend_on_the_thread_count(kernel):
    """Each output is one thread's sum in one order, however the weight's rows are split."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 300, generator=g), torch.randn(1000, 300, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.few_rows_linear(x, w)
        torch.set_num_threads(max(2, before))
        assert torch.equal(kernel.few_rows_linear(x, w), one)
    finally:
        torch.set_num_threads(before)


def test_kernel_refuses_what_it_cannot_compute(kernel):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.few_rows_linear(torch.randn(2, 16).bfloat16(), w.bfloat16())
    with pytest.raises(RuntimeError, match="in-features"):
        kernel.few_rows_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.few_rows_linear(torch.randn(2, 8), w.t())
    with pytest.raises(RuntimeError, match="bias"):
        kernel.few_rows_linear(torch.randn(2, 16), w, torch.randn(7))


def test_linear_routes_few_rows_through_the_kernel_when_serving(kernel):
    g = torch.Generator().manual_seed(3)
    layer = Linear(32, 48, bias=True)
    layer.weight = torch.nn.Parameter(torch.randn(48, 32, generator=g), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False)
    split_linears(layer)
    assert use_cpu_kernel(layer, True) == 1
    few, many = torch.randn(FEW_ROWS_MAX, 32, generator=g), torch.randn(FEW_ROWS_MAX + 1, 32, generator=g)
    with torch.inference_mode():
        assert torch.equal(layer(few), kernel.few_rows_linear(few, layer.weight, layer.bias))
        _close(layer(many), F.linear(many, layer.weight, layer.bias))
    # with autograd on (training) it takes torch's path, whose backward reaches the input
    x = few.clone().requires_grad_()
    layer(x).sum().backward()
    assert x.grad is not None and torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    assert use_cpu_kernel(layer, False) == 0 and not layer.cpu_kernel


def test_only_fp32_cpu_linears_take_the_kernel(kernel):
    layer = Linear(16, 8)
    layer.weight = torch.nn.Parameter(torch.randn(8, 16).bfloat16(), requires_grad=False)
    assert use_cpu_kernel(layer, True) == 0 and not layer.cpu_kernel


def test_engine_serves_through_the_kernel_as_the_reference_does(kernel, make_engine):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 29, 11, 50, 1)]
    cpp = make_engine(linear="cpp", dtype="float32", block_size=4, max_num_batched_tokens=16)
    ref = make_engine(linear="torch", dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert (cpp.linear, ref.linear) == ("cpp", "torch")
    outs = [greedy_mixed(eng, prompts, 24) for eng in (cpp, ref)]   # steps of 1 to 16 rows
    assert outs[0] == outs[1]
    assert outs[0][1] == dense_greedy(ref, prompts[1], 24)


def test_kernels_resolve_for_fp32_on_a_cpu_only_where_it_is_on(kernel, monkeypatch):
    cpu = torch.device("cpu")
    for knob in ("linear", "elementwise"):
        assert resolve_cpu_kernel(knob, "auto", cpu, torch.float32) == "cpp"
        assert resolve_cpu_kernel(knob, "auto", cpu, torch.bfloat16) == "torch"
        assert resolve_cpu_kernel(knob, "auto", torch.device("cuda"), torch.float32) == "torch"
        with pytest.raises(UnsupportedModelError, match="bfloat16"):
            resolve_cpu_kernel(knob, "cpp", cpu, torch.bfloat16)
        with pytest.raises(ValueError, match="'cpp'"):
            EngineConfig(model="x", **{knob: "blas"})
    monkeypatch.setenv("SITS_CPU_KERNELS", "0")
    for knob in ("linear", "elementwise"):
        assert resolve_cpu_kernel(knob, "auto", cpu, torch.float32) == "torch"
        with pytest.raises(UnsupportedModelError, match=f"{knob} 'cpp'"):
            resolve_cpu_kernel(knob, "cpp", cpu, torch.float32)
