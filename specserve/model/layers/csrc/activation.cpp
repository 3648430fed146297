// The gated MLP's activation, silu(gate) * up, over float32 rows of gate_up [T, 2I] -> [T, I].
//
// Why: in torch it is two ops (silu of the strided first half, then the product), each a
// dispatch and an allocation: ~7 us at one row and ~11 us at six, in each of SmolLM2's 30
// layers, ~0.2-0.35 ms of an 8-14 ms step, for 1536 values a row. One pass here is ~1 us.
//
// Arithmetic: silu(g) = g * sigmoid(g), sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e)
// below, e = exp(-|g|) (exp_lanes: Cephes' polynomial, within ~2 ulp of exp; torch's silu uses
// Sleef's). Both forms read exp of a non-positive argument only, so nothing overflows; the
// result is (g * sigmoid(g)) * up in float32. A row's values depend only on that row.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

namespace {

// silu(g) * up lane by lane in a float vector F (int vector I of as many lanes); a lane's
// result does not depend on the width.
template <typename F, typename I>
inline F silu_mul_lanes(F g, F up) {
  const F zero{};
  const F magnitude = g < zero ? zero - g : g;
  const F e = exp_lanes<F, I>(zero - magnitude);
  const F sigmoid = (g < zero ? e : zero + 1.0f) / (e + 1.0f);
  return g * sigmoid * up;
}

// One row of `inter` values, a vector F at a time (f32xN), the tail through one padded
// vector.
template <typename F, typename I>
void silu_mul_row(const float* gate, const float* up, float* o, int64_t inter) {
  constexpr int W = sizeof(F) / sizeof(float);
  const int64_t vec_end = inter / W * W;
  for (int64_t i = 0; i < vec_end; i += W) {
    const F y = silu_mul_lanes<F, I>(load_lanes<F>(gate + i), load_lanes<F>(up + i));
    std::memcpy(o + i, &y, sizeof(y));
  }
  if (vec_end < inter) {
    float g[W] = {}, u[W] = {};
    const int64_t n = inter - vec_end;
    std::memcpy(g, gate + vec_end, n * sizeof(float));
    std::memcpy(u, up + vec_end, n * sizeof(float));
    const F y = silu_mul_lanes<F, I>(load_lanes<F>(g), load_lanes<F>(u));
    std::memcpy(o + vec_end, &y, n * sizeof(float));
  }
}

// Values per parallel task: a row of SmolLM2's MLP (1536) takes ~0.2 us, far below what waking
// the other threads costs, so decode and verification rows run on the calling thread.
constexpr int64_t kValuesPerTask = 1 << 15;

}  // namespace

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kFloat32 &&
                  gate_up.dim() == 2 && gate_up.stride(1) == 1,
              "silu_mul: gate_up must be [T, 2I] float32 on the CPU with contiguous rows");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up's width must be even (gate, up)");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  torch::Tensor out = torch::empty({rows, inter}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, inter));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = src + r * ld;
      const float* up = gate + inter;
      float* o = dst + r * inter;
      silu_mul_row<f32xN, i32xN>(gate, up, o, inter);
    }
  });
  return out;
}
