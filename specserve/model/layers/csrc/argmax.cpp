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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <cfloat>
#include <vector>

namespace {

// One pass: each lane keeps its best value and the first position holding it (strictly
// greater replaces, so a lane keeps its earliest maximum); then the lanes' winners are merged,
// lowest position first among equal values. NaN never compares greater, so a row with one is
// scanned again for its first NaN.
// W lanes of F (f32xN: 8 in an AVX2 build, see cpu_kernels.h); the answer does not depend on W.
template <typename F, typename I>
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int W = sizeof(F) / sizeof(float);
  const int64_t vec_end = n / W * W;
  F best = F{} - INFINITY;
  I where = I{} - 1;  // -1: no value above -inf seen yet in this lane
  I pos;
  for (int j = 0; j < W; ++j) pos[j] = j;
  I nan = I{};
  for (int64_t i = 0; i < vec_end; i += W, pos += W) {
    const F v = load_lanes<F>(x + i);
    const I greater = v > best;
    best = greater ? v : best;
    where = greater ? pos : where;
    nan |= v != v;
  }
  float m = -INFINITY;
  int64_t at = -1;
  bool any_nan = false;
  for (int j = 0; j < W; ++j) {
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
    for (int64_t r = begin; r < end; ++r) result[r] = argmax_row<f32xN, i32xN>(data + r * ld, n);
  });
  return out;
}

namespace {

// float -> bfloat16 -> float, round to nearest even (torch's conversion; finite x).
inline float bfloat16_rounded(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  bits &= 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace

// The greedy screen's candidates (quantization/greedy_screen.py has the bound and why it holds).
// Per row r of x [R, K]: slack = weight_norm * (||x - bf16(x)|| + sum_slack * ||x||) * room +
// slack_abs (float64), and every group of 16 columns holding a c with scores[r, c] >=
// max(scores[r]) - 2 * slack is a candidate, the threshold rounded down to float (never above
// the exact one). Returns the candidate groups of all rows, sorted, and ok: false (groups
// empty) when a row's maximum, slack or x is not finite, where the bound says nothing. One pass
// for the maximum and one 16-lane compare per group: in torch the same steps took 0.75 ms for 9
// rows of SmolLM2's 49152 logits on the 2-core CI machine.
std::tuple<torch::Tensor, bool> screen_groups(const torch::Tensor& scores, const torch::Tensor& x,
                                              double weight_norm, double sum_slack, double room,
                                              double slack_abs) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == torch::kFloat32 &&
                  scores.dim() == 2 && scores.stride(1) == 1,
              "screen_groups: scores must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.size(0) == scores.size(0),
              "screen_groups: x must be float32 [rows, K]");
  constexpr int64_t kGroup = 16;
  const int64_t rows = scores.size(0), n = scores.size(1), ld = scores.stride(0);
  TORCH_CHECK(n % kGroup == 0, "screen_groups: columns must be whole groups of 16");
  const torch::Tensor xc = x.contiguous();
  const int64_t k = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* data = scores.data_ptr<float>();
  const int64_t groups = n / kGroup;
  std::vector<uint8_t> live(static_cast<size_t>(groups), 0);
  torch::Tensor none = torch::empty({0}, torch::dtype(torch::kInt64));
  for (int64_t r = 0; r < rows; ++r) {
    double squares = 0.0, rounding = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      const float v = xp[r * k + i];
      if (!std::isfinite(v)) return {none, false};
      // a denormal may be flushed to 0 or rounded: |v - x'| <= |v| either way
      const double d = std::fabs(v) < FLT_MIN
                           ? static_cast<double>(v)
                           : static_cast<double>(v) - static_cast<double>(bfloat16_rounded(v));
      squares += static_cast<double>(v) * v;
      rounding += d * d;
    }
    const double slack =
        weight_norm * (std::sqrt(rounding) + sum_slack * std::sqrt(squares)) * room + slack_abs;
    const float* row = data + r * ld;
#if defined(__AVX512F__)
    __m512 lanes = _mm512_set1_ps(-INFINITY);
    __mmask16 nans = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 v = _mm512_loadu_ps(row + g * kGroup);
      lanes = _mm512_max_ps(lanes, v);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float m = _mm512_reduce_max_ps(lanes);
#else
    float m = -INFINITY;
    int nans = 0;
    for (int64_t c = 0; c < n; ++c) {
      m = std::max(m, row[c]);
      nans |= std::isnan(row[c]);
    }
#endif
    if (nans || !std::isfinite(m) || !std::isfinite(slack)) return {none, false};
    float floor = static_cast<float>(static_cast<double>(m) - 2.0 * slack);
    floor = std::nextafter(floor, -INFINITY);  // rounded down: never above the exact threshold
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(floor);
    for (int64_t g = 0; g < groups; ++g)
      live[g] |= _mm512_cmp_ps_mask(_mm512_loadu_ps(row + g * kGroup), f, _CMP_GE_OQ) != 0;
#else
    for (int64_t c = 0; c < n; ++c) live[c / kGroup] |= row[c] >= floor;
#endif
  }
  std::vector<int64_t> picked;
  for (int64_t g = 0; g < groups; ++g)
    if (live[g]) picked.push_back(g);
  torch::Tensor out = torch::empty({static_cast<int64_t>(picked.size())}, torch::dtype(torch::kInt64));
  std::copy(picked.begin(), picked.end(), out.data_ptr<int64_t>());
  return {out, true};
}
