"""A GGUF's block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K) served as the file's blocks (``layers.block_quant``): the C++ expansion equals gguf's own
dequantization (with AVX2, and in the portable build), the block matmul equals a matmul over the
dequantized weight to rounding at every row count, and an engine serving a GGUF from its blocks
(``gguf_weights``: blocks) picks the greedy tokens of the same engine over dequantized weights, in a
fraction of the memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import gguf
from gguf import GGMLQuantizationType as Q

from sits.engine.config import EngineConfig, resolve_gguf_blocks
from sits.engine.errors import UnsupportedModelError
from sits.engine.layers import block_quant
from sits.engine.layers.block_quant import BLOCK_TYPES, BlockEmbedding, BlockLinear, BlockWeight
from sits.engine.llm_engine import LLMEngine
from sits.engine.quantization import weight_bytes
from conftest import dense_greedy, greedy_mixed, require_cpu_kernel

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def kernel():
    return require_cpu_kernel()


def _cols(qtype: Q, n: int) -> int:
    """A row of ``n`` 32-value blocks, or of ``n`` K-quant super-blocks of 256 (``n`` // 3 + 1 of them)"""
    return n * 32 if BLOCK_TYPES[qtype.name][1] == 32 else (n // 3 + 1) * 256


def _blocks(qtype: Q, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """Random weights quantized by the gguf package (random well-formed blocks for the K-quants,
    which it cannot quantize), and gguf's dequantization of them."""
    from gguf_writer_util import K_QUANTS, random_kquant

    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        raw = random_kquant(rows, cols, qtype, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols))
    return BlockWeight(qtype.name, torch.from_numpy(raw.copy()), cols), want


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to rounding: the sums run in another order than the BLAS's."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item() + 1e-6)


@pytest.mark.parametrize("qtype", TYPES)
def test_expanded_blocks_are_ggufs_own_dequantization_exactly(kernel, qtype):
    cols = _cols(qtype, 3)
    bw, want = _blocks(qtype, 70, cols, seed=int(qtype))
    assert torch.equal(bw.dequantize(), want)
    buffer = torch.full((70 * cols + 50,), float("nan"))            # a reused buffer, larger than needed
    assert torch.equal(BlockLinear(bw).dequantized(5, 40, buffer), want[5:40])
    assert torch.equal(buffer[:35 * cols].view(35, cols), want[5:40]) and buffer[35 * cols:].isnan().all()
    with pytest.raises(RuntimeError, match="at least"):
        kernel.block_dequantize(bw.blocks, BLOCK_TYPES[qtype.name][0], cols, torch.empty(100))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 17, 33])
@pytest.mark.parametrize("out_f, blocks", [(1, 1), (67, 3), (300, 18)])
def test_block_matmul_equals_a_matmul_over_the_dequantized_weight(kernel, qtype, rows, out_f, blocks):
    """Every row count the kernel takes (in registers up to 16, through an expanded tile above)."""
    in_f = _cols(qtype, blocks)
    bw, w = _blocks(qtype, out_f, in_f, seed=rows + out_f)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=g)
    bias = torch.randn(out_f, generator=g)
    _close(kernel.block_linear(x, bw.blocks, BLOCK_TYPES[qtype.name][0], in_f), x @ w.T)
    _close(kernel.block_linear(x, bw.blocks, BLOCK_TYPES[qtype.name][0], in_f, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_layer_serves_decode_rows_from_blocks_and_prefill_from_dequantized_slices(kernel, qtype, monkeypatch):
    cols = _cols(qtype, 2)
    bw, w = _blocks(qtype, 200, cols, seed=3)
    layer = BlockLinear(bw)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for shape in [(1, cols), (2, 3, cols), (block_quant.KERNEL_MAX_ROWS, cols), (40, cols)]:
            x = torch.randn(*shape, generator=g)
            _close(layer(x), F.linear(x, w))
        monkeypatch.setattr(block_quant, "DEQUANT_SLICE_VALUES", cols * 30)   # a prefill in 7 slices of rows
        x = torch.randn(3, 20, cols, generator=g)
        _close(layer(x), F.linear(x, w))
    x = torch.randn(2, cols, requires_grad=True)        # autograd: through the dequantized weight
    layer(x).sum().backward()
    _close(x.grad, w.sum(0).expand(2, cols))


def _int8_rows(x: torch.Tensor, values: int) -> torch.Tensor:
    """x as the integer kernel sees it: each block of ``values`` quantized to int8 with dx = max |x| / 127
    (round half to even, as the kernel's conversion), then taken back to floats."""
    blocks = x.reshape(x.shape[0], -1, values)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16, 17, 32, 33])
@pytest.mark.parametrize("out_f, blocks", [(1, 1), (67, 3), (300, 18)])
def test_int8_activations_are_a_matmul_over_the_quantized_rows(kernel, qtype, rows, out_f, blocks):
    """``block_linear_int8``: up to 32 rows, the integer dot products equal the dequantized weight times
    the rows quantized per block to rounding; above, it is ``block_linear``'s fp32 arithmetic."""
    in_f = _cols(qtype, blocks)
    bw, w = _blocks(qtype, out_f, in_f, seed=rows + out_f)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=g) * torch.rand(1, in_f, generator=g) * 3     # uneven channels
    type_id, values = BLOCK_TYPES[qtype.name][:2]
    x[0, :values] = 0                                                                   # a zero block
    bias = torch.randn(out_f, generator=g)
    got = kernel.block_linear_int8(x, bw.blocks, type_id, in_f, bias)
    if rows > block_quant.INT8_MAX_ROWS:
        assert torch.equal(got, kernel.block_linear(x, bw.blocks, type_id, in_f, bias))
        return
    _close(got, F.linear(_int8_rows(x, values), w, bias))
    # and off the fp32 product by no more than half a quantization step of x times |w|'s row sums
    bound = 0.5 * (x.abs().amax(1, keepdim=True) / 127) * w.abs().sum(1) * 1.01 + 1e-5
    assert ((got - F.linear(x, w, bias)).abs() <= bound).all()


def test_block_layers_take_int8_activations_in_decode_only_when_asked(kernel):
    bw, w = _blocks(Q.Q4_K, 40, 512, seed=2)
    layer = BlockLinear(bw)
    x = torch.randn(block_quant.INT8_MAX_ROWS + 1, 512)
    with torch.inference_mode():
        _close(layer(x[:2]), F.linear(x[:2], w))
        layer.int8_activations = True
        _close(layer(x[:2]), F.linear(_int8_rows(x[:2], 256), w))
        _close(layer(x), F.linear(x, w))                  # a prefill's rows: fp32
        fused = block_quant.fuse_block_linears([layer, BlockLinear(bw)])
        assert fused.int8_activations


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_the_embedding_expands_only_the_rows_it_looks_up(kernel, qtype):
    bw, w = _blocks(qtype, 50, _cols(qtype, 2), seed=5)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    assert torch.equal(BlockEmbedding(bw)(ids), F.embedding(ids, w))


def test_projections_of_one_type_fuse_and_a_mix_does_not(kernel):
    from sits.engine.layers.linear import Linear, fuse_linears

    parts = [BlockLinear(_blocks(Q.Q4_1, n, 64, seed=n)[0]) for n in (32, 16, 16)]
    fused = fuse_linears(parts)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        _close(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    other = BlockLinear(_blocks(Q.Q8_0, 16, 64, seed=9)[0])
    assert fuse_linears([parts[0], other]) is None
    assert fuse_linears([parts[0], Linear(64, 16)]) is None


def test_malformed_blocks_are_refused(kernel):
    bw, _ = _blocks(Q.Q4_1, 4, 64, seed=1)
    with pytest.raises(ValueError):
        BlockWeight("Q3_K", bw.blocks, 64)
    with pytest.raises(ValueError):
        BlockWeight("Q4_1", bw.blocks, 96)              # rows of 64 values, not 96
    with pytest.raises(ValueError):
        BlockWeight("Q4_K", bw.blocks[:, :16], 128)     # a K-quant row is whole super-blocks of 256
    with pytest.raises(RuntimeError, match="bytes"):
        kernel.block_linear(torch.randn(1, 96), bw.blocks, 3, 96)
    with pytest.raises(RuntimeError, match="unknown block type"):
        kernel.block_dequantize(bw.blocks, 11, 64)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel.block_dequantize(bw.blocks, 12, 64)


# -- an engine over a GGUF file ------------------------------------------------------------------
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5)     # 256: a row is one K-quant super-block


def _mixed(name: str) -> Q:
    """Q4_1 projections, Q8_0 values and embeddings, Q4_0 downs: one file with every block type."""
    return Q.Q8_0 if name.startswith(("token_embd", "blk.1.attn_v")) else Q.Q4_0 if "ffn_down" in name else Q.Q4_1


def _k_mixed(name: str) -> Q:
    """As llama.cpp's Q4_K_M mixes them: Q4_K, with Q6_K values, downs and LM head; here also layer 1's
    q/k in Q5_K, its gate and up in Q5_0 and Q5_1, and layer 0's attention output in F16 (a type
    served dequantized)."""
    if name.startswith("output.") or "ffn_down" in name or "attn_v" in name:
        return Q.Q6_K
    return {"blk.1.attn_q": Q.Q5_K, "blk.1.attn_k": Q.Q5_K, "blk.1.ffn_gate": Q.Q5_0, "blk.1.ffn_up": Q.Q5_1,
            "blk.0.attn_output": Q.F16}.get(name.rsplit(".", 1)[0], Q.Q4_K)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from gguf_writer_util import spm_vocab, write_llama_gguf

    out = {}
    for name, qtype, tied in (("mixed-tied", _mixed, True), ("q4_1", Q.Q4_1, False), ("k-mixed", _k_mixed, False)):
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(spm_vocab()[0]), tie_word_embeddings=tied, **TINY)).eval()
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{name}.gguf"
        write_llama_gguf(path, hf, qtype)
        out[name] = str(path)
    return out


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", warmup=False, num_kv_blocks=96,
                                  block_size=4, max_num_batched_tokens=16, **kw))


@pytest.mark.parametrize("name", ["mixed-tied", "q4_1", "k-mixed"])
def test_an_engine_serves_a_gguf_from_its_blocks_as_from_dequantized_weights(kernel, gguf_files, name):
    blocks = _engine(gguf_files[name])                  # auto: blocks, on an fp32 CPU with the kernels
    dense = _engine(gguf_files[name], gguf_weights="dequantize")
    assert blocks.gguf_blocks and not dense.gguf_blocks
    kinds = {type(m).__name__ for m in blocks.model.modules()}
    layers = blocks.model.model.layers
    assert {"BlockLinear", "BlockEmbedding"} <= kinds
    if name == "k-mixed":           # F16 is dequantized at load: layer 0's o_proj alone is a dense Linear
        linears = [m for m in blocks.model.modules() if type(m).__name__ == "Linear"]
        assert linears == [layers[0].self_attn.o_proj]
        assert layers[1].mlp.gate_proj.qtype == "Q5_0" and blocks.model.lm_head.qtype == "Q6_K"
    else:
        assert "Linear" not in kinds
    if name == "mixed-tied":        # layer 1's v is Q8_0 beside Q4_1 q and k: its q/k/v stay apart
        assert layers[0].self_attn.qkv_proj is not None and layers[1].self_attn.qkv_proj is None
        assert blocks.model.lm_head.blocks is blocks.model.model.embed_tokens.blocks
    assert weight_bytes(blocks.model) < weight_bytes(dense.model) / 4
    vocab = blocks.model_config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [[1] + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]
    got = greedy_mixed(blocks, prompts, 12)
    assert got == greedy_mixed(dense, prompts, 12)
    assert got[1] == dense_greedy(dense, prompts[1], 12)
    with torch.inference_mode():
        ids = torch.tensor([prompts[2]])
        _close(blocks.model.forward_dense(ids), dense.model.forward_dense(ids))


def test_an_engine_with_int8_activations_decodes_through_the_integer_kernel(kernel, gguf_files, monkeypatch):
    """``block_activations: int8`` (engine, unit spec, its pod's arguments): the block layers take the
    integer kernel for a step's few rows, its logits near the fp32 engine's; generation runs; an fp32
    engine never calls it."""
    from sits.runtime.k8s_export import export_unit
    from sits.runtime.unit_spec import UnitSpec

    path = gguf_files["k-mixed"]
    calls = []
    real = kernel.block_linear_int8
    monkeypatch.setattr(kernel, "block_linear_int8", lambda *a: calls.append(a[2]) or real(*a))
    logits = {}
    ids = torch.tensor([[1] + list(range(3, 30))])       # 28 rows: the integer kernel's in int8
    for mode in ("fp32", "int8"):
        eng = _engine(path, block_activations=mode)
        with torch.inference_mode():
            logits[mode] = eng.model.forward_dense(ids)[0]
        blocks = [m for m in eng.model.modules() if isinstance(m, BlockLinear)]
        assert blocks and all(m.int8_activations == (mode == "int8") for m in blocks)
        g = torch.Generator().manual_seed(5)
        prompts = [[1] + torch.randint(3, eng.model_config.vocab_size, (n,), generator=g).tolist() for n in (4, 30)]
        assert [len(o) for o in greedy_mixed(eng, prompts, 8)] == [8, 8]
        assert bool(calls) == (mode == "int8")
    assert {BLOCK_TYPES[t][0] for t in ("Q4_K", "Q5_K", "Q6_K", "Q5_0")} <= set(calls)
    off = (logits["int8"] - logits["fp32"]).norm() / logits["fp32"].norm()
    assert 0 < off < 0.05
    with pytest.raises(ValueError):
        EngineConfig(model=path, block_activations="int4")
    spec = UnitSpec.model_validate({"name": "k", "model": path, "resources": {"block_activations": "int8"}})
    assert spec.engine_config().block_activations == "int8"
    args = export_unit(spec, "knative").manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--block-activations") + 1] == "int8"


def test_a_units_memory_counts_the_blocks_it_will_hold_not_their_dequantized_size(kernel, gguf_files):
    """The host check at deploy, the gateway's memory budget and a pod's limit count an instance's
    weights as loaded: a GGUF's blocks by the file's bytes where it serves them, fp32 values where it
    dequantizes them (several times the file)."""
    from sits.engine.config import ModelConfig
    from sits.engine.gguf_model import GGUFModel
    from sits.runtime.host_fit import instance_weight_bytes
    from sits.runtime.unit_spec import UnitSpec

    path = gguf_files["k-mixed"]
    mc = ModelConfig.from_dir(path)

    def spec(**resources) -> UnitSpec:
        return UnitSpec.model_validate({"name": "k", "model": path, "resources": {"device": "cpu", **resources}})

    state = _engine(path, gguf_weights="dequantize").model.state_dict()
    projections = sum(t.numel() for name, t in state.items() if name.endswith("proj.weight"))
    params = projections + sum(t.numel() for name, t in state.items() if "embed" in name or "lm_head" in name)
    values, nbytes = GGUFModel(path).block_tensors()
    assert values == params - 256 * 256                   # all but layer 0's o_proj (F16)
    assert instance_weight_bytes(spec(dtype="float32"), mc) == nbytes + 256 * 256 * 4
    assert instance_weight_bytes(spec(dtype="float32", gguf_weights="dequantize"), mc) == params * 4
    assert instance_weight_bytes(spec(dtype="bfloat16"), mc) == params * 2
    int8 = spec(dtype="float32", quantization="int8")          # the projections; embeddings and head stay fp32
    assert instance_weight_bytes(int8, mc) == projections + (params - projections) * 4
    assert nbytes + 256 * 256 * 4 < params * 4 / 4


def test_blocks_serve_only_fp32_on_a_cpu(kernel, gguf_files, tiny_model_dir):
    cpu, path = torch.device("cpu"), gguf_files["q4_1"]
    assert resolve_gguf_blocks("auto", path, cpu, torch.float32, None)
    assert not resolve_gguf_blocks("auto", path, cpu, torch.bfloat16, None)
    assert not resolve_gguf_blocks("auto", path, cpu, torch.float32, "int8")
    assert not resolve_gguf_blocks("dequantize", path, cpu, torch.float32, None)
    assert not resolve_gguf_blocks("blocks", str(tiny_model_dir), cpu, torch.float32, None)   # no GGUF: none
    for dtype, device, quant in ((torch.bfloat16, cpu, None), (torch.float32, torch.device("cuda"), None),
                                 (torch.float32, cpu, "int8")):
        with pytest.raises(UnsupportedModelError) as e:
            resolve_gguf_blocks("blocks", path, device, dtype, quant)
        assert e.value.param == "gguf_weights"
    with pytest.raises(ValueError):
        EngineConfig(model=path, gguf_weights="packed")


def test_the_step_bench_times_blocks_beside_the_dequantized_paths_for_an_fp32_gguf(kernel, gguf_files,
                                                                                    tiny_model_dir):
    from sits.bench.step_bench import available_paths

    assert available_paths("cpu", gguf_files["q4_1"], "float32") == ["reference", "cpp_attention", "cpp", "cpp_blocks",
                                                                        "cpp_blocks_int8"]
    assert "cpp_blocks" not in available_paths("cpu", gguf_files["q4_1"], "bfloat16")
    assert "cpp_blocks" not in available_paths("cpu", tiny_model_dir, "float32")


@pytest.mark.parametrize("arch", ["qwen2", "llama-biased"])
def test_biased_projections_keep_their_biases_in_blocks_and_qwen2_rows_stay_unpermuted(kernel, tmp_path, arch):
    """Qwen2 (q/k/v biases; llama.cpp does not permute its Q/K rows) and a Llama with attention and
    MLP biases (llama.cpp permutes its q/k biases with their rows), Q8_0 weights: the engine over the
    blocks and over dequantized weights both match transformers on the weights the file holds."""
    pytest.importorskip("transformers")
    import transformers
    from gguf_writer_util import spm_vocab, write_llama_gguf

    torch.manual_seed(0)
    vocab = len(spm_vocab()[0])
    if arch == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=vocab, tie_word_embeddings=False,
                                                                    **TINY)).eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, tie_word_embeddings=False, attention_bias=True, mlp_bias=True, **TINY)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)                      # biases that matter (they start at zero)
    path = tmp_path / f"tiny-{arch}.gguf"
    held = write_llama_gguf(path, hf, Q.Q8_0, arch="qwen2" if arch == "qwen2" else "llama")
    assert any(k.endswith("q_proj.bias") for k in held)
    hf.load_state_dict(held, strict=False)
    ids = torch.tensor([[1] + torch.randint(3, vocab, (20,), generator=torch.Generator().manual_seed(3)).tolist()])
    with torch.inference_mode():
        want = hf(input_ids=ids).logits[0].float()
    for mode in ("blocks", "dequantize"):
        eng = _engine(str(path), gguf_weights=mode)
        assert eng.gguf_blocks == (mode == "blocks")
        with torch.inference_mode():
            got = eng.model.forward_dense(ids)[0]
        assert (got - want).abs().max().item() <= 1e-4, mode
        out = greedy_mixed(eng, [ids[0].tolist()], 6)[0]
        assert out == dense_greedy(eng, ids[0].tolist(), 6)


@pytest.mark.slow
def test_the_portable_build_expands_every_type_as_gguf_does(tmp_path):
    """A CPU without AVX2 (an ARM Mac, an old x86) takes the kernels' portable branch: built here for
    plain x86-64, it must expand and multiply every block type as the AVX2 build does (its
    ``block_linear_int8`` multiplies fp32 rows: the integer kernel is AVX2's)."""
    import platform

    from sits.engine.layers.cpu_kernels import CSRC, build_block_kernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("builds the portable branch with -march=x86-64")
    portable = build_block_kernels("sits_block_quant_portable", CSRC, tmp_path, ("-O2", "-march=x86-64", "-fopenmp"))
    for qtype in TYPES:
        cols = _cols(qtype, 6)
        bw, w = _blocks(qtype, 67, cols, seed=int(qtype))
        type_id = BLOCK_TYPES[qtype.name][0]
        assert torch.equal(portable.block_dequantize(bw.blocks, type_id, cols), w), qtype.name
        for rows in (1, 5, 17):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
            _close(portable.block_linear(x, bw.blocks, type_id, cols), x @ w.T)
            assert torch.equal(portable.block_linear_int8(x, bw.blocks, type_id, cols),
                               portable.block_linear(x, bw.blocks, type_id, cols))
