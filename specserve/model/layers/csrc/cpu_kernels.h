// Shared declarations of specserve's CPU kernels (built by specserve/model/layers/cpu_kernels.py).
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstring>
#include <tuple>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// A GGUF block's float16 scale (raw bits) as float32: exact either way.
#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

// 16 float32 lanes (one AVX-512 register; GCC splits it where registers are narrower).
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of v's 16 lanes.
inline float hsum16(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// 8 float32 lanes: one AVX2 register. Where there is no AVX-512, GCC splits 16-lane vectors
// but keeps arrays of them and their lane shuffles on the stack (session 42, 2-core Zen 3: the
// GGUF products 14x and silu_mul ~10x slower than in 8 lanes), so the AVX2 build's hot loops
// use 8 (f32xN).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef f32x8 f32xN;  // this build's native float vector (and int vector of as many lanes)
typedef i32x8 i32xN;
#else
typedef f32x16 f32xN;
typedef i32x16 i32xN;
#endif

// The sum of v's 8 lanes, in a fixed order.
inline float hsum8(f32x8 v) {
#if defined(__AVX__)
  const __m256 a = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
#endif
}

// The sum of a vector's lanes in either width (a fixed order per width).
inline float hsum_lanes(f32x8 v) { return hsum8(v); }
inline float hsum_lanes(f32x16 v) { return hsum16(v); }

// A vector F of floats from p (unaligned).
template <typename F>
inline F load_lanes(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ... and to p.
template <typename F>
inline void store_lanes(float* p, F v) {
  std::memcpy(p, &v, sizeof(v));
}

// exp(x) for x <= 0 (attention's scores minus their max, silu's exp(-|g|)), lane by lane in a
// float vector F with int vector I of as many lanes: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2. Degree-6 polynomial (Cephes' expf coefficients); arguments below -87 are
// taken as -87 (~1.6e-38; attention.cpp zeroes masked keys itself). Each lane's result does not
// depend on the width.
template <typename F, typename I>
inline F exp_lanes(F x) {
  const F lo = F{} - 87.0f;
  x = x < lo ? lo : x;
  // round to nearest for x <= 0: truncation of x log2(e) - 1/2
  const F n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, I), F);
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

inline f32x16 exp16(f32x16 x) { return exp_lanes<f32x16, i32x16>(x); }

// gguf_linear.cpp: x [M, K] float32 @ raw GGUF blocks [N, K / 32 * block bytes]^T -> [M, N]
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& w);

// gguf_a8_linear.cpp: x [M, K] float32, rounded to 8 bits per 32-value block, @ GGUF blocks packed
// by quantization/gguf_a8.py [N / 16, K / 32, record]^T -> [M, N] (integer dot products)
torch::Tensor q4_1_a8_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n);
torch::Tensor q8_0_a8_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n);
// whether those products run on AVX-512 VNNI in this build (else a portable, slow path)
bool a8_vnni();
// the VNNI greedy screen's candidate columns (whole groups of 16, ascending), their rows of the
// exact head's blocks, and whether its bound held (quantization/greedy_screen_vnni.py)
std::tuple<torch::Tensor, torch::Tensor, bool> a8_screen_candidates(
    const torch::Tensor& scores, const torch::Tensor& x, const torch::Tensor& col_norms,
    double max_norm, const torch::Tensor& w, double sum_slack, double room, double slack_abs);

// gguf_amx_linear.cpp: x [M, K] float32 @ GGUF blocks packed by quantization/gguf_amx.py
// [N / 16, K / 32, record]^T -> [M, N] on AMX tiles (float32 results), x taken as `parts`
// bfloat16 parts (3: exactly); amx_ready() says whether this build has them and the OS granted
// their state to this process
bool amx_ready();
torch::Tensor q4_1_amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                              int64_t parts);
torch::Tensor q8_0_amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                              int64_t parts);

// rms_norm.cpp: float32 RMSNorm rows, and the residual add fused in front of it
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps);

// rope_kv.cpp: rotate q and k of a packed qkv [T, (H + 2 KvH) * D] (HF rotate-half), write the
// rotated keys and the values to the cache slots (and mirror rows); returns the queries [T, H, D]
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& slots, const c10::optional<torch::Tensor>& k_mirror,
                            const c10::optional<torch::Tensor>& v_mirror,
                            const c10::optional<torch::Tensor>& mirror_rows);

// activation.cpp: silu(gate) * up of a gated MLP's gate_up [T, 2I] float32 -> [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// attention.cpp: short query runs (decode, verification) against each sequence's context;
// q [T, H, D], k/v [S, KvH, K, D] views; query i of a run of length q in a sequence of length L
// sees keys [0, L - q + i]
torch::Tensor run_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                            double scale);

// argmax.cpp: x [R, V] float32 (rows contiguous) -> [R] int64, torch.argmax's answer per row
torch::Tensor argmax_rows(const torch::Tensor& x);
// argmax.cpp: the greedy screen's candidate groups of 16 columns (sorted), and whether its
// bound held (every value finite; quantization/greedy_screen.py)
std::tuple<torch::Tensor, bool> screen_groups(const torch::Tensor& scores, const torch::Tensor& x,
                                              double weight_norm, double sum_slack, double room,
                                              double slack_abs);
