// A decoder layer's small fp32 operators on a CPU, each one call instead of several of torch's (see
// models/llama.py): RMSNorm with the residual add before it, and RoPE on q and k with the store of
// the new K/V rows into their cache slots. At a decode step's few rows each of torch's operators
// costs more in dispatch than in arithmetic.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be an fp32 CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, "'s rows must be contiguous");
}

}  // namespace

// out = weight * x / sqrt(mean(x^2) + eps) over the last dimension. With ``residual``, x is first
// added into it in place (residual += x) and the sum is normalized: the pre-norm decoder's
// ``h = h + delta; norm(h)`` in one pass.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "weight must be [hidden]");
  auto src = x.reshape({-1, dim});
  const bool add = residual.has_value() && residual->defined();
  torch::Tensor res;
  if (add) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(), "residual must be contiguous, x's shape");
    res = residual->view({-1, dim});
  }
  const int64_t rows = src.size(0), sx = src.stride(0);
  auto out = torch::empty({rows, dim}, x.options());
  const float* xp = src.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = add ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = xp + r * sx;
      if (add) {
        float* acc = rp + r * dim;
        for (int64_t i = 0; i < dim; ++i) acc[i] += in[i];
        in = acc;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) ss += in[i] * in[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + e);
      float* o = op + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = wp[i] * (in[i] * inv);
    }
  });
  return out.view(x.sizes());
}

// RoPE (rotate-half convention: the pairs are (i, i + dim/2)) applied in place to q [T, H, D] and
// k [T, Hkv, D] with cos/sin [T, D]; then k and v [T, Hkv, D] copied to their slots of the caches
// [num_blocks, block_size, Hkv, D] (slot_mapping [T] int64, each in range).
void rope_store_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping) {
  for (auto* t : {&q, &k, &v, &cos, &sin, &k_cache, &v_cache}) check_rows(*t, "q, k, v, cos, sin and the caches");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [tokens, heads, dim]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D && D % 2 == 0,
              "q, k and v disagree in tokens, heads or dim");
  TORCH_CHECK(q.stride(1) == D && k.stride(1) == D && v.stride(1) == D, "each token's heads must be contiguous");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == T && sin.size(0) == T && cos.size(1) == D &&
              sin.size(1) == D, "cos and sin must be [tokens, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == Hkv && k_cache.size(3) == D,
              "the caches must be contiguous [num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == T, "slot_mapping must be int64 [tokens]");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = Hkv * D, half = D / 2;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of the cache");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), sc = cos.stride(0), ss = sin.stride(0);
  auto rotate = [half](float* x, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
  };
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * sc;
      const float* s = snp + t * ss;
      for (int64_t h = 0; h < H; ++h) rotate(qp + t * sq + h * D, c, s);
      for (int64_t h = 0; h < Hkv; ++h) rotate(kp + t * sk + h * D, c, s);
      std::copy(kp + t * sk, kp + t * sk + width, kc + sp[t] * width);
      std::copy(vp + t * sv, vp + t * sv + width, vc + sp[t] * width);
    }
  });
}
