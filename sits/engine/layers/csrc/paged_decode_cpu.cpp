// One-token decode attention over the paged KV cache, in place, on a CPU (see cpu_attention.py).
//
// kv_cache: [2, num_blocks, block_size, kv_heads, dim] (K then V); block_tables: [B, W] int64;
// context_lens: [B] int64 (the decoding token included); q: [B, heads, dim]. Each query attends to
// its sequence's keys first..len-1 (first = len - window with a sliding window, else 0). Scores,
// softmax and the weighted sum are computed in fp32 whatever the storage dtype. Keys are read where
// they lie (no gathered copy); a sequence's scores live in a per-thread buffer.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

inline void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    float m = s[0];     // n >= 1 (checked); no infinity: -ffast-math assumes there are none
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) { s[i] = std::exp(s[i] - m); sum += s[i]; }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

struct Shape {
  int64_t batch, heads, kv_heads, dim, block_size, table_width, q_stride_b, q_stride_h, window;
  float scale;
};

// Attention of query heads [h0, h1) of sequence b, all in KV-head groups h0/group .. (h1-1)/group.
// Every key row read serves each query head that shares it.
template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens, T* out,
            const Shape& s, int64_t b, int64_t h0, int64_t h1, std::vector<float>& qf, std::vector<float>& acc,
            std::vector<float>& row, std::vector<float>& scores) {
  const int64_t group = s.heads / s.kv_heads, width = s.kv_heads * s.dim, nh = h1 - h0;
  const int64_t len = lens[b];
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0;
  const int64_t n = len - first;
  const int64_t kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;   // the KV heads these query heads read
  scores.resize(nh * n);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d = 0; d < s.dim; ++d)
      qf[h * s.dim + d] = static_cast<float>(q[b * s.q_stride_b + (h0 + h) * s.q_stride_h + d]) * s.scale;
  const int64_t* table = tables + b * s.table_width;
  for (int64_t t = first; t < len; ++t) {
    const int64_t off = (table[t / s.block_size] * s.block_size + t % s.block_size) * width + kv0 * s.dim;
    const float* k = as_float(k_cache + off, row.data(), (kv1 - kv0) * s.dim);
    for (int64_t h = 0; h < nh; ++h)
      scores[h * n + (t - first)] = dot(qf.data() + h * s.dim, k + ((h0 + h) / group - kv0) * s.dim, s.dim);
  }
  softmax_rows(scores.data(), nh, n);
  std::fill(acc.begin(), acc.begin() + nh * s.dim, 0.f);
  for (int64_t t = first; t < len; ++t) {
    const int64_t off = (table[t / s.block_size] * s.block_size + t % s.block_size) * width + kv0 * s.dim;
    const float* v = as_float(v_cache + off, row.data(), (kv1 - kv0) * s.dim);
    for (int64_t h = 0; h < nh; ++h)
      axpy(acc.data() + h * s.dim, scores[h * n + (t - first)], v + ((h0 + h) / group - kv0) * s.dim, s.dim);
  }
  for (int64_t h = 0; h < nh; ++h) {
    T* o = out + (b * s.heads + h0 + h) * s.dim;
    for (int64_t d = 0; d < s.dim; ++d) o[d] = static_cast<T>(acc[h * s.dim + d]);
  }
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens, T* out,
            const Shape& s) {
  const int64_t group = s.heads / s.kv_heads;
  // A task per sequence reads each cached row whole (all KV heads, contiguous); with fewer sequences
  // than threads, a task per (sequence, KV head) keeps every thread busy.
  const bool per_head = s.batch < at::get_num_threads() && s.kv_heads > 1;
  const int64_t tasks = per_head ? s.batch * s.kv_heads : s.batch;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(s.heads * s.dim), acc(s.heads * s.dim), row(s.kv_heads * s.dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      if (per_head) {
        const int64_t b = task / s.kv_heads, h = task % s.kv_heads;
        attend(q, k_cache, v_cache, tables, lens, out, s, b, h * group, (h + 1) * group, qf, acc, row, scores);
      } else {
        attend(q, k_cache, v_cache, tables, lens, out, s, task, 0, s.heads, qf, acc, row, scores);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu() && block_tables.device().is_cpu() &&
              context_lens.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, heads, dim] with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
              context_lens.scalar_type() == at::kLong && context_lens.dim() == 1,
              "block_tables [B, W] and context_lens [B] must be int64");
  Shape s;
  s.batch = q.size(0), s.heads = q.size(1), s.dim = q.size(2);
  s.block_size = kv_cache.size(2), s.kv_heads = kv_cache.size(3);
  s.q_stride_b = q.stride(0), s.q_stride_h = q.stride(1);
  s.scale = static_cast<float>(scale), s.window = window;
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(kv_cache.size(4) == s.dim && s.kv_heads > 0 && s.block_size > 0 && s.heads % s.kv_heads == 0,
              "q's heads or dim disagree with the cache");
  TORCH_CHECK(block_tables.size(0) == s.batch && context_lens.size(0) == s.batch, "one table and length per query");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  s.table_width = tables.size(1);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {   // every block a query reads must be in the cache
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= s.table_width * s.block_size, "context length out of its block table");
    for (int64_t i = 0; i < (lp[b] + s.block_size - 1) / s.block_size; ++i)
      TORCH_CHECK(tp[b * s.table_width + i] >= 0 && tp[b * s.table_width + i] < num_blocks, "block id out of range");
  }
  auto out = torch::empty({s.batch, s.heads, s.dim}, q.options());
  const int64_t half = kv_cache.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    decode<scalar_t>(q.data_ptr<scalar_t>(), cache, cache + half, tp, lp, out.data_ptr<scalar_t>(), s);
  });
  return out;
}
