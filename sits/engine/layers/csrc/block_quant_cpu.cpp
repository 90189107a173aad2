// GGUF's block-quantized weights (Q8_0, Q4_0, Q4_1) multiplied where they lie, on a CPU (see
// layers/block_quant.py).
//
// A decode step reads every weight once per step, so its time is the weights' bytes over the memory
// bandwidth: a Q4_1 weight is 5 bits a value where its dequantized fp32 copy is 32. Here the blocks
// are read as they are in the file and expanded to fp32 a tile of rows at a time into a buffer that
// stays in L1, which the few-row loop of few_rows.h then multiplies by every activation row. Values
// are expanded as gguf's own dequantization expands them (d * q, or d * q + m).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "few_rows.h"

namespace {

// ggml's type ids, and the bytes of one block of 32 values
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;
// up to kInRegistersMaxRows activation rows, each block is expanded in registers once per group of
// kRowsInRegisters rows (an accumulator each; groups of 8 measured no faster); above it a tile is
// expanded once into a buffer for all rows
constexpr int64_t kInRegistersMaxRows = 16;
constexpr int64_t kRowsInRegisters = 4;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;   // d (f16), 16 bytes of 4-bit quants
    case kQ4_1: return 20;   // d, m (f16), 16 bytes of 4-bit quants
    case kQ8_0: return 34;   // d (f16), 32 int8 quants
    default: return 0;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// One block's 32 quants as floats in four 8-lane registers (quants 8j .. 8j + 7 in q[j]); Q4_0's
// offset of 8 is taken off before the conversion, so Q8_0 and Q4_0 values are d * q[j] and Q4_1's
// d * q[j] + m.
template <int64_t QT>
inline void block_quants(const uint8_t* b, __m256 q[4]) {
  if constexpr (QT == kQ8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == kQ4_1 ? 4 : 2)));
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(packed, nibble), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    if constexpr (QT == kQ4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
      q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
      q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
      q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
      q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
      q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
  }
}

// y[r, n] = x[r, :] . W[n, :] for R (1 to 4) activation rows and weight rows [n0, n1), with no
// buffer: per block, sum_i (d q_i + m) x_i is taken as d * (sum_i q_i x_i) + m * (sum_i x_i), the
// quants' products summed in a register and scaled once, the x sums (``sx``: [R, K / 32], Q4_1 only)
// computed once per call.
template <int64_t QT, int R>
void rows_times_blocks(const float* x, const float* sx, int64_t K, const uint8_t* blocks, int64_t row_bytes,
                       float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t bytes = block_bytes(QT), nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = blocks + n * row_bytes;
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      mins[r] = 0.f;
    }
    for (int64_t i = 0; i < nb; ++i, b += bytes) {
      __m256 q[4];
      block_quants<QT>(b, q);
      const __m256 vd = _mm256_set1_ps(half_at(b));
      const float m = QT == kQ4_1 ? half_at(b + 2) : 0.f;
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + i * kBlock;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
        acc[r] = _mm256_fmadd_ps(t, vd, acc[r]);
        if constexpr (QT == kQ4_1) mins[r] += m * sx[r * nb + i];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = few_rows::hsum(acc[r]) + mins[r];
  }
}

template <int64_t QT>
void few_rows_times_blocks(const float* x, const float* sx, int64_t M, int64_t K, const uint8_t* blocks,
                           int64_t row_bytes, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; r += kRowsInRegisters) {
    const float* xr = x + r * K;
    const float* sr = sx + r * nb;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(kRowsInRegisters, M - r)) {
      case 1: rows_times_blocks<QT, 1>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 2: rows_times_blocks<QT, 2>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 3: rows_times_blocks<QT, 3>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      default: rows_times_blocks<QT, 4>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
    }
  }
}
#endif

// one row of K values from its K / 32 blocks
void dequantize_row(int64_t qtype, const uint8_t* b, float* y, int64_t K) {
  const int64_t bytes = block_bytes(qtype);
  for (int64_t i = 0; i < K; i += kBlock, b += bytes, y += kBlock) {
    const float d = half_at(b);
    if (qtype == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
#if defined(__AVX2__)
      const __m256 vd = _mm256_set1_ps(d);
      for (int j = 0; j < kBlock; j += 8) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(v), vd));
      }
#else
      for (int j = 0; j < kBlock; ++j) y[j] = static_cast<float>(q[j]) * d;
#endif
      continue;
    }
    // Q4_0 and Q4_1: byte j holds value j in its low nibble, value j + 16 in its high one
    const bool with_min = qtype == kQ4_1;
    const float m = with_min ? half_at(b + 2) : 0.f;
    const uint8_t* q = b + (with_min ? 4 : 2);
#if defined(__AVX2__)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(packed, nibble), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m), eight = _mm256_set1_ps(8.f);
    for (int j = 0; j < 4; ++j) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
      _mm256_storeu_ps(y + 8 * j, with_min ? _mm256_add_ps(_mm256_mul_ps(f, vd), vm)
                                           : _mm256_mul_ps(_mm256_sub_ps(f, eight), vd));
    }
#else
    for (int j = 0; j < 16; ++j) {
      const float l = static_cast<float>(q[j] & 15), h = static_cast<float>(q[j] >> 4);
      y[j] = with_min ? l * d + m : (l - 8.f) * d;
      y[j + 16] = with_min ? h * d + m : (h - 8.f) * d;
    }
#endif
  }
}

int64_t check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_bytes(qtype) > 0, "unknown block type ", qtype, " (Q4_0, Q4_1 and Q8_0 are: 2, 3, 8)");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "blocks must be a contiguous uint8 [out, bytes per row] CPU tensor");
  TORCH_CHECK(blocks.size(1) == K / kBlock * block_bytes(qtype), "a row of blocks must be ",
              K / kBlock * block_bytes(qtype), " bytes for ", K, " values, got ", blocks.size(1));
  return blocks.size(1);
}

}  // namespace

// The weight as fp32 [out, in], every row expanded from its blocks (in parallel over the rows); into
// the front of ``out`` when given (a reused buffer: no fresh pages to fault in for every weight).
torch::Tensor block_dequantize(torch::Tensor blocks, int64_t qtype, int64_t in_features,
                               c10::optional<torch::Tensor> out) {
  const int64_t row_bytes = check_blocks(blocks, qtype, in_features), N = blocks.size(0), K = in_features;
  torch::Tensor w;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kFloat && out->is_contiguous() &&
                    out->numel() >= N * K, "out must be a contiguous fp32 CPU tensor of at least ", N * K, " values");
    w = out->view({-1}).narrow(0, 0, N * K).view({N, K});
  } else {
    w = torch::empty({N, K}, blocks.options().dtype(at::kFloat));
  }
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequantize_row(qtype, bp + n * row_bytes, wp + n * K, K);
  });
  return w;
}

// x @ W.T (+ bias), W given as its blocks: the weight's rows split across the threads, each thread
// expanding a tile of about 16 KB of rows at a time and multiplying every activation row by it.
torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                           c10::optional<torch::Tensor> bias) {
  const int64_t row_bytes = check_blocks(blocks, qtype, in_features), N = blocks.size(0), K = in_features;
  auto io = few_rows::rows_and_output(x, K, N);
  const int64_t M = io.rows.size(0);
  const float* xp = io.rows.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = io.y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  if (M <= kInRegistersMaxRows) {     // a block's values used straight from registers
    const int64_t nb = K / kBlock;
    const int64_t sums = qtype == kQ4_1 ? M * nb : 0;      // only Q4_1 has a minimum to multiply
    std::vector<float> sx(std::max<int64_t>(sums, 1));
    for (int64_t i = 0; i < sums; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xp[i * kBlock + j];
      sx[i] = s;
    }
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      switch (qtype) {
        case kQ4_0: few_rows_times_blocks<kQ4_0>(xp, sx.data(), M, K, bp, row_bytes, yp, N, n0, n1); break;
        case kQ4_1: few_rows_times_blocks<kQ4_1>(xp, sx.data(), M, K, bp, row_bytes, yp, N, n0, n1); break;
        default: few_rows_times_blocks<kQ8_0>(xp, sx.data(), M, K, bp, row_bytes, yp, N, n0, n1); break;
      }
    });
    return few_rows::finish(io.y, bias, io.shape);
  }
#endif
  // more rows: a tile of rows expanded into an L1 buffer once, then multiplied by every row
  const int64_t tile = std::max<int64_t>(1, few_rows::kTileFloats / K);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(tile * K);
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t n = t0; n < t1; ++n) dequantize_row(qtype, bp + n * row_bytes, buf.data() + (n - t0) * K, K);
      few_rows::rows_times_weight_all(xp, M, buf.data(), K, yp + t0, N, 0, t1 - t0);
    }
  });
  return few_rows::finish(io.y, bias, io.shape);
}
