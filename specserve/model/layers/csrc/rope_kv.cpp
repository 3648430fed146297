// Rotary embedding of a packed q/k/v projection, with this step's keys and values written to the
// paged KV cache (and to the decode context mirror) in the same pass.
//
// Why: on a CPU the torch path is ~12 small ops per layer (view, float, flip, two muls, an add,
// reshape, two index_copy into the cache, two more into the mirror); at batch 1 that is ~2 ms of
// dispatch per SmolLM2 decode step for a few kilobytes of arithmetic. The arithmetic is Hugging
// Face's "rotate half" exactly: out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin, each
// product rounded to float32 before the add (FMA contraction is off in this file, so the results
// are bit-identical to the torch path and to transformers).

#pragma GCC optimize("fp-contract=off")

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace {

// x [D] (halves x1 | x2) -> out [D]; cos, sin [D / 2]
inline void rotate_head(const float* x, const float* cos, const float* sin, int64_t half,
                        float* out) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * cos[j], b = x[j + half] * sin[j];
    const float c = x[j + half] * cos[j], d = x[j] * sin[j];
    out[j] = a - b;
    out[j + half] = c + d;
  }
}

void check_cache(const torch::Tensor& cache, int64_t kv_heads, int64_t head_dim,
                 const char* name) {
  TORCH_CHECK(cache.dim() == 3 && cache.size(1) == kv_heads && cache.size(2) == head_dim &&
                  cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(),
              name, " must be a contiguous float32 [slots, kv_heads, head_dim] view");
}

}  // namespace

torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& slots, const c10::optional<torch::Tensor>& k_mirror,
                            const c10::optional<torch::Tensor>& v_mirror,
                            const c10::optional<torch::Tensor>& mirror_rows) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(),
              "qkv must be [T, (H + 2 * KvH) * D] contiguous float32");
  const int64_t tokens = qkv.size(0);
  const int64_t head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  const int64_t half = head_dim / 2;
  TORCH_CHECK(head_dim * (num_heads + 2 * num_kv_heads) == qkv.size(1) && head_dim % 2 == 0,
              "qkv width is not (H + 2 * KvH) * an even head_dim");
  for (const torch::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == half &&
                    t->stride(1) == 1 && t->scalar_type() == torch::kFloat32,
                "cos / sin must be [T, head_dim / 2] float32 rows");
  check_cache(k_cache, num_kv_heads, head_dim, "k_cache");
  check_cache(v_cache, num_kv_heads, head_dim, "v_cache");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == torch::kInt64,
              "slots must be [T] int64");
  const bool mirrored = k_mirror.has_value();
  if (mirrored) {
    TORCH_CHECK(v_mirror.has_value() && mirror_rows.has_value(), "mirror needs k, v and rows");
    check_cache(*k_mirror, num_kv_heads, head_dim, "k_mirror");
    check_cache(*v_mirror, num_kv_heads, head_dim, "v_mirror");
    TORCH_CHECK(mirror_rows->dim() == 1 && mirror_rows->size(0) == tokens &&
                    mirror_rows->scalar_type() == torch::kInt64,
                "mirror_rows must be [T] int64");
  }
  torch::Tensor query = torch::empty({tokens, num_heads, head_dim}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  float* q_out = query.data_ptr<float>();
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  float* km = mirrored ? k_mirror->data_ptr<float>() : nullptr;
  float* vm = mirrored ? v_mirror->data_ptr<float>() : nullptr;
  const int64_t* row_p = mirrored ? mirror_rows->data_ptr<int64_t>() : nullptr;
  const int64_t kv_size = num_kv_heads * head_dim, width = qkv.size(1);
  const int64_t cache_slots = k_cache.size(0), mirror_slots = mirrored ? k_mirror->size(0) : 0;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = src + t * width;
      const float* c = cos_p + t * cos.stride(0);
      const float* s = sin_p + t * sin.stride(0);
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_head(row + h * head_dim, c, s, half, q_out + (t * num_heads + h) * head_dim);
      const int64_t slot = slot_p[t];
      TORCH_CHECK(slot >= 0 && slot < cache_slots, "slot out of range");
      float* k_dst = kc + slot * kv_size;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        rotate_head(row + (num_heads + h) * head_dim, c, s, half, k_dst + h * head_dim);
      std::memcpy(vc + slot * kv_size, row + (num_heads + num_kv_heads) * head_dim,
                  kv_size * sizeof(float));
      if (mirrored) {
        const int64_t r = row_p[t];
        TORCH_CHECK(r >= 0 && r < mirror_slots, "mirror row out of range");
        std::memcpy(km + r * kv_size, k_dst, kv_size * sizeof(float));
        std::memcpy(vm + r * kv_size, vc + slot * kv_size, kv_size * sizeof(float));
      }
    }
  });
  return query;
}
