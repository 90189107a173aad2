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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>

#include "vec.h"

namespace {

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

}  // namespace

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "few_rows_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "few_rows_linear is fp32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [out, in]");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension must be the weight's in-features");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tile = std::max<int64_t>(1, kTileFloats / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t r = 0; r < M; r += kRowsPerPass) {
        const float* xr = xp + r * K;
        float* yr = yp + r * N;
        switch (std::min(kRowsPerPass, M - r)) {
          case 1: rows_times_weight<1>(xr, wp, K, yr, N, t0, t1); break;
          case 2: rows_times_weight<2>(xr, wp, K, yr, N, t0, t1); break;
          case 3: rows_times_weight<3>(xr, wp, K, yr, N, t0, t1); break;
          default: rows_times_weight<4>(xr, wp, K, yr, N, t0, t1); break;
        }
      }
    }
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "bias must be fp32 [out]");
    y.add_(*bias);
  }
  return y.view(out_shape);
}
