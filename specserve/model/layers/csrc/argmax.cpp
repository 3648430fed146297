// Row argmax of float32 logits (the greedy head of a CPU decode or verification step).
//
// Why: torch's CPU argmax over a [R, 49152] SmolLM2 logit matrix took ~21 us per row on the
// 2-core CI machine (43 us for 1 row, 129 us for the 6 rows of a k = 5 verification, 0.7 ms
// at batch 32), ~9 GB/s over logits the lm_head kernel has just left in cache. One vector
// pass per row here takes a few microseconds.
//
// Same answer as torch.argmax on every input: the lowest index among equal maxima, and NaN
// ranks above every number (the first NaN wins). Positions are int32 in the vector pass: rows of
// up to 2^31 - 1 values (checked).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

// One pass: each lane keeps its best value and the first position holding it (strictly
// greater replaces, so a lane keeps its earliest maximum); then the lanes' winners are merged,
// lowest position first among equal values. NaN never compares greater, so a row with one is
// scanned again for its first NaN.
int64_t argmax_row(const float* x, int64_t n) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  const int64_t vec_end = n / 16 * 16;
  f32x16 best = f32x16{} - INFINITY;
  i32x16 where = i32x16{} - 1;  // -1: no value above -inf seen yet in this lane
  i32x16 pos = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  i32x16 nan = i32x16{};
  for (int64_t i = 0; i < vec_end; i += 16, pos += 16) {
    const f32x16 v = load16(x + i);
    const i32x16 greater = v > best;
    best = greater ? v : best;
    where = greater ? pos : where;
    nan |= v != v;
  }
  float m = -INFINITY;
  int64_t at = -1;
  bool any_nan = false;
  for (int j = 0; j < 16; ++j) {
    any_nan |= nan[j] != 0;
    if (where[j] >= 0 && (best[j] > m || (best[j] == m && where[j] < at))) {
      m = best[j];
      at = where[j];
    }
  }
  for (int64_t i = vec_end; i < n; ++i) {  // the tail: positions after every lane's
    any_nan |= std::isnan(x[i]);
    if (x[i] > m) {
      m = x[i];
      at = i;
    }
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  return at < 0 ? 0 : at;  // a row of -inf only: torch answers 0
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "argmax_rows: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  TORCH_CHECK(x.stride(1) == 1, "argmax_rows: rows must be contiguous");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of at most 2^31 - 1 values");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, torch::dtype(torch::kInt64));
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = argmax_row(data + r * ld, n);
  });
  return out;
}
