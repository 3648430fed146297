// y = x @ W^T with W in GGUF blocks (Q4_1 or Q8_0) and x float32, on Intel AMX tiles: the same
// float32 model as gguf_linear.cpp (the dequantized weights times x, float32 sums).
//
// Why: gguf_linear.cpp decodes each block to float32 and spends 2 AVX-512 FMAs per row of x per
// 32 weights, so past a few rows it is bound by FMAs (a batch-32 decode step, a prompt, a long
// verification). An AMX tile multiply (TDPBF16PS) does up to 16 x 16 x 32 bfloat16 products into
// float32 in ~16 cycles. Measured on a 2-core Xeon over SmolLM2's 121 matrices (weights from
// DRAM): 1 row 1.04-1.07x the AVX-512 kernel, 2-4 rows 1.06-1.16x, 6 rows 0.95-0.99x, 9-32 rows
// 1.26-1.8x (BENCHMARKS.md "CPU, session 27").
//
// Exactness: AMX multiplies bfloat16 (8 significant bits). Split, everything stays exact:
//   * the weight w = d * q + m (Q4_1; Q8_0: d * q) is applied as d * sum(q * x) + m * sum(x) per
//     block; q (4 or 8 bits) is exact in bfloat16;
//   * x (24 significant bits) is split into x1 + x2 + x3, each bfloat16 rounded to nearest from
//     what the ones before left: the three parts sum to x exactly (8 bits each, for x > ~1e-30);
//   * each product q * x_i (<= 16 bits) is exact in float32, and the tile sums them in float32.
// So an output is the float32 sum over its row's blocks of d * P + m * S, P the block's exact
// products summed in float32, S = sum(x) over the block: the dequantized model's float32
// products up to summation order (and the rounding of d * q + m, which this never does), as any
// two GEMM kernels differ.
//
// Fewer parts (torch.get_float32_matmul_precision() "high": 2, "medium": 1; see
// quantization/gguf_amx.py) keep only the first one or two: the codes' terms then take x to ~16
// or 8 significant bits, while S stays the exact float32 sum of x. They exist for speed: a tile
// job holds 8 or 16 rows instead of 5, so a verification of up to 8 or 16 tokens costs one job.
//
// Bits: every output is, block after block in order,
//   P = (C[x1] + C[x2]) + C[x3]        C[xi] = the tile's float32 sum of the block's q * xi
//   acc = fma(P, d, acc); acc = fma(m, S, acc)
// (fewer parts: P = C[x1] + C[x2], or C[x1]). The parts of up to 5 rows of x (2 parts: 8, 1
// part: 16) are stacked as the rows of one tile job; a tile row's sums
// depend only on that row (the hardware computes each element alike: tests/test_gguf_amx.py
// checks it at 1-33 rows), so an output's bits depend only on its own row of x and its weight
// row, never on the batch or the thread split: speculative verification equals plain decoding
// exactly.
//
// Per block the scales differ per output, so each job's sums go through memory (a tile store)
// into float32 accumulators. Jobs cycle over four C tiles and are folded two jobs late, so the
// tile unit multiplies the next blocks meanwhile.
//
// Packed layout (quantization/gguf_amx.py packs the file's blocks once at load): groups of 16
// weight rows (output features n), each group [K / 32 blocks, record] contiguous. A record holds
// a block's codes as the tile's B operand wants them: tile row kp (0..15), word 2n + j = code of
// input 2kp + j of weight row n ("VNNI" pairs).
//   Q4_1 record (320 bytes): 4 chunks of 32 16-bit words, word w of chunk c = word w of tile rows
//     4c..4c+3 in its four nibbles (lowest first); then 16 x f16 d, 16 x f16 m.
//   Q8_0 record (544 bytes): 16 x 32 int8 codes (tile row kp), then 16 x f16 d.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define SPECSERVE_AMX 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kLanes = 16;  // weight rows per group = float32 columns of a tile
constexpr int kTileRows = 16;
// Rows of x per tile job: its bfloat16 parts fill at most a tile's 16 rows (3 parts: 5 rows).
constexpr int rows_per_tile(int parts) { return kTileRows / parts; }

#if defined(SPECSERVE_AMX)

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile registers. Consecutive tile jobs (a block of weights times a group of up to 5 rows of x)
// use different registers so that one job's multiply overlaps the previous jobs' stores and
// folds: B (the block's weights: tmm0, tmm1) alternates by block, A (x's parts: tmm2, tmm3) by
// job, C (sums: tmm4-7) cycles over four.
constexpr int kCTiles = 4;  // jobs in flight: a job's sums are folded two jobs later

TileConfig make_config(int parts, int rows_per_group) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    const bool weights = t < 2;
    cfg.rows[t] = static_cast<uint8_t>(weights ? kBlock / 2 : parts * rows_per_group);
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// x [M, K] -> parts [blocks, M_pad, Parts, 32] bfloat16 (a block's rows as consecutive tile rows;
// rows past M zero) and sums [M, blocks] (float32 sum of each block of x, always in one order).
// Each part is what the ones before left, rounded to nearest: 3 parts sum to x exactly, fewer
// drop the rest (2: x to ~16 significant bits, 1: x rounded to bfloat16).
template <int Parts>
void split_rows(const float* x, int64_t m, int64_t m_pad, int64_t k, uint16_t* parts, float* sums) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = x + r * k + b * kBlock;
        __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
        sums[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        uint16_t* out = parts + ((b * m_pad + r) * Parts) * kBlock;
        for (int p = 0; p < Parts; ++p) {
          const __m512bh part = _mm512_cvtne2ps_pbh(hi, lo);  // [lo's 16, hi's 16], nearest even
          _mm512_storeu_si512(out + p * kBlock, reinterpret_cast<__m512i>(part));
          const __m512i bits = reinterpret_cast<__m512i>(part);
          const __m512 back_lo = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
          const __m512 back_hi = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
          lo = _mm512_sub_ps(lo, back_lo);  // exact: what the part left over
          hi = _mm512_sub_ps(hi, back_hi);
        }
      }
    }
  });
  for (int64_t b = 0; b < blocks; ++b)  // the padding rows of each block's last tile job
    std::memset(parts + (b * m_pad + m) * Parts * kBlock, 0,
                static_cast<size_t>((m_pad - m) * Parts * kBlock) * sizeof(uint16_t));
}

struct Q41Amx {
  static constexpr int kBytes = 320;
  static constexpr bool kHasMin = true;
  // The record's codes as the B tile [16 rows x 32 bfloat16] in buf. Chunk c's 16-bit word w
  // holds word w of tile rows 4c..4c+3 in its four nibbles: a shift and a table permute per row
  // (the permute reads only an index's low 5 bits, and the table repeats in both halves).
  static inline void unpack(const uint8_t* rec, uint16_t* buf, __m512i table) {
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * c);
      uint16_t* out = buf + 4 * 32 * c;
      _mm512_store_si512(out, _mm512_permutexvar_epi16(w, table));
      _mm512_store_si512(out + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
      _mm512_store_si512(out + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table));
      _mm512_store_si512(out + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table));
    }
  }
};

struct Q80Amx {
  static constexpr int kBytes = 544;
  static constexpr bool kHasMin = false;
  static inline void unpack(const uint8_t* rec, uint16_t* buf, __m512i) {
    for (int i = 0; i < 16; ++i) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * i))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * i + 16))));
      _mm512_store_si512(buf + 32 * i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));  // exact
    }
  }
};

// bfloat16 bits of the integers 0..15, in words 0..15 (and again in 16..31).
__m512i code_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i % 16);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have <= 8 bits
  }
  return _mm512_load_si512(t);
}

// Every cache line of the record kPrefetchRecords ahead (a record spans 5 or 9 lines; the
// hardware prefetcher alone left the tile unit waiting on DRAM).
constexpr int64_t kPrefetchRecords = 8;
template <typename Format>
inline void prefetch_record(const uint8_t* rec) {
  for (int off = 0; off < Format::kBytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + off), _MM_HINT_T0);
}

// One tile job: C[c] = A[a] (x's parts of a block, rows of one group) x B[b] (the block's
// weights). Register numbers must be literals (GCC pastes them into the instruction).
#define SPECSERVE_TILE_JOB(c, a, b, parts) \
  do {                                     \
    _tile_zero(c);                         \
    _tile_loadd(a, parts, 64);             \
    _tile_dpbf16ps(c, a, b);               \
  } while (0)

// The tile job j (C register 4 + j % 4, A register 2 + j % 2) against B register b.
inline void multiply_job(int64_t j, int b, const uint16_t* parts) {
  switch (static_cast<int>(j % kCTiles) * 2 + b) {
    case 0: SPECSERVE_TILE_JOB(4, 2, 0, parts); return;
    case 1: SPECSERVE_TILE_JOB(4, 2, 1, parts); return;
    case 2: SPECSERVE_TILE_JOB(5, 3, 0, parts); return;
    case 3: SPECSERVE_TILE_JOB(5, 3, 1, parts); return;
    case 4: SPECSERVE_TILE_JOB(6, 2, 0, parts); return;
    case 5: SPECSERVE_TILE_JOB(6, 2, 1, parts); return;
    case 6: SPECSERVE_TILE_JOB(7, 3, 0, parts); return;
    default: SPECSERVE_TILE_JOB(7, 3, 1, parts); return;
  }
}

inline void store_job(int64_t j, float* c) {
  switch (static_cast<int>(j % kCTiles)) {
    case 0: _tile_stored(4, c, 64); return;
    case 1: _tile_stored(5, c, 64); return;
    case 2: _tile_stored(6, c, 64); return;
    default: _tile_stored(7, c, 64); return;
  }
}

inline void load_weights(int b, const uint16_t* buf) {
  if (b == 0) _tile_loadd(0, buf, 64);
  else _tile_loadd(1, buf, 64);
}

// A job's sums folded into its R rows: acc[r] += d * P[r] and (Q4_1) += m * S[r], P[r] the sum of
// the row's part sums in order ((C[3r] + C[3r + 1]) + C[3r + 2] for 3 parts); rows >= live are
// padding and skipped.
template <typename Format, int Parts, int R>
inline void fold(const float* c, const uint8_t* rec, const float* sums, int64_t blocks, int live,
                 __m512* acc) {
  constexpr int kScales = Format::kHasMin ? 256 : 512;  // a record's d (then m) after its codes
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kScales)));
  __m512 mn = _mm512_setzero_ps();
  if constexpr (Format::kHasMin)
    mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kScales + 32)));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (r >= live) break;
    const float* cr = c + r * Parts * kLanes;
    __m512 p = _mm512_load_ps(cr);
#pragma GCC unroll 3
    for (int i = 1; i < Parts; ++i) p = _mm512_add_ps(p, _mm512_load_ps(cr + i * kLanes));
    acc[r] = _mm512_fmadd_ps(p, d, acc[r]);
    if constexpr (Format::kHasMin) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[r * blocks]), acc[r]);
  }
}

// Weight groups [g0, g1) against every row of x, R rows per tile job, `tiles` jobs per block.
// A job's sums are stored and folded kLag jobs after its multiply is issued, so the tile unit
// works on the next jobs meanwhile. With one job per block (OneJob: every row in it, R == m) the
// accumulators are locals the compiler keeps in registers; otherwise they live in acc.
template <typename Format, int Parts, int R, bool OneJob>
void run_groups(int64_t g0, int64_t g1, const uint8_t* wp, int64_t blocks, int64_t m,
                int64_t tiles, const uint16_t* parts, const float* sums, float* yp, int64_t n,
                __m512* acc_rows) {
  constexpr int64_t kLag = 2;
  alignas(64) uint16_t bbuf[2][kBlock / 2 * kBlock];
  alignas(64) float cbuf[kCTiles][kTileRows * kLanes];
  __m512 acc_local[R];
  __m512* acc = OneJob ? acc_local : acc_rows;
  const __m512i table = code_table();
  const int64_t jobs = blocks * tiles, m_pad = tiles * R;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t r = 0; r < m_pad; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* rec0 = wp + g * blocks * Format::kBytes;
    auto finish = [&](int64_t j) {
      const int64_t b = OneJob ? j : j / tiles, r0 = OneJob ? 0 : (j % tiles) * R;
      store_job(j, cbuf[j % kCTiles]);
      fold<Format, Parts, R>(cbuf[j % kCTiles], rec0 + b * Format::kBytes,
                             sums + r0 * blocks + b, blocks, OneJob ? R : static_cast<int>(m - r0),
                             acc + r0);
    };
    for (int64_t j = 0; j < jobs; ++j) {
      const int64_t b = OneJob ? j : j / tiles, t = j - b * tiles;
      const int slot = static_cast<int>(b & 1);
      if (t == 0) {
        const uint8_t* rec = rec0 + b * Format::kBytes;
        prefetch_record<Format>(rec + kPrefetchRecords * Format::kBytes);
        Format::unpack(rec, bbuf[slot], table);
        load_weights(slot, bbuf[slot]);
      }
      multiply_job(j, slot, parts + ((b * m_pad + t * R) * Parts) * kBlock);
      if (j >= kLag) finish(j - kLag);
    }
    for (int64_t j = std::max<int64_t>(0, jobs - kLag); j < jobs; ++j) finish(j);
    for (int64_t r = 0; r < m; ++r) _mm512_storeu_ps(yp + r * n + g * kLanes, acc[r]);
  }
}

// Weight groups [g0, g1) against m rows of x in two tile jobs per block (rows R and m - R), the
// accumulators of both in registers. run_groups with two jobs keeps them in memory, and a
// verification of 6-10 rows (3 parts) paid for it: over SmolLM2's matrices its kernel time was
// 1.9 / 2.3x a 1-row pass at 6 / 9 rows against 1.3-1.4x at 5; this one 1.5 / 1.7x (in the
// engine's passes less: Q4_1 time at 9 rows 9.9 -> 8.7 ms; BENCHMARKS.md "CPU, session 31").
// Both jobs of a block (jobs 2b and 2b + 1: C tiles 4-5, or 6-7 for odd blocks) are issued
// before the previous block's are stored and folded, so the tile unit works while the fold runs.
// Same bits as run_groups: each row is folded block after block in the same order.
template <typename Format, int Parts, int R>
void run_two_jobs(int64_t g0, int64_t g1, const uint8_t* wp, int64_t blocks, int64_t m,
                  const uint16_t* parts, const float* sums, float* yp, int64_t n) {
  alignas(64) uint16_t bbuf[2][kBlock / 2 * kBlock];
  alignas(64) float cbuf[2][kTileRows * kLanes];
  __m512 acc[2 * R];
  const __m512i table = code_table();
  const int second = static_cast<int>(m - R);  // live rows of the second job
  constexpr int64_t kSecondJob = R * Parts * kBlock;  // its parts, after the first job's
  for (int64_t g = g0; g < g1; ++g) {
    for (int r = 0; r < 2 * R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* rec0 = wp + g * blocks * Format::kBytes;
    auto finish = [&](int64_t b) {  // block b's jobs are 2b and 2b + 1
      store_job(2 * b, cbuf[0]);
      store_job(2 * b + 1, cbuf[1]);
      const uint8_t* rec = rec0 + b * Format::kBytes;
      fold<Format, Parts, R>(cbuf[0], rec, sums + b, blocks, R, acc);
      fold<Format, Parts, R>(cbuf[1], rec, sums + R * blocks + b, blocks, second, acc + R);
    };
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* rec = rec0 + b * Format::kBytes;
      const uint16_t* first = parts + b * 2 * R * Parts * kBlock;
      const int slot = static_cast<int>(b & 1);
      prefetch_record<Format>(rec + kPrefetchRecords * Format::kBytes);
      Format::unpack(rec, bbuf[slot], table);
      load_weights(slot, bbuf[slot]);
      multiply_job(2 * b, slot, first);
      multiply_job(2 * b + 1, slot, first + kSecondJob);
      if (b >= 1) finish(b - 1);
    }
    finish(blocks - 1);
    for (int64_t r = 0; r < m; ++r) _mm512_storeu_ps(yp + r * n + g * kLanes, acc[r]);
  }
}

// run_groups<Format, Parts, R> for the runtime row count rows (1..rows_per_tile(Parts)).
template <typename Format, int Parts, int R = 1>
void run_groups_for(int rows, int64_t g0, int64_t g1, const uint8_t* wp, int64_t blocks,
                    int64_t m, int64_t tiles, const uint16_t* parts, const float* sums, float* yp,
                    int64_t n, __m512* acc) {
  if constexpr (R < rows_per_tile(Parts)) {
    if (rows > R) {
      run_groups_for<Format, Parts, R + 1>(rows, g0, g1, wp, blocks, m, tiles, parts, sums, yp, n,
                                           acc);
      return;
    }
  }
  if (tiles == 1) run_groups<Format, Parts, R, true>(g0, g1, wp, blocks, m, 1, parts, sums, yp, n, acc);
  else if (tiles == 2 && 2 * R <= kTileRows)  // both jobs' accumulators fit in registers
    run_two_jobs<Format, Parts, R>(g0, g1, wp, blocks, m, parts, sums, yp, n);
  else run_groups<Format, Parts, R, false>(g0, g1, wp, blocks, m, tiles, parts, sums, yp, n, acc);
}

template <typename Format, int Parts>
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "w must be packed records [N / 16, K / 32, bytes] uint8");
  const int64_t m = x.size(0), k = x.size(1), groups = w.size(0), blocks = w.size(1);
  TORCH_CHECK(k == blocks * kBlock && w.size(2) == Format::kBytes, "packed weights do not match x");
  TORCH_CHECK(n == groups * kLanes, "N must be the packed groups x 16");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  // Tile jobs per block, and rows per job spread evenly (3 parts, 6 rows: 2 jobs of 3, not 5 + 1).
  // (Past 5 rows, jobs of up to 16 rows with each part in its own C tile give the same bits but
  // measured slower at every row count up to 25: three stores per job and no overlap of jobs.)
  constexpr int kRowsPerTile = rows_per_tile(Parts);
  const int64_t jobs_per_block = (m + kRowsPerTile - 1) / kRowsPerTile;
  const int rows = static_cast<int>((m + jobs_per_block - 1) / jobs_per_block);
  const int64_t m_pad = jobs_per_block * rows;
  // (not zeroed here: split_rows writes every row, and zeroes the padding rows)
  std::unique_ptr<uint16_t[]> parts(new uint16_t[static_cast<size_t>(blocks * m_pad * Parts * kBlock)]);
  std::vector<float> sums(static_cast<size_t>(m * blocks));
  split_rows<Parts>(xc.data_ptr<float>(), m, m_pad, k, parts.get(), sums.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const TileConfig cfg = make_config(Parts, rows);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    _tile_loadconfig(&cfg);
    // accumulators of jobs that share a block (one job per block keeps them in registers)
    std::vector<__m512> acc(static_cast<size_t>(jobs_per_block > 1 ? m_pad : 0));
    const uint16_t* pp = parts.get();
    const float* sp = sums.data();
    run_groups_for<Format, Parts>(rows, g0, g1, wp, blocks, m, jobs_per_block, pp, sp, yp, n,
                                  acc.data());
    _tile_release();
  });
  return y;
}

template <typename Format>
torch::Tensor amx_linear_parts(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                               int64_t parts) {
  switch (parts) {
    case 3: return amx_linear<Format, 3>(x, w, n);
    case 2: return amx_linear<Format, 2>(x, w, n);
    case 1: return amx_linear<Format, 1>(x, w, n);
    default: TORCH_CHECK(false, "parts must be 1, 2 or 3, got ", parts);
  }
}

#endif  // SPECSERVE_AMX

}  // namespace

bool amx_ready() {
#if defined(SPECSERVE_AMX)
  // Linux hands a process the 8 KB of tile state only when asked (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); once granted it holds for every thread.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

torch::Tensor q4_1_amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                              int64_t parts) {
#if defined(SPECSERVE_AMX)
  TORCH_CHECK(amx_ready(), "AMX tiles are not available to this process");
  return amx_linear_parts<Q41Amx>(x, w, n, parts);
#else
  TORCH_CHECK(false, "specserve's CPU kernels were built without AMX");
#endif
}

torch::Tensor q8_0_amx_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                              int64_t parts) {
#if defined(SPECSERVE_AMX)
  TORCH_CHECK(amx_ready(), "AMX tiles are not available to this process");
  return amx_linear_parts<Q80Amx>(x, w, n, parts);
#else
  TORCH_CHECK(false, "specserve's CPU kernels were built without AMX");
#endif
}
