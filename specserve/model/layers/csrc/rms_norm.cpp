// RMSNorm over float32 rows, optionally with the residual add that precedes it fused in.
//
// Why: at batch 1 on a CPU each of a decoder's 61 norms is 6-7 tiny torch ops (add, pow, mean,
// add, rsqrt, mul, mul), each a dispatch and some an OpenMP fork: ~40 us per norm, ~2.5 ms of a
// ~25 ms SmolLM2 decode step. One pass here takes ~1 us. The arithmetic is Hugging Face's:
// h = x + residual; r = 1 / sqrt(mean(h^2) + eps); out = weight * (h * r), in float32; only the
// order of the sum of squares differs (16 lanes, then across them).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

// One row: sum (if residual) into h, normalise h into out.
void norm_row(const float* x, const float* residual, const float* weight, int64_t hidden,
              float eps, float* out, float* h) {
  const int64_t vec_end = hidden / 16 * 16;
  f32x16 acc{};
  float tail = 0.f;
  const float* src = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < vec_end; i += 16) store16(h + i, load16(x + i) + load16(residual + i));
    for (int64_t i = vec_end; i < hidden; ++i) h[i] = x[i] + residual[i];
    src = h;
  }
  for (int64_t i = 0; i < vec_end; i += 16) {
    const f32x16 v = load16(src + i);
    acc += v * v;
  }
  for (int64_t i = vec_end; i < hidden; ++i) tail += src[i] * src[i];
  float sum = tail;
  for (int i = 0; i < 16; ++i) sum += acc[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < vec_end; i += 16)
    store16(out + i, load16(weight + i) * (load16(src + i) * r));
  for (int64_t i = vec_end; i < hidden; ++i) out[i] = weight[i] * (src[i] * r);
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be [T, H] contiguous float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "weight must be [H] contiguous float32");
}

// Rows in parallel only when there are many: an OpenMP fork costs more than a few rows.
constexpr int64_t kRowsPerTask = 16;

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check(x, weight);
  torch::Tensor out = torch::empty_like(x);
  const int64_t rows = x.size(0), hidden = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(xp + r * hidden, nullptr, wp, hidden, static_cast<float>(eps), op + r * hidden,
               nullptr);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat32 &&
                  residual.is_contiguous(),
              "residual must match x");
  torch::Tensor out = torch::empty_like(x), sum = torch::empty_like(x);
  const int64_t rows = x.size(0), hidden = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(xp + r * hidden, rp + r * hidden, wp, hidden, static_cast<float>(eps),
               op + r * hidden, sp + r * hidden);
  });
  return {out, sum};
}
