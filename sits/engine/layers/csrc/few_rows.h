// The inner loop of the few-row matmuls (few_rows_linear_cpu.cpp, block_quant_cpu.cpp): R activation
// rows against a run of fp32 weight rows, each weight row read once for all R.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace few_rows {

constexpr int64_t kRowsPerPass = 4;
constexpr int64_t kTileFloats = 4096;   // weight rows walked together: 16 KB, half of L1 (the rows need the rest)

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[r, n] = x[r, :] . w[n, :] for R activation rows and weight rows [n0, n1)
template <int R>
void rows_times_weight(const float* x, const float* w, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float v = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
      for (int64_t kk = k; kk < K; ++kk) v += x[r * K + kk] * wr[kk];
      y[r * ldy + n] = v;
    }
  }
}
#else
// Portable: the dot product of vec.h, per row
template <int R>
void rows_times_weight(const float* x, const float* w, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int r = 0; r < R; ++r) y[r * ldy + n] = dot(x + r * K, w + n * K, K);
}
#endif

// y[r, n] = x[r, :] . w[n, :] for all M rows of x (kRowsPerPass at a time) and weight rows [n0, n1)
inline void rows_times_weight_all(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t ldy,
                                  int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < M; r += kRowsPerPass) {
    const float* xr = x + r * K;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(kRowsPerPass, M - r)) {
      case 1: rows_times_weight<1>(xr, w, K, yr, ldy, n0, n1); break;
      case 2: rows_times_weight<2>(xr, w, K, yr, ldy, n0, n1); break;
      case 3: rows_times_weight<3>(xr, w, K, yr, ldy, n0, n1); break;
      default: rows_times_weight<4>(xr, w, K, yr, ldy, n0, n1); break;
    }
  }
}

// x as contiguous fp32 rows [M, K], the output [M, N] for them, and the shape to return it in (x's,
// its last dimension N)
struct RowsAndOutput {
  torch::Tensor rows, y;
  std::vector<int64_t> shape;
};

inline RowsAndOutput rows_and_output(const torch::Tensor& x, int64_t K, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be an fp32 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension must be the weight's in-features");
  auto rows = x.reshape({-1, K}).contiguous();
  auto shape = x.sizes().vec();
  shape.back() = N;
  return {rows, torch::empty({rows.size(0), N}, x.options()), shape};
}

// y (+ bias), in the shape rows_and_output gave
inline torch::Tensor finish(torch::Tensor y, const c10::optional<torch::Tensor>& bias,
                            const std::vector<int64_t>& shape) {
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == y.size(1) && bias->scalar_type() == at::kFloat,
                "bias must be fp32 [out]");
    y.add_(*bias);
  }
  return y.view(shape);
}

}  // namespace few_rows
