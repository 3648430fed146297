// y = x @ W^T with W in GGUF blocks (Q4_1 or Q8_0) and x quantized to 8 bits per 32-value block,
// multiplied with integer dot products (AVX-512 VNNI), as llama.cpp and vLLM's GGUF
// matrix-vector kernels do.
//
// Why: the float32 kernel (gguf_linear.cpp) gives the dequantized model's exact float32
// products, but from 2 rows of x on it is bound by float32 FMAs (16 multiply-adds per
// instruction), so each verified row of a speculative step costs 14-24 % of a decode pass on a
// 2-core CPU. vpdpbusd does 64 8-bit multiply-adds per instruction; with the weights repacked so
// that its 16 lanes are 16 output features, a block of 32 inputs costs 8 of them per row plus 3
// float operations, and a verification of a few rows stays near the cost of reading the
// weights once. The price: x is rounded to 8 bits per block (x_hat = dx * xq, dx = amax / 127),
// so results are those of the dequantized weights times x_hat, not times x (opt-in:
// quantization="gguf_a8").
//
// Bits: every output is, block after block in order,
//   acc = fma(float(isum), d * dx, acc)            isum = sum q * xq, exact in int32
//   acc = fma(m, dx * float(sum xq), acc)          (Q4_1's minimum; Q8_0 has none)
// so an output's bits depend only on its own row of x and its weight row, never on the tiling,
// the thread split or the batch (speculative verification equals plain decoding exactly). The
// portable path below does the same operations in the same order.
//
// Packed layout (gguf_a8.py packs the file's blocks): groups of 16 weight rows, each group
// [blocks, record] contiguous so that a tile reads one stream.
//   Q4_1 record (320 bytes): 4 x 64 bytes of codes, lane c's 4 bytes of chunk p = the file's
//     bytes 4p..4p+3 of row c (low nibbles: inputs 4p..4p+3, high nibbles: 16 + 4p..), then
//     16 x f16 d, 16 x f16 m.
//   Q8_0 record (576 bytes): 8 x 64 bytes of codes (chunk p: inputs 4p..4p+3), 16 x f16 d,
//     16 x int16 sum of the row's 32 codes (vpdpbusd multiplies unsigned by signed, so x goes
//     in as xq + 128 and 128 * sum(w) is taken back out, exactly).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECSERVE_VNNI 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kLanes = 16;  // weight rows per group
constexpr int kTile = 8;  // rows of x sharing one decode of a record
constexpr int64_t kPanel = 8;  // groups kept in cache while every tile of x passes
constexpr int64_t kPrefetchRecords = 8;

// x [M, K] -> xq [M, K] int8 (and xu = xq + 128 as uint8), dx [M, blocks], sxq [M, blocks]
// (dx * sum of the block's codes). The AVX-512 path computes the same values: the maximum and
// the integer sum do not depend on order, and both round x * id to nearest even.
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, uint8_t* xu, float* dx,
                   float* sxq) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < blocks; ++g) {
      const float* v = x + r * k + g * kBlock;
      int8_t* q = xq + r * k + g * kBlock;
#if defined(SPECSERVE_VNNI)
      const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m512 scale = _mm512_set1_ps(id);
      const __m512i bound = _mm512_set1_epi32(127);
      const __m512i qlo = _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), bound),
          _mm512_min_epi32(bound, _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale))));
      const __m512i qhi = _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), bound),
          _mm512_min_epi32(bound, _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int c = static_cast<int>(std::nearbyint(v[j] * id));
        q[j] = static_cast<int8_t>(std::max(-127, std::min(127, c)));
        sum += q[j];
      }
#endif
      if (xu != nullptr)
        for (int j = 0; j < kBlock; ++j) xu[r * k + g * kBlock + j] = static_cast<uint8_t>(q[j] + 128);
      dx[r * blocks + g] = d;
      sxq[r * blocks + g] = d * static_cast<float>(sum);
    }
  }
}

struct Q41 {
  static constexpr int64_t kRecord = 320;
  static constexpr bool kUnsignedX = false;
};
struct Q80 {
  static constexpr int64_t kRecord = 576;
  static constexpr bool kUnsignedX = true;
};

#if defined(SPECSERVE_VNNI)

inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows rows of x against one group (16 outputs), all blocks. (Two groups per tile, sharing the
// broadcasts of x, measured slower at 2-4 rows on the CI-class Zen 4: two weight streams.)
template <typename Format, int Rows>
void tile(const int8_t* xq, const uint8_t* xu, const float* dx, const float* sxq, int64_t k,
          int64_t blocks, const uint8_t* w, float* y, int64_t ldy, int64_t n_valid) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* rec = w + g * Format::kRecord;
    for (int64_t line = 0; line < Format::kRecord; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchRecords * Format::kRecord + line),
                   _MM_HINT_T0);
    __m512i op[8];
    __m512 dvec, mvec;
    __m512i init;
    if constexpr (!Format::kUnsignedX) {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * p);
        op[p] = _mm512_and_si512(v, nibble);
        op[4 + p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      dvec = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
      mvec = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
      init = _mm512_setzero_si512();
    } else {
      for (int p = 0; p < 8; ++p) op[p] = _mm512_loadu_si512(rec + 64 * p);
      dvec = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 512)));
      const __m512i wsum = _mm512_cvtepi16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 544)));
      init = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(wsum, 7));
      mvec = _mm512_setzero_ps();
    }
    for (int r = 0; r < Rows; ++r) {
      __m512i lo = init, hi = _mm512_setzero_si512();
      if constexpr (!Format::kUnsignedX) {
        const int8_t* xg = xq + r * k + g * kBlock;
        for (int p = 0; p < 4; ++p) {
          lo = _mm512_dpbusd_epi32(lo, op[p], bcast4(xg + 4 * p));
          hi = _mm512_dpbusd_epi32(hi, op[4 + p], bcast4(xg + 16 + 4 * p));
        }
      } else {
        const uint8_t* xg = xu + r * k + g * kBlock;
        for (int p = 0; p < 4; ++p) {
          lo = _mm512_dpbusd_epi32(lo, bcast4(xg + 4 * p), op[p]);
          hi = _mm512_dpbusd_epi32(hi, bcast4(xg + 16 + 4 * p), op[4 + p]);
        }
      }
      const __m512 dd = _mm512_mul_ps(dvec, _mm512_set1_ps(dx[r * blocks + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), dd, acc[r]);
      if constexpr (!Format::kUnsignedX)
        acc[r] = _mm512_fmadd_ps(mvec, _mm512_set1_ps(sxq[r * blocks + g]), acc[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(kLanes, n_valid);
  for (int r = 0; r < Rows; ++r) {
    if (valid == kLanes) _mm512_storeu_ps(y + r * ldy, acc[r]);
    else _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>((1u << valid) - 1), acc[r]);
  }
}

#else  // portable: the same operations in the same order, one output at a time

template <typename Format, int Rows>
void tile(const int8_t* xq, const uint8_t* xu, const float* dx, const float* sxq, int64_t k,
          int64_t blocks, const uint8_t* w, float* y, int64_t ldy, int64_t n_valid) {
  (void)xu;
  for (int c = 0; c < kLanes && c < n_valid; ++c)
    for (int r = 0; r < Rows; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < blocks; ++g) {
        const uint8_t* rec = w + g * Format::kRecord;
        const int8_t* xg = xq + r * k + g * kBlock;
        int32_t isum = 0;
        uint16_t dh;
        float mv = 0.f;
        if constexpr (!Format::kUnsignedX) {
          for (int p = 0; p < 4; ++p)
            for (int i = 0; i < 4; ++i) {
              const uint8_t b = rec[64 * p + 4 * c + i];
              isum += (b & 15) * xg[4 * p + i] + (b >> 4) * xg[16 + 4 * p + i];
            }
          std::memcpy(&dh, rec + 256 + 2 * c, 2);
          uint16_t mh;
          std::memcpy(&mh, rec + 288 + 2 * c, 2);
          mv = half_to_float(mh);
        } else {
          for (int p = 0; p < 8; ++p)
            for (int i = 0; i < 4; ++i)
              isum += static_cast<int8_t>(rec[64 * p + 4 * c + i]) * xg[4 * p + i];
          std::memcpy(&dh, rec + 512 + 2 * c, 2);
        }
        acc = std::fma(static_cast<float>(isum), half_to_float(dh) * dx[r * blocks + g], acc);
        if constexpr (!Format::kUnsignedX) acc = std::fma(mv, sxq[r * blocks + g], acc);
      }
      y[r * ldy + c] = acc;
    }
}

#endif

// Groups [g0, g1) for Rows rows of x.
template <typename Format, int Rows>
void rows_block(const int8_t* xq, const uint8_t* xu, const float* dx, const float* sxq,
                int64_t k, int64_t blocks, const uint8_t* w, int64_t group_bytes, float* y,
                int64_t n, int64_t g0, int64_t g1) {
  for (int64_t j = g0; j < g1; ++j)
    tile<Format, Rows>(xq, xu, dx, sxq, k, blocks, w + j * group_bytes, y + j * kLanes, n,
                       n - j * kLanes);
}

// Up to kTile rows of x at a time; the row count picks the tile (each decoded record serves
// all of its rows).
template <typename Format>
void rows_dispatch(int rows, const int8_t* xq, const uint8_t* xu, const float* dx,
                   const float* sxq, int64_t k, int64_t blocks, const uint8_t* w,
                   int64_t group_bytes, float* y, int64_t n, int64_t g0, int64_t g1) {
  switch (rows) {
    case 1: return rows_block<Format, 1>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 2: return rows_block<Format, 2>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 3: return rows_block<Format, 3>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 4: return rows_block<Format, 4>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 5: return rows_block<Format, 5>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 6: return rows_block<Format, 6>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    case 7: return rows_block<Format, 7>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
    default: return rows_block<Format, kTile>(xq, xu, dx, sxq, k, blocks, w, group_bytes, y, n, g0, g1);
  }
}

template <typename Format>
torch::Tensor a8_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "w must be packed [N / 16, K / 32, record] contiguous uint8");
  const int64_t m = x.size(0), k = x.size(1), groups = w.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = k / kBlock;
  TORCH_CHECK(w.size(1) == blocks && w.size(2) == Format::kRecord, "w has the wrong packed shape");
  TORCH_CHECK(n > (groups - 1) * kLanes && n <= groups * kLanes, "n does not match the groups");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor xq = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  torch::Tensor xu;
  if (Format::kUnsignedX) xu = torch::empty({m, k}, x.options().dtype(torch::kUInt8));
  torch::Tensor scales = torch::empty({2, m, blocks}, x.options());
  float* dx = scales.data_ptr<float>();
  float* sxq = dx + m * blocks;
  quantize_rows(xc.data_ptr<float>(), m, k, xq.data_ptr<int8_t>(),
                Format::kUnsignedX ? xu.data_ptr<uint8_t>() : nullptr, dx, sxq);
  torch::Tensor y = torch::empty({m, n}, x.options());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const uint8_t* xup = Format::kUnsignedX ? xu.data_ptr<uint8_t>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = blocks * Format::kRecord;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += kPanel) {
      const int64_t p1 = std::min(end, p0 + kPanel);
      for (int64_t r0 = 0; r0 < m; r0 += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - r0));
        rows_dispatch<Format>(rows, xqp + r0 * k, xup ? xup + r0 * k : nullptr, dx + r0 * blocks,
                              sxq + r0 * blocks, k, blocks, wp, group_bytes, yp + r0 * n, n, p0, p1);
      }
    }
  });
  return y;
}

}  // namespace

bool a8_vnni() {
#if defined(SPECSERVE_VNNI)
  return true;
#else
  return false;
#endif
}

// The VNNI greedy screen's candidates (quantization/greedy_screen_vnni.py has the bound and why it
// holds). Per row r of x [R, K]: e = (||x - x'|| * (1 + sum_slack) + sum_slack * ||x||) * room in
// float64, x' the very 8-bit rounding q8_0_a8_linear multiplies (quantize_rows, above), then
// rounded up to float; column c's interval is scores[r, c] -/+ (col_norms[c] * e + slack_abs),
// max_norm >= every col_norms[c].
// Every group of 16 columns holding a c whose upper end reaches the largest lower end of the row
// is a candidate. The float32 fmas that form the ends round by at most half an ulp each, so the
// largest lower end is lowered by 2**-22 of its magnitude (and rounded down) first: a column is
// dropped only if its exact upper end lies below some column's exact lower end. Returns the
// candidate groups' columns (ascending), their rows of w [N, bytes] (the exact head's blocks,
// for the recheck), and ok: false (both empty) when a row's x, scores or e is not finite, where
// the bound says nothing. Rows are split over threads; the gather is here because torch's
// index_select and the column arithmetic around it took ~0.2 ms for a few hundred rows.
std::tuple<torch::Tensor, torch::Tensor, bool> a8_screen_candidates(
    const torch::Tensor& scores, const torch::Tensor& x, const torch::Tensor& col_norms,
    double max_norm, const torch::Tensor& w, double sum_slack, double room, double slack_abs) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == torch::kFloat32 &&
                  scores.dim() == 2 && scores.stride(1) == 1,
              "a8_screen_candidates: scores must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.size(0) == scores.size(0) && x.size(1) % kBlock == 0,
              "a8_screen_candidates: x must be float32 [rows, K], K a multiple of 32");
  TORCH_CHECK(col_norms.scalar_type() == torch::kFloat32 && col_norms.dim() == 1 &&
                  col_norms.is_contiguous() && col_norms.size(0) == scores.size(1),
              "a8_screen_candidates: col_norms must be float32 [columns], contiguous");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(0) == scores.size(1),
              "a8_screen_candidates: w must be uint8 [columns, bytes], contiguous");
  const int64_t rows = scores.size(0), n = scores.size(1), ld = scores.stride(0);
  TORCH_CHECK(n % kLanes == 0, "a8_screen_candidates: columns must be whole groups of 16");
  const torch::Tensor xc = x.contiguous();
  const int64_t k = xc.size(1), blocks = k / kBlock;
  const float* xp = xc.data_ptr<float>();
  const float* data = scores.data_ptr<float>();
  const float* norms = col_norms.data_ptr<float>();
  const int64_t groups = n / kLanes;
  std::vector<uint8_t> live(static_cast<size_t>(rows * groups), 0);  // [rows, groups]
  std::vector<uint8_t> row_ok(static_cast<size_t>(rows), 1);
  std::vector<std::vector<int64_t>> near_groups(static_cast<size_t>(rows));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> xq(static_cast<size_t>(k));
    std::vector<float> dx(static_cast<size_t>(blocks)), sxq(static_cast<size_t>(blocks));
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * k;
      double squares = 0.0, rounding = 0.0;
      bool finite = true;
      for (int64_t i = 0; i < k; ++i) {
        finite = finite && std::isfinite(v[i]);
        squares += static_cast<double>(v[i]) * v[i];
      }
      if (!finite) {
        row_ok[r] = 0;
        continue;
      }
      quantize_rows(v, 1, k, xq.data(), nullptr, dx.data(), sxq.data());
      for (int64_t i = 0; i < k; ++i) {  // x'_i = dx * xq_i, exactly as the kernel multiplies it
        const double d = static_cast<double>(v[i]) -
                         static_cast<double>(dx[i / kBlock]) * static_cast<double>(xq[i]);
        rounding += d * d;
      }
      const double e64 =
          (std::sqrt(rounding) * (1.0 + sum_slack) + sum_slack * std::sqrt(squares)) * room;
      float e = static_cast<float>(e64);
      if (static_cast<double>(e) < e64) e = std::nextafter(e, INFINITY);
      const float* row = data + r * ld;
      bool bad = !std::isfinite(e);
      // Pass 1: the row's largest score (and any NaN).
#if defined(__AVX512F__)
      __m512 lanes = _mm512_set1_ps(-INFINITY);
      __mmask16 nans = 0;
      for (int64_t c = 0; c < n; c += kLanes) {
        const __m512 s = _mm512_loadu_ps(row + c);
        nans |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
        lanes = _mm512_max_ps(lanes, s);
      }
      const float top = _mm512_reduce_max_ps(lanes);
      bad = bad || nans != 0;
#else
      float top = -INFINITY;
      for (int64_t c = 0; c < n; ++c) {
        bad = bad || std::isnan(row[c]);
        top = std::max(top, row[c]);
      }
#endif
      if (bad || !std::isfinite(top)) {
        row_ok[r] = 0;
        continue;
      }
      // Pass 2: the groups with a score >= top - 2 max_norm e (less a margin for the roundings
      // below). The largest lower end is at least top's own, top - norm e >= top - max_norm e,
      // so it belongs to such a group, and so does every column whose upper end reaches it:
      // the steps after this look at these groups only and give what a scan of every column
      // would, reading the norms of a few groups instead of all (the scores' two passes stay
      // in cache; all norms as well took 2.5x as long).
      const double reach = 2.0 * max_norm * e + 2.0 * slack_abs;
      float pre = static_cast<float>(static_cast<double>(top) - reach -
                                     std::ldexp(std::fabs(static_cast<double>(top)) + reach, -20));
      pre = std::nextafter(pre, -INFINITY);
      std::vector<int64_t>& near = near_groups[r];
#if defined(__AVX512F__)
      const __m512 pv = _mm512_set1_ps(pre);
      for (int64_t g = 0; g < groups; ++g)
        if (_mm512_cmp_ps_mask(_mm512_loadu_ps(row + g * kLanes), pv, _CMP_GE_OQ))
          near.push_back(g);
#else
      for (int64_t g = 0; g < groups; ++g) {
        bool any = false;
        for (int c = 0; c < kLanes; ++c) any = any || row[g * kLanes + c] >= pre;
        if (any) near.push_back(g);
      }
#endif
      // The largest lower end, fl(score - norm e), over those groups, then the floor: lowered
      // by 2**-22 of its magnitude for the fmas' roundings, and rounded down.
      float lower = -INFINITY;
      for (int64_t g : near)
        for (int c = 0; c < kLanes; ++c) {
          const int64_t col = g * kLanes + c;
          lower = std::max(lower, std::fma(-norms[col], e, row[col]));
        }
      float floor = static_cast<float>(static_cast<double>(lower) -
                                       std::ldexp(std::fabs(static_cast<double>(lower)), -22) -
                                       2.0 * slack_abs);
      floor = std::nextafter(floor, -INFINITY);  // rounded down: never above the exact bound
      uint8_t* mark = live.data() + r * groups;
      for (int64_t g : near)
        for (int c = 0; c < kLanes; ++c) {
          const int64_t col = g * kLanes + c;
          mark[g] |= std::fma(norms[col], e, row[col]) >= floor;
        }
    }
  });
  const auto bytes = w.size(1);
  for (int64_t r = 0; r < rows; ++r)
    if (!row_ok[r])
      return {torch::empty({0}, torch::dtype(torch::kInt64)),
              torch::empty({0, bytes}, w.options()), false};
  std::vector<int64_t> picked;
  for (int64_t g = 0; g < groups; ++g) {
    bool any = false;
    for (int64_t r = 0; r < rows && !any; ++r) any = live[r * groups + g] != 0;
    if (any) picked.push_back(g);
  }
  const int64_t count = static_cast<int64_t>(picked.size()) * kLanes;
  torch::Tensor columns = torch::empty({count}, torch::dtype(torch::kInt64));
  torch::Tensor taken = torch::empty({count, bytes}, w.options());
  int64_t* cp = columns.data_ptr<int64_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* tp = taken.data_ptr<uint8_t>();
  for (size_t j = 0; j < picked.size(); ++j) {  // a group's 16 rows of w are contiguous
    for (int c = 0; c < kLanes; ++c) cp[j * kLanes + c] = picked[j] * kLanes + c;
    std::memcpy(tp + j * kLanes * bytes, wp + picked[j] * kLanes * bytes, kLanes * bytes);
  }
  return {columns, taken, true};
}

torch::Tensor q4_1_a8_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  return a8_linear<Q41>(x, w, n);
}

torch::Tensor q8_0_a8_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  return a8_linear<Q80>(x, w, n);
}
