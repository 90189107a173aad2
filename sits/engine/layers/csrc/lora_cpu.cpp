// LoRA updates of a step's rows on a CPU, every row with its own adapter, in one call per projection
// (see engine/lora.py).
//
// Per row m with adapter slot s (or none): y[m] += B[s] (A[s] x[m]). torch runs this as several small
// matmuls, gathers and an index_add per projection, and at a decode step's few rows each of those costs
// far more in dispatch and threading than its arithmetic. Here: the rows' low-rank products u = A x
// (rows x rank dots, in parallel over them), then the output columns split across the threads, each
// adding B's rank-long rows times u to its columns of every row. fp32; rank up to a few hundred.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor A, torch::Tensor B, torch::Tensor row_slots) {
  for (const auto* t : {&x, &y, &A, &B})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "lora_add takes contiguous fp32 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && A.dim() == 3 && B.dim() == 3, "x, y: [rows, *]; A, B: [slots, *, *]");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), S = A.size(0), R = A.size(1);
  TORCH_CHECK(y.size(0) == M && A.size(2) == K && B.size(0) == S && B.size(1) == N && B.size(2) == R,
              "shapes: x [M, in], y [M, out], A [slots, rank, in], B [slots, out, rank]");
  TORCH_CHECK(row_slots.device().is_cpu() && row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 &&
                  row_slots.size(0) == M && row_slots.is_contiguous(), "row_slots must be int64 [rows]");
  const int64_t* slot = row_slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slot[m] >= -1 && slot[m] < S, "row ", m, " names adapter slot ", slot[m], " of ", S);
  const float* xp = x.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* bp = B.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> u(M * R, 0.f);
  at::parallel_for(0, M * R, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / R, r = i % R;
      if (slot[m] >= 0) u[i] = dot(xp + m * K, ap + (slot[m] * R + r) * K, K);
    }
  });
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      if (slot[m] < 0) continue;
      const float* um = u.data() + m * R;
      const float* bs = bp + slot[m] * N * R;
      float* ym = yp + m * N;
      for (int64_t n = n0; n < n1; ++n) ym[n] += dot(bs + n * R, um, R);
    }
  });
}
