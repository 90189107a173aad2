// x @ weight.T (+ bias) for a few rows of fp32 activations on a CPU (see layers/linear.py).
//
// A decode step multiplies a handful of rows by every weight: the product is bound by reading the
// weight from memory, and a BLAS runs it as a matrix-vector product that may stay on one thread or
// re-read the weight per row. Here the weight's rows [out, in] are split across the threads in
// contiguous ranges, walked in tiles of about 16 KB; each tile is read from memory once and used for
// every activation row (four at a time, the tile staying in L1 between groups), with two 8-lane
// accumulators per activation row.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "few_rows.h"

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
              weight.is_contiguous(), "weight must be a contiguous fp32 [out, in] CPU tensor");
  const int64_t K = weight.size(1), N = weight.size(0);
  auto io = few_rows::rows_and_output(x, K, N);
  const int64_t M = io.rows.size(0);
  const float* xp = io.rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = io.y.data_ptr<float>();
  const int64_t tile = std::max<int64_t>(1, few_rows::kTileFloats / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      few_rows::rows_times_weight_all(xp, M, wp, K, yp, N, t0, t1);
    }
  });
  return few_rows::finish(io.y, bias, io.shape);
}
