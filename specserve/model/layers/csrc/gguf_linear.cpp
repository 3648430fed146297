// y = x @ W^T where W is kept in a GGUF block format (Q4_1 or Q8_0) and x is float32.
//
// Why this exists: a GGUF checkpoint stores SmolLM2's matrices as 4-bit Q4_1 blocks (5 bits per
// weight with the block's scale and minimum); dequantized to float32 the same weights are 6.4x the
// bytes, and batch-1 decoding on a CPU is bound by the bytes of weights it reads. Here each block
// is decoded in registers right before its multiply-adds, into exactly the float32 value the
// dequantizer gives (d * q + m rounded once; d and m are float16, q has 4 or 8 bits, so d * q is
// exact in float32), and every product and sum is float32. The result therefore equals the dense
// float32 matmul of the dequantized weights up to summation order, like any two GEMM kernels.
//
// Layout: W is [N, K / 32 blocks] of raw GGUF blocks, row-major, exactly as the file stores them.
//   Q4_1 block (20 bytes): f16 d, f16 m, 16 bytes; value j = d * (byte[j] & 15) + m for j < 16,
//                          d * (byte[j - 16] >> 4) + m for j >= 16.
//   Q8_0 block (34 bytes): f16 d, 32 x int8; value j = d * q[j].
// Rows of x are processed in tiles of up to 11 so that each decoded block serves all of them.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

constexpr int kBlock = 32;
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SPECSERVE_NARROW 1  // 8-lane tiles (see tile8)
#else
#define SPECSERVE_NARROW 0
#endif
constexpr int kWideTile = 11;  // rows of x sharing one decode of a block (see rows_per_tile)
constexpr int64_t kPanel = 32;  // weight rows kept in cache while all rows of x pass
constexpr int64_t kPrefetchBlocks = 64;  // how far ahead of a weight row's block to prefetch

// 16 bytes -> 16 int32 lanes. GCC lowers __builtin_convertvector on bytes to scalar inserts, so
// the AVX-512 build says what it means.
static inline i32x16 widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<i32x16>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  u8x16 b;
  std::memcpy(&b, p, 16);
  return __builtin_convertvector(b, i32x16);
#endif
}

static inline i32x16 widen_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<i32x16>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  i8x16 b;
  std::memcpy(&b, p, 16);
  return __builtin_convertvector(b, i32x16);
#endif
}

struct Q41 {
  static constexpr int kBytes = 20;
  // The block's 32 float32 values as two vectors (elements 0..15, 16..31).
  static inline void decode(const uint8_t* block, f32x16& lo, f32x16& hi) {
#if defined(__AVX512F__)
    // A table of the 16 values a code can stand for (one FMA, d * i + m rounded once, as
    // below), then a lane permute per half: fewer multiply-add-port operations than converting
    // 32 codes to float and scaling each (SmolLM2's Q4_1 matrices ~10 % faster), same bits.
    uint32_t dm;
    std::memcpy(&dm, block, 4);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dmf);
    const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dmf));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, d, m);
    const __m512i codes = reinterpret_cast<__m512i>(widen_u8(block + 4));
    lo = reinterpret_cast<f32x16>(_mm512_permutexvar_ps(codes, table));  // low nibbles index
    hi = reinterpret_cast<f32x16>(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table));
#else
    uint16_t dh, mh;
    std::memcpy(&dh, block, 2);
    std::memcpy(&mh, block + 2, 2);
    const float d = half_to_float(dh), m = half_to_float(mh);
    const i32x16 wide = widen_u8(block + 4);
    const f32x16 qlo = __builtin_convertvector(wide & 15, f32x16);
    const f32x16 qhi = __builtin_convertvector(wide >> 4, f32x16);
    lo = qlo * d + m;  // contracted to one FMA: the exact d * q plus m, rounded once
    hi = qhi * d + m;
#endif
  }
};

struct Q80 {
  static constexpr int kBytes = 34;
  static inline void decode(const uint8_t* block, f32x16& lo, f32x16& hi) {
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    const float d = half_to_float(dh);
    lo = __builtin_convertvector(widen_i8(block + 2), f32x16) * d;  // exact: 11 x 8 bits
    hi = __builtin_convertvector(widen_i8(block + 18), f32x16) * d;
  }
};

// Rows rows of x times Cols consecutive weight rows. Cols > 1 gives the FMA chains independent
// accumulators and reuses each load of x; Rows > 1 reuses each decoded block. With 1-2 rows a
// block's two halves go to separate accumulators so that more FMA chains are in flight; with
// more rows, one accumulator per (row, column) leaves registers for more columns: the 7- and
// 8-row tiles of a k = 6-7 verification spilled with two each (one accumulator each measured
// them 16-21 % faster over SmolLM2's matrices, in one interleaved run). The rule depends on Rows
// alone, so an output's summation order (its bits) depends only on how many rows of x share its
// tile, never on Cols or on whether its column fell in a panel's tail.
template <typename Format, int Rows, int Cols>
static inline void tile16(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                          int64_t blocks, float* y, int64_t ldy) {
  constexpr bool kSplit = Rows <= 2;
  constexpr int kHalves = kSplit ? 2 : 1;
  f32x16 acc[kHalves][Rows][Cols];
  for (int h = 0; h < kHalves; ++h)
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) acc[h][r][c] = f32x16{};
  for (int64_t g = 0; g < blocks; ++g) {
    f32x16 lo[Cols], hi[Cols];
    // The hardware prefetcher follows one stream per weight row but starts late on each new
    // row; asking ahead measured ~6 % faster over SmolLM2's matrices at 1-6 rows (8 blocks).
    // 64 blocks reaches into the next weight rows (SmolLM2's rows are 18 or 48 blocks), which
    // the tiles read next: on the CI-class Zen 4, 2-5 % faster than 8 at 3-8 rows of x, no
    // worse at 1-2 or 16-32 (all 121 matrices, 11 interleaved rounds, session 20). A prefetch
    // past the end of the weights is a hint, never a fault.
    for (int c = 0; c < Cols; ++c)
      __builtin_prefetch(w + c * row_bytes + (g + kPrefetchBlocks) * Format::kBytes);
    for (int c = 0; c < Cols; ++c) Format::decode(w + c * row_bytes + g * Format::kBytes, lo[c], hi[c]);
    const float* xg = x + g * kBlock;
    for (int r = 0; r < Rows; ++r) {
      const f32x16 xlo = load16(xg + r * ldx), xhi = load16(xg + r * ldx + 16);
      for (int c = 0; c < Cols; ++c) {
        acc[0][r][c] += xlo * lo[c];
        acc[kHalves - 1][r][c] += xhi * hi[c];
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      y[r * ldy + c] = hsum16(kSplit ? acc[0][r][c] + acc[kHalves - 1][r][c] : acc[0][r][c]);
}

#if SPECSERVE_NARROW
// The AVX2 build (no 512-bit registers: AMD Zen 2-3, Intel before Ice Lake). GCC splits the
// 16-lane vectors above into pairs of 8 but keeps arrays of them, and the lanes it moves
// between the halves, on the stack: the 16-lane tiles ran SmolLM2's batch-1 matrices at
// ~0.5 GB/s of weights on a 2-core AMD EPYC (Zen 3), 120 ms a step where the same bytes
// copy in ~3 ms. These tiles hold a block as four native 8-lane quarters instead.

// A block's 32 float32 values in quarters (elements 8i..8i+7), decoded one quarter at a time
// (the same values as the 16-lane decoders give): scales() reads the block's float16 scale
// (and minimum), quarter() one quarter's codes. A quarter needs two registers besides the
// scales, so a tile of many rows keeps all its accumulators in registers.
struct Q41x8 {
  static constexpr int kBytes = 20;
  struct Scales {
    __m256 d, m;
  };
  static inline Scales scales(const uint8_t* block) {
    uint32_t dm;
    std::memcpy(&dm, block, 4);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    return {_mm256_broadcastss_ps(dmf), _mm256_broadcastss_ps(_mm_movehdup_ps(dmf))};
  }
  // Quarters 0-1: the low nibbles of bytes 0-7 / 8-15; quarters 2-3: their high nibbles.
  static inline f32x8 quarter(const uint8_t* block, const Scales& s, int i) {
    __m128i bytes;
    std::memcpy(&bytes, block + 4 + 8 * (i & 1), 8);
    const __m256i wide = _mm256_cvtepu8_epi32(bytes);
    const __m256i codes = i < 2 ? _mm256_and_si256(wide, _mm256_set1_epi32(15))
                                : _mm256_srli_epi32(wide, 4);
    // one FMA: the exact d * q plus m, rounded once
    return reinterpret_cast<f32x8>(_mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), s.d, s.m));
  }
};

struct Q80x8 {
  static constexpr int kBytes = 34;
  struct Scales {
    __m256 d;
  };
  static inline Scales scales(const uint8_t* block) {
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    return {_mm256_set1_ps(half_to_float(dh))};
  }
  static inline f32x8 quarter(const uint8_t* block, const Scales& s, int i) {
    __m128i bytes;
    std::memcpy(&bytes, block + 2 + 8 * i, 8);
    // exact: 11 x 8 bits
    return reinterpret_cast<f32x8>(
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s.d));
  }
};

template <typename Format> struct Narrow;
template <> struct Narrow<Q41> { using type = Q41x8; };
template <> struct Narrow<Q80> { using type = Q80x8; };

// As tile16, in quarters: with 1-2 rows of x each quarter has its own accumulator (four FMA
// chains per row, summed (q0 + q1) + (q2 + q3) at the end); from 3 rows on one accumulator per
// (row, column) takes the four quarters in order, enough chains across rows. The rule depends
// on Rows alone (the bits of an output depend only on whether its tile holds more than 2 rows).
// The loops are unrolled by force: left to itself GCC kept the 5-11-row tiles' accumulators on
// the stack and looped over the rows (session 43, Zen 3: ~50 % of the FMA peak at 11 rows).
// x comes packed by pack_rows: block g of row r at x + (g * Rows + r) * 32, so that every
// load of x is one pointer plus a constant (11 row pointers left GCC too few registers).
template <typename Format, int Rows, int Cols>
static inline void tile8(const float* x, int64_t, const uint8_t* w, int64_t row_bytes,
                         int64_t blocks, float* y, int64_t ldy) {
  using Quarters = typename Narrow<Format>::type;
  constexpr int kChains = Rows <= 2 ? 4 : 1;
  f32x8 acc[kChains][Rows][Cols];
#pragma GCC unroll 4
  for (int h = 0; h < kChains; ++h)
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < Cols; ++c) acc[h][r][c] = f32x8{};
  for (int64_t g = 0; g < blocks; ++g) {
#pragma GCC unroll 8
    for (int c = 0; c < Cols; ++c)  // (see tile16)
      __builtin_prefetch(w + c * row_bytes + (g + kPrefetchBlocks) * Format::kBytes);
    typename Quarters::Scales s[Cols];
#pragma GCC unroll 8
    for (int c = 0; c < Cols; ++c) s[c] = Quarters::scales(w + c * row_bytes + g * Format::kBytes);
    const float* xg = x + g * Rows * kBlock;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      f32x8 q[Cols];
#pragma GCC unroll 8
      for (int c = 0; c < Cols; ++c)
        q[c] = Quarters::quarter(w + c * row_bytes + g * Format::kBytes, s[c], i);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const f32x8 xv = load_lanes<f32x8>(xg + r * kBlock + 8 * i);
#pragma GCC unroll 8
        for (int c = 0; c < Cols; ++c) acc[kChains == 4 ? i : 0][r][c] += xv * q[c];
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < Cols; ++c)
      y[r * ldy + c] = hsum8(kChains == 4 ? (acc[0][r][c] + acc[1][r][c]) +
                                                (acc[2][r][c] + acc[3][r][c])
                                          : acc[0][r][c]);
}
#endif

// One tile in this build's vector width.
template <typename Format, int Rows, int Cols>
static inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                        int64_t blocks, float* y, int64_t ldy) {
#if SPECSERVE_NARROW
  tile8<Format, Rows, Cols>(x, ldx, w, row_bytes, blocks, y, ldy);
#else
  tile16<Format, Rows, Cols>(x, ldx, w, row_bytes, blocks, y, ldy);
#endif
}

// Output features [n0, n1) for rows [r0, r0 + Rows) of x: groups of Cols weight rows, then the tail.
template <typename Format, int Rows, int Cols>
static void rows_block(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                       int64_t blocks, float* y, int64_t n, int64_t n0, int64_t n1) {
  int64_t i = n0;
  for (; i + Cols <= n1; i += Cols)
    tile<Format, Rows, Cols>(x, k, w + i * row_bytes, row_bytes, blocks, y + i, n);
  for (; i < n1; ++i) tile<Format, Rows, 1>(x, k, w + i * row_bytes, row_bytes, blocks, y + i, n);
}

// Up to 11 rows of x at a time (a verification of k <= 10 proposals decodes each block once).
// Cols per row count as measured on the 2-core AMD EPYC (Zen 4) CI machine, all 121 SmolLM2
// matrices cycled (weights from DRAM), 7 interleaved rounds: one weight row at a time for 1-2
// rows of x (1 row: 14 % faster on the Q4_1 matrices and 30 % on the Q8_0 head than 4 columns;
// fewer concurrent weight streams), 4 columns for 3 rows, 3 for 4, 2 for 5-8 (5 rows: 4.5 % /
// 24 % faster than 3); 2 for 9-11 too (rows_per_tile). Accumulators: at most 22 of the 32
// vector registers, leaving room for the decoded blocks, the rows of x and the decode's
// constants. The columns never change an output's bits (see tile's kSplit).
#if SPECSERVE_NARROW
// 8-lane tiles (tile8), 16 vector registers, a block decoded a quarter at a time: two weight
// rows for 3-4 rows of x (8 accumulators, two quarters and their scales), one otherwise; up to
// 11 rows is 11 accumulators, a quarter and its scales. On the 2-core Zen 3 (session 43,
// SmolLM2's shapes, weights from DRAM, 7 interleaved rounds) two columns ran 1 and 5 rows
// 6-18 % slower, 4 rows 3 % faster (head 16 %), 2, 3 and 6 rows within the noise; in session
// 42, 8 and 10 rows a tile ran within the noise (~10 %) of 11 up to 22 rows, and 11 was the
// fastest at 32.
constexpr int kColsFor[kWideTile + 1] = {0, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1};
#else
constexpr int kColsFor[kWideTile + 1] = {0, 1, 1, 4, 3, 2, 2, 2, 2, 2, 2, 2};
#endif

template <typename Format>
static void rows_dispatch(int rows, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                          int64_t blocks, float* y, int64_t n, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return rows_block<Format, 1, kColsFor[1]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 2: return rows_block<Format, 2, kColsFor[2]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 3: return rows_block<Format, 3, kColsFor[3]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 4: return rows_block<Format, 4, kColsFor[4]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 5: return rows_block<Format, 5, kColsFor[5]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 6: return rows_block<Format, 6, kColsFor[6]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 7: return rows_block<Format, 7, kColsFor[7]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 8: return rows_block<Format, 8, kColsFor[8]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 9: return rows_block<Format, 9, kColsFor[9]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    case 10: return rows_block<Format, 10, kColsFor[10]>(x, k, w, row_bytes, blocks, y, n, n0, n1);
    default: return rows_block<Format, kWideTile, kColsFor[kWideTile]>(x, k, w, row_bytes, blocks,
                                                                      y, n, n0, n1);
  }
}

// Rows of x per tile for m rows in all: as few tiles as hold them (at most kWideTile rows each),
// rows spread evenly (32 = 11 + 11 + 10). Why: every tile decodes the blocks again, and that
// decode costs about what 4 rows of FMAs do. On a 2-core Ice Lake Xeon (no AMX; SmolLM2's 120
// Q4_1 matrices, session 36) a tile of R rows took ~3.7 + 0.95 R ms: 8 rows 11.1 ms; 9 / 10 / 11
// rows 15.0-15.5 / 16.3-16.6 / 17.1-17.4 ms as 8 + 1-3 (the former tiling: up to 8 a tile)
// against 12.0-12.3 / 13.1-14.2 / 14.6-15.1 ms as one tile. 11 rows x 2 columns is 22
// accumulators; 12 rows spilled (27.7 ms). A function of m alone, as the bits must be.
static inline int rows_per_tile(int64_t m) {
  const int64_t tiles = (m + kWideTile - 1) / kWideTile;
  return static_cast<int>((m + tiles - 1) / tiles);
}

#if SPECSERVE_NARROW
// rows rows of x [rows, k] -> [k / 32 blocks][rows][32]: the layout tile8 reads.
static void pack_rows(const float* x, int64_t k, int64_t rows, float* out) {
  for (int64_t g = 0; g < k / kBlock; ++g)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + (g * rows + r) * kBlock, x + r * k + g * kBlock, kBlock * sizeof(float));
}
#endif

template <typename Format>
static torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "w must be [N, K/32 * block bytes] contiguous uint8");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = k / kBlock;
  TORCH_CHECK(w.size(1) == blocks * Format::kBytes, "w row has the wrong number of bytes");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({m, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Each thread takes a contiguous range of output features (weight rows) and all rows of x.
  // A panel of kPanel weight rows stays in cache while every tile of x's rows passes over it.
  const int tile_rows = rows_per_tile(m);
#if SPECSERVE_NARROW
  // tile8 reads each tile's rows of x packed block-major (see pack_rows); one row already is
  std::vector<float> packed(tile_rows > 1 ? static_cast<size_t>(m * k) : 0);
  for (int64_t r0 = 0; tile_rows > 1 && r0 < m; r0 += tile_rows)
    pack_rows(xp + r0 * k, k, std::min<int64_t>(tile_rows, m - r0), packed.data() + r0 * k);
  const float* xt = tile_rows > 1 ? packed.data() : xp;
#else
  const float* xt = xp;
#endif
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += kPanel) {
      const int64_t p1 = std::min(end, p0 + kPanel);
      for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m - r0));
        rows_dispatch<Format>(rows, xt + r0 * k, k, wp, row_bytes, blocks, yp + r0 * n, n, p0, p1);
      }
    }
  });
  return y;
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& w) {
  return block_linear<Q41>(x, w);
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& w) {
  return block_linear<Q80>(x, w);
}
