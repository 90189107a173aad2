// The Python module of the CPU kernels (see cpu_kernels.py). The GIL is released while a kernel
// runs, as torch's own operators do: the server's threads go on.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                           c10::optional<torch::Tensor> bias);
torch::Tensor block_linear_int8(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                                c10::optional<torch::Tensor> bias);
torch::Tensor block_dequantize(torch::Tensor blocks, int64_t qtype, int64_t in_features,
                               c10::optional<torch::Tensor> out);
void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor A, torch::Tensor B, torch::Tensor row_slots);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual);
void rope_store_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token decode attention over the paged KV cache, read in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("few_rows_linear", &few_rows_linear,
        "x @ weight.T (+ bias) for a few fp32 rows, each weight row streamed once across the threads",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("block_linear", &block_linear,
        "x @ W.T (+ bias) for fp32 rows, W as GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("in_features"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("block_linear_int8", &block_linear_int8,
        "block_linear with the activations quantized to 8 bits per block and integer dot products (few rows)",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("in_features"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("block_dequantize", &block_dequantize, "GGUF blocks (a type block_linear takes) as an fp32 [out, in] weight",
        py::arg("blocks"), py::arg("qtype"), py::arg("in_features"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add", &lora_add, "y[m] += B[s] @ (A[s] @ x[m]) for each row m and its adapter slot s (-1: none), fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, after adding x into residual in place if given",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_store_kv", &rope_store_kv, "RoPE on q and k in place, then k and v stored into their cache slots",
        py::call_guard<py::gil_scoped_release>());
}
