// GGUF's block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K)
// multiplied where they lie, on a CPU (see layers/block_quant.py).
//
// A decode step reads every weight once per step, so its time is the weights' bytes over the memory
// bandwidth: a Q4_K weight is 4.5 bits a value where its dequantized fp32 copy is 32. Here the blocks
// are read as they are in the file. Every type is taken 32 values (a "group") at a time: a whole
// block of the 32-value types, a sub-block of a K-quant's 256-value super-block. A group is its
// quants as integers and value = scale * q + min, with one scale for the group (two for Q6_K, whose
// sub-blocks are 16 values). Values are expanded as gguf's own dequantization expands them.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "few_rows.h"

namespace {

// ggml's type ids
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kGroup = 32;
// up to kInRegistersMaxRows activation rows, each group is expanded in registers once per
// kRowsInRegisters rows (an accumulator each; groups of 8 measured no faster); above it a tile is
// expanded once into a buffer for all rows
constexpr int64_t kInRegistersMaxRows = 16;
constexpr int64_t kRowsInRegisters = 4;
// the integer kernel's rows (4 at a time, as the fp32 one; it stays ahead of an expanded tile up to
// the block layer's kernel limit, block_quant.KERNEL_MAX_ROWS)
constexpr int64_t kInt8MaxRows = 32;

struct BlockType {
  int64_t values, bytes;
  bool has_min;       // value = scale * q + min with a min of its own (a row's sums per group are needed)
};

constexpr BlockType block_type(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, false};    // d (f16), 16 bytes of 4-bit quants (q - 8)
    case kQ4_1: return {32, 20, true};     // d, m (f16), 16 bytes of 4-bit quants
    case kQ5_0: return {32, 22, false};    // d, 4 bytes of fifth bits, 16 bytes of 4-bit quants (q - 16)
    case kQ5_1: return {32, 24, true};     // d, m, fifth bits, 4-bit quants
    case kQ8_0: return {32, 34, false};    // d, 32 int8 quants
    case kQ4_K: return {256, 144, true};   // d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of quants
    case kQ5_K: return {256, 176, true};   // as Q4_K, with 32 bytes of fifth bits before the quants
    case kQ6_K: return {256, 210, false};  // 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d
    default: return {0, 0, false};
  }
}

// f(std::integral_constant<int64_t, QT>{}) for a known type id
template <typename F>
void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "unknown block type ", qtype);
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

// A K-quant's 6-bit scale and min of sub-block g (ggml's get_scale_min_k4)
inline void k_scale_min(const uint8_t* s, int g, int& sc, int& m) {
  if (g < 4) {
    sc = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// A group's value = scale[0] * q + min for its first 16 values, scale[1] for the last 16 (they differ
// for Q6_K only); each a product as gguf forms it (its d times the sub-scale)
struct GroupScale {
  float scale[2];
  float min;
};

// Every group's scale and min of the block at b, its d (and dmin) read once
template <int64_t QT>
inline void block_scales(const uint8_t* b, GroupScale s[]) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k_scale_min(b + 4, g, sc, m);
      const float v = d * static_cast<float>(sc);
      s[g] = {{v, v}, -(dmin * static_cast<float>(m))};
    }
  } else if constexpr (QT == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int g = 0; g < 8; ++g) s[g] = {{d * static_cast<float>(sc[2 * g]), d * static_cast<float>(sc[2 * g + 1])}, 0.f};
  } else {
    const float d = half_at(b);
    s[0] = {{d, d}, block_type(QT).has_min ? half_at(b + 2) : 0.f};
  }
}

// Group g's 32 quants as integers, offsets taken off (Q4_0: q - 8, Q5_0: q - 16, Q6_K: q - 32)
template <int64_t QT>
inline void group_ints(const uint8_t* b, int g, int q[kGroup]) {
  if constexpr (QT == kQ8_0) {
    for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(b[2 + l]);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + 32 * (g / 2);
    for (int l = 0; l < 32; ++l) {
      q[l] = (g % 2 ? qs[l] >> 4 : qs[l] & 15);
      if constexpr (QT == kQ5_K) q[l] |= ((b[16 + l] >> g) & 1) << 4;
    }
  } else if constexpr (QT == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) q[l] = (((ql[l] >> (4 * (k >> 1))) & 15) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
  } else {      // Q4_0, Q4_1, Q5_0, Q5_1: byte l holds value l in its low nibble, value l + 16 in its high one
    constexpr bool five = QT == kQ5_0 || QT == kQ5_1;
    const uint8_t* qs = b + (block_type(QT).has_min ? 4 : 2) + (five ? 4 : 0);
    uint32_t qh = 0;
    if constexpr (five) std::memcpy(&qh, qs - 4, 4);
    const int offset = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : 0;
    for (int l = 0; l < 16; ++l) {
      q[l] = ((qs[l] & 15) | (five ? ((qh >> l) & 1) << 4 : 0)) - offset;
      q[l + 16] = ((qs[l] >> 4) | (five ? ((qh >> (l + 16)) & 1) << 4 : 0)) - offset;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 16 of the 32 fifth bits at x (4 bytes, little-endian: bits ``from`` to ``from`` + 15) as a byte each,
// 0x10 where set: the fifth bits of Q5_0/Q5_1
inline __m128i fifth_bits(const uint8_t* x, int from) {
  uint32_t x32;
  std::memcpy(&x32, x, 4);
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(x32 >> from)),
                                          _mm_set_epi64x(0x0101010101010101, 0x0000000000000000));
  const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10));
}

// 16 bytes shifted right by ``bits`` each, their low ``mask`` bits kept
inline __m128i byte_bits(__m128i v, int bits, int mask) {
  return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(bits)), _mm_set1_epi8(static_cast<char>(mask)));
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Group g's quants as int8, values 0-15 in ``lo`` and 16-31 in ``hi``, as group_ints (all but Q8_0,
// whose bytes are the quants already; ``offset`` false: Q4_0's and Q5_0's as stored, their 8 or 16 not
// taken off). 128-bit halves: no lane-crossing shuffle to split a 256-bit one.
template <int64_t QT, bool offset = true>
inline void group_halves(const uint8_t* b, int g, __m128i& lo, __m128i& hi) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {     // 32 bytes at once, then split
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (QT == kQ4_K ? 16 : 48) + 32 * (g / 2)));
    __m256i v = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (g % 2))), _mm256_set1_epi8(15));
    if constexpr (QT == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                                                 _mm256_set1_epi8(1)), 4));
    }
    lo = _mm256_castsi256_si128(v);
    hi = _mm256_extracti128_si256(v, 1);
  } else if constexpr (QT == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
    const __m128i by = _mm_set1_epi8(32);
    lo = _mm_sub_epi8(_mm_or_si128(byte_bits(load16(ql), 4 * (k >> 1), 15),
                                   _mm_slli_epi16(byte_bits(load16(qh), 2 * k, 3), 4)), by);
    hi = _mm_sub_epi8(_mm_or_si128(byte_bits(load16(ql + 16), 4 * (k >> 1), 15),
                                   _mm_slli_epi16(byte_bits(load16(qh + 16), 2 * k, 3), 4)), by);
  } else {
    constexpr bool five = QT == kQ5_0 || QT == kQ5_1;
    const uint8_t* qs = b + (block_type(QT).has_min ? 4 : 2) + (five ? 4 : 0);
    const __m128i packed = load16(qs), nibble = _mm_set1_epi8(15);
    lo = _mm_and_si128(packed, nibble);
    hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    if constexpr (five) {
      lo = _mm_or_si128(lo, fifth_bits(qs - 4, 0));
      hi = _mm_or_si128(hi, fifth_bits(qs - 4, 16));
    }
    if constexpr (offset && (QT == kQ4_0 || QT == kQ5_0)) {
      const __m128i by = _mm_set1_epi8(QT == kQ4_0 ? 8 : 16);
      lo = _mm_sub_epi8(lo, by);
      hi = _mm_sub_epi8(hi, by);
    }
  }
}

// Group g's 32 quants as floats in four 8-lane registers (values 8j .. 8j + 7 in q[j]), as group_ints
template <int64_t QT>
inline void group_quants(const uint8_t* b, int g, __m256 q[4]) {
  if constexpr (QT == kQ8_0) {      // each 8 quants widened straight from memory
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j))));
  } else {
    __m128i lo, hi;
    group_halves<QT>(b, g, lo, hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// y[r, n] = x[r, :] . W[n, :] for R (1 to 4) activation rows and weight rows [n0, n1), with no
// buffer: per group, sum_i (s q_i + m) x_i is taken as s * (sum_i q_i x_i) + m * (sum_i x_i), the
// quants' products summed in a register and scaled once, the x sums (``sx``: [R, K / 32], for types
// with a min only) computed once per call.
template <int64_t QT, int R>
void rows_times_blocks(const float* x, const float* sx, int64_t K, const uint8_t* blocks, int64_t row_bytes,
                       float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr BlockType T = block_type(QT);
  constexpr int groups = T.values / kGroup;
  const int64_t nb = K / T.values, ng = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = blocks + n * row_bytes;
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      mins[r] = 0.f;
    }
    for (int64_t i = 0; i < nb; ++i, b += T.bytes) {
      GroupScale s[groups];
      block_scales<QT>(b, s);
#pragma GCC unroll 8
      for (int g = 0; g < groups; ++g) {
        __m256 q[4];
        group_quants<QT>(b, g, q);
        const __m256 s0 = _mm256_set1_ps(s[g].scale[0]), s1 = _mm256_set1_ps(s[g].scale[1]);
        const int64_t at = i * groups + g;
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + at * kGroup;
          __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t);
          if constexpr (QT == kQ6_K) {       // the group's halves have scales of their own
            acc[r] = _mm256_fmadd_ps(t, s0, acc[r]);
            t = _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16));
          } else {
            t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), t);
          }
          t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
          acc[r] = _mm256_fmadd_ps(t, s1, acc[r]);
          if constexpr (T.has_min) mins[r] += s[g].min * sx[r * ng + at];
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = few_rows::hsum(acc[r]) + mins[r];
  }
}

template <int64_t QT>
void few_rows_times_blocks(const float* x, const float* sx, int64_t M, int64_t K, const uint8_t* blocks,
                           int64_t row_bytes, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t ng = K / kGroup;
  for (int64_t r = 0; r < M; r += kRowsInRegisters) {
    const float* xr = x + r * K;
    const float* sr = sx + r * ng;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(kRowsInRegisters, M - r)) {
      case 1: rows_times_blocks<QT, 1>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 2: rows_times_blocks<QT, 2>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 3: rows_times_blocks<QT, 3>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      default: rows_times_blocks<QT, 4>(xr, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
    }
  }
}

// --- activations quantized to 8 bits (llama.cpp's arithmetic): integer dot products ---------------
//
// Each activation row is quantized per weight block (32 values, or a K-quant's 256) to int8 with one
// scale: x ~ dx * xq. A block's dot product is then d * dx * sum_g sc_g * sum_i q_i xq_i, its products
// summed as integers (maddubs, madd) and turned into a float once per block, where the fp32 path
// widens every quant to a float and multiplies it with an FMA per row. The mins' term is
// min_g * dx * sum_i xq_i: over the quantized x as well, as llama.cpp's Q8_1 does, so the two terms'
// errors cancel. Approximate: x carries 8 bits, so outputs differ from the fp32 path's by about the
// activations' rounding (opt-in; see block_quant.py).

// A Q4_K/Q5_K block's eight 6-bit scales (bytes 0-7) and mins (bytes 8-15) unpacked at once (ggml's
// utmp shuffle of get_scale_min_k4)
inline void k_scales_mins(const uint8_t* s, uint8_t out[16]) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins_low;
  u[0] &= low6;
  std::memcpy(out, u, 16);
}

// Whether the integer kernel takes a type's quants as they are stored, unsigned, with a min (Q4_0 and
// Q5_0 too: their offset, 8 or 16, is a min of -8 d or -16 d), or as signed bytes (Q8_0, Q6_K)
constexpr bool int_signed(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ6_K; }

// A block's integer sub-scales (``sc``: two int16 per group, for its halves), its d, and for the 32-value
// types with a min that min (the K-quants' mins go through ``k_scales_mins``)
template <int64_t QT>
inline float block_int_scales(const uint8_t* b, int16_t sc[], float& min) {
  if constexpr (QT == kQ6_K) {
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) sc[j] = s[j];
    return half_at(b + 208);
  } else {
    sc[0] = sc[1] = 1;
    const float d = half_at(b);
    min = block_type(QT).has_min ? half_at(b + 2) : QT == kQ4_0 ? -8.f * d : QT == kQ5_0 ? -16.f * d : 0.f;
    return d;
  }
}

// Group g's 32 quants as int8 in one register: as stored (unsigned) but for the int_signed types
template <int64_t QT>
inline __m256i group_bytes(const uint8_t* b, int g) {
  const auto load32 = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (QT == kQ8_0) {
    return load32(b + 2);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    __m256i v = load32(b + (QT == kQ4_K ? 16 : 48) + 32 * (g / 2));
    if (g % 2) v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, _mm256_set1_epi8(15));
    if constexpr (QT == kQ5_K)
      v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(load32(b + 16), _mm_cvtsi32_si128(g)),
                                                                 _mm256_set1_epi8(1)), 4));
    return v;
  } else if constexpr (QT == kQ6_K) {
    const int h = g / 4, k = g % 4;
    const __m256i ql = load32(b + 64 * h + 32 * (k & 1));
    const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k >> 1))), _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(load32(b + 128 + 32 * h), _mm_cvtsi32_si128(2 * k)),
                                          _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
  } else {
    __m128i lo, hi;
    group_halves<QT, false>(b, g, lo, hi);      // Q4_0, Q5_0: as stored, their offset a min
    return _mm256_set_m128i(hi, lo);
  }
}

// y[r, n] = x[r, :] . W[n, :] for R (1 to 4) rows of int8 activations (``xq`` [R, K], their scales
// ``dx`` [R, K / block values], their sums per 32 ``bsum`` [R, K / 32]; ``sx``: dx * bsum, for the
// 32-value types with a min) and weight rows [n0, n1). The int_signed types take maddubs's unsigned
// operand as |q| and move q's sign onto x (llama.cpp's mul_sum_i8_pairs). A K-quant block's products
// are summed as integers, each group's scaled by its sub-scale (madd), and its mins' term is one madd
// of the mins with the row's sums.
template <int64_t QT, int R>
void rows_times_blocks_int8(const int8_t* xq, const float* dx, const int16_t* bsum, const float* sx, int64_t K,
                            const uint8_t* blocks, int64_t row_bytes, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr BlockType T = block_type(QT);
  constexpr int groups = T.values / kGroup;
  constexpr bool is_signed = int_signed(QT), k_min = QT == kQ4_K || QT == kQ5_K, block_min = !is_signed && !k_min;
  const int64_t nb = K / T.values, ng = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = blocks + n * row_bytes;
    __m256 acc[R];
    __m128 acc_min[R];
    float mins[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      acc_min[r] = _mm_setzero_ps();
      mins[r] = 0.f;
    }
    for (int64_t i = 0; i < nb; ++i, b += T.bytes) {
      int16_t sc[2 * groups];
      float min = 0.f, d;
      uint8_t scales_mins[16];
      if constexpr (k_min) {
        k_scales_mins(b + 4, scales_mins);
        d = half_at(b);
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales_mins + 8)));
        const float dmin = half_at(b + 2);
        for (int r = 0; r < R; ++r) {     // sum_g min_g * sum(x_g) = -dmin * dx * sum_g m_g * bsum_g
          const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsum + r * ng + i * groups));
          acc_min[r] = _mm_fmadd_ps(_mm_set1_ps(-dmin * dx[r * nb + i]), _mm_cvtepi32_ps(_mm_madd_epi16(m16, bs)),
                                    acc_min[r]);
        }
      } else {
        d = block_int_scales<QT>(b, sc, min);
      }
      __m256i sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < groups; ++g) {
        const __m256i q = group_bytes<QT>(b, g);
        __m256i scale;
        if constexpr (k_min) scale = _mm256_set1_epi16(scales_mins[g]);
        else scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
        const int64_t at = i * groups + g;
        const __m256i aq = is_signed ? _mm256_sign_epi8(q, q) : q;     // |q|: maddubs's unsigned operand
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + at * kGroup));
          const __m256i p = _mm256_maddubs_epi16(aq, is_signed ? _mm256_sign_epi8(xv, q) : xv);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, scale));
          if constexpr (block_min) mins[r] += min * sx[r * ng + at];
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * dx[r * nb + i]), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      __m128 m = _mm_add_ps(acc_min[r], _mm_movehl_ps(acc_min[r], acc_min[r]));
      m = _mm_add_ss(m, _mm_movehdup_ps(m));
      y[r * ldy + n] = few_rows::hsum(acc[r]) + mins[r] + _mm_cvtss_f32(m);
    }
  }
}

// Rows of x as int8 per block of V values: xq = round(x / dx), dx = max |x| / 127 (0 for a zero
// block), and each 32 quants' sum (``bsum``)
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t V, int8_t* xq, float* dx, int16_t* bsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t i = 0; i < K / V; ++i) {
      const float* xb = x + r * K + i * V;
      int8_t* qb = xq + r * K + i * V;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t k = 0; k < V; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.f;
      dx[r * (K / V) + i] = d;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      for (int64_t k = 0; k < V; k += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j)
          v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * j), inv));   // nearest, ties even
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        bsum[(r * K + i * V + k) / kGroup] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
        // pack 32-bit -> 16-bit -> 8-bit, then undo the packs' lane interleaving
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + k),
                            _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
    }
  }
}

template <int64_t QT>
void few_rows_times_blocks_int8(const int8_t* xq, const float* dx, const int16_t* bsum, const float* sx, int64_t M,
                                int64_t K, const uint8_t* blocks, int64_t row_bytes, float* y, int64_t ldy, int64_t n0,
                                int64_t n1) {
  const int64_t ng = K / kGroup, nb = K / block_type(QT).values;
  for (int64_t r = 0; r < M; r += kRowsInRegisters) {
    const int8_t* xr = xq + r * K;
    const float* dr = dx + r * nb;
    const int16_t* br = bsum + r * ng;
    const float* sr = sx + r * ng;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(kRowsInRegisters, M - r)) {
      case 1: rows_times_blocks_int8<QT, 1>(xr, dr, br, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 2: rows_times_blocks_int8<QT, 2>(xr, dr, br, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      case 3: rows_times_blocks_int8<QT, 3>(xr, dr, br, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
      default: rows_times_blocks_int8<QT, 4>(xr, dr, br, sr, K, blocks, row_bytes, yr, ldy, n0, n1); break;
    }
  }
}
#endif

// one row of K values from its blocks: scale * q (+ min), a product and a sum as gguf rounds them
template <int64_t QT>
void dequantize_row(const uint8_t* b, float* y, int64_t K) {
  constexpr BlockType T = block_type(QT);
  constexpr int groups = T.values / kGroup;
  for (int64_t i = 0; i < K; i += T.values, b += T.bytes) {
    GroupScale scales[groups];
    block_scales<QT>(b, scales);
    for (int g = 0; g < groups; ++g, y += kGroup) {
      const GroupScale& s = scales[g];
#if defined(__AVX2__) && defined(__FMA__)
      __m256 q[4];
      group_quants<QT>(b, g, q);
      for (int j = 0; j < 4; ++j) {
        __m256 v = _mm256_mul_ps(q[j], _mm256_set1_ps(s.scale[j / 2]));
        if constexpr (T.has_min) v = _mm256_add_ps(v, _mm256_set1_ps(s.min));
        _mm256_storeu_ps(y + 8 * j, v);
      }
#else
      int q[kGroup];
      group_ints<QT>(b, g, q);
      for (int l = 0; l < kGroup; ++l) {
        const float v = s.scale[l / 16] * static_cast<float>(q[l]);
        y[l] = T.has_min ? v + s.min : v;
      }
#endif
    }
  }
}

int64_t check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  const BlockType T = block_type(qtype);
  TORCH_CHECK(T.values > 0, "unknown block type ", qtype,
              " (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K are: 2, 3, 6, 7, 8, 12, 13, 14)");
  TORCH_CHECK(K > 0 && K % T.values == 0, "in_features must be a multiple of ", T.values, ", got ", K);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "blocks must be a contiguous uint8 [out, bytes per row] CPU tensor");
  TORCH_CHECK(blocks.size(1) == K / T.values * T.bytes, "a row of blocks must be ", K / T.values * T.bytes,
              " bytes for ", K, " values, got ", blocks.size(1));
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
  with_type(qtype, [&](auto qt) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequantize_row<decltype(qt)::value>(bp + n * row_bytes, wp + n * K, K);
    });
  });
  return w;
}

// x @ W.T (+ bias), W given as its blocks: the weight's rows split across the threads. With AVX2, up
// to kInRegistersMaxRows rows each group is expanded in registers (with int8_activations, up to
// kInt8MaxRows rows take the integer kernel); above (and in a build without AVX2), each thread
// expands a tile of about 16 KB of rows at a time and multiplies every row by it.
namespace {
torch::Tensor blocks_times(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                           c10::optional<torch::Tensor> bias, bool int8_activations) {
  const int64_t row_bytes = check_blocks(blocks, qtype, in_features), N = blocks.size(0), K = in_features;
  auto io = few_rows::rows_and_output(x, K, N);
  const int64_t M = io.rows.size(0);
  const float* xp = io.rows.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = io.y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  if (int8_activations && M <= kInt8MaxRows) {
    const int64_t V = block_type(qtype).values;
    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * (K / V));
    std::vector<int16_t> bsum(M * (K / kGroup));
    quantize_rows(xp, M, K, V, xq.data(), dx.data(), bsum.data());
    // the 32-value types' mins' term over the quantized x (dx * its sums), as llama.cpp's Q8_1: its
    // errors cancel the quants' (the K-quants take bsum itself; the signed types have no min)
    const bool block_min = !int_signed(qtype) && qtype != kQ4_K && qtype != kQ5_K;
    std::vector<float> sxq(block_min ? M * (K / kGroup) : 1);
    for (int64_t i = 0; block_min && i < M * (K / kGroup); ++i)
      sxq[i] = dx[i * kGroup / V] * static_cast<float>(bsum[i]);
    with_type(qtype, [&](auto qt) {
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        few_rows_times_blocks_int8<decltype(qt)::value>(xq.data(), dx.data(), bsum.data(), sxq.data(), M, K, bp,
                                                        row_bytes, yp, N, n0, n1);
      });
    });
    return few_rows::finish(io.y, bias, io.shape);
  }
  if (M <= kInRegistersMaxRows) {
    const int64_t sums = block_type(qtype).has_min ? M * (K / kGroup) : 0;   // each row's sum per group
    std::vector<float> sx(std::max<int64_t>(sums, 1));
    for (int64_t i = 0; i < sums; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
      sx[i] = s;
    }
    with_type(qtype, [&](auto qt) {
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        few_rows_times_blocks<decltype(qt)::value>(xp, sx.data(), M, K, bp, row_bytes, yp, N, n0, n1);
      });
    });
    return few_rows::finish(io.y, bias, io.shape);
  }
#endif
  const int64_t tile = std::max<int64_t>(1, few_rows::kTileFloats / K);
  with_type(qtype, [&](auto qt) {
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      std::vector<float> buf(tile * K);
      for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = std::min(n1, t0 + tile);
        for (int64_t n = t0; n < t1; ++n)
          dequantize_row<decltype(qt)::value>(bp + n * row_bytes, buf.data() + (n - t0) * K, K);
        few_rows::rows_times_weight_all(xp, M, buf.data(), K, yp + t0, N, 0, t1 - t0);
      }
    });
  });
  return few_rows::finish(io.y, bias, io.shape);
}
}  // namespace

torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                           c10::optional<torch::Tensor> bias) {
  return blocks_times(x, blocks, qtype, in_features, bias, false);
}

// As block_linear, the activations quantized to 8 bits per block for up to kInt8MaxRows rows
// (with AVX2; otherwise, and above, block_linear's fp32 arithmetic)
torch::Tensor block_linear_int8(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                                c10::optional<torch::Tensor> bias) {
  return blocks_times(x, blocks, qtype, in_features, bias, true);
}
