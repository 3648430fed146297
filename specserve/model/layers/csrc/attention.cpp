// Attention of query runs (decode: 1 token per sequence; speculative verification: k + 1; prompt
// chunks and whole prompts) against each sequence's context, float32.
//
// Why: at batch 1 a SmolLM2 step attends 1 (decode) or ~6 (verification) query tokens x 9 heads
// to a few hundred keys: ~0.5 or ~3 M multiply-adds per layer, a few microseconds of arithmetic.
// torch's CPU SDPA took 30-50 us (decode) and 80-110 us (6 queries, with the causal mask) per
// layer on the 2-core CI machine, 1.5 and 3.3 ms of a 11-16 ms step: its flash kernel cuts the
// problem into blocks sized for long prompts and calls a GEMM per block. Here each (sequence,
// query head) is one task that keeps its query rows, scores and output in cache, with no mask
// tensor: query i of a run of length q in a sequence of length L sees keys [0, L - q + i].
//
// Arithmetic: scores s_j = scale * (q . k_j) summed in float32 (partial sums in the build's
// vector lanes, 16 or 8, then a lane reduction; as many keys share one reduction tree), softmax
// with max subtraction, exp by Cephes' float32 polynomial (a vectorized exp, as SDPA's is),
// out = sum_j p_j v_j / sum_j p_j.
// Results equal SDPA's to float32 rounding, not bit for bit, and are as close to a float64
// reference (tests/test_cpu_kernels.py). A query row's arithmetic depends only on its own
// position, not on the run around it, so a token's attention output does not depend on how many
// proposals are verified beside it.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// This build's native float vector (f32xN: 16 lanes with AVX-512, 8 with AVX2 only, where GCC
// kept the 16-lane version's arrays of split vectors on the stack: session 43, 2-core Zen 3,
// ~140 us a SmolLM2 layer's decode attention to ~400 keys, several times its arithmetic).
using F = f32xN;
using I = i32xN;
constexpr int kLanes = sizeof(F) / sizeof(float);
// Vector registers for a pass's accumulators (of 32 with AVX-512, of 16 otherwise).
constexpr int kAccRegs = kLanes == 16 ? 24 : 12;

// out[j] = sum of v[j]'s lanes, one reduction each: the builds without the vector trees below.
template <typename V>
inline V sum_lanes_each(const V* v) {
  V out;
  for (int j = 0; j < static_cast<int>(sizeof(V) / sizeof(float)); ++j) out[j] = hsum_lanes(v[j]);
  return out;
}

// The lane sums of v[0..kLanes) as one vector: out[j] = sum of v[j]'s lanes. A transpose-and-add
// tree, ~3 shuffles and adds per input where a separate reduction of each costs ~8. Each
// input's lanes are summed in the same pattern whatever its position.
inline f32x16 sum_lanes_tree(const f32x16* v) {
#if defined(__AVX512F__)
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // lanes 4l..4l+3 of w[i]: 2 partial sums each of v[2i], v[2i+1]
    const __m512 a = reinterpret_cast<__m512>(v[2 * i]), b = reinterpret_cast<__m512>(v[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // each 128-bit lane of x[i]: one partial sum of v[4i..4i+3]
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44),
                                   _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44),
                                   _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  const __m512 out = _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                                   _mm512_shuffle_f32x4(z01, z23, 0xDD));
  return reinterpret_cast<f32x16>(out);
#else
  return sum_lanes_each(v);
#endif
}

inline f32x8 sum_lanes_tree(const f32x8* v) {
#if defined(__AVX__)
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice gives each
  // input's two half sums in the halves, which one add of the swapped halves finishes
  __m256 h[4];
  for (int i = 0; i < 4; ++i)
    h[i] = _mm256_hadd_ps(reinterpret_cast<__m256>(v[2 * i]), reinterpret_cast<__m256>(v[2 * i + 1]));
  const __m256 g0 = _mm256_hadd_ps(h[0], h[1]), g1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 out = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                   _mm256_permute2f128_ps(g0, g1, 0x31));
  return reinterpret_cast<f32x8>(out);
#else
  return sum_lanes_each(v);
#endif
}

// max(row[0..n)), a vector at a time: a scalar loop is one dependent max per key (~4 cycles
// each); replacing it made a query row's attention ~35 % cheaper at SmolLM2's shapes
// (BENCHMARKS.md "CPU, session 28"). The maximum is the same whatever the order, so the
// softmax's bits are too.
inline float row_max(const float* row, int64_t n) {
  F lanes = F{} - INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F x = load_lanes<F>(row + j);
    lanes = x > lanes ? x : lanes;
  }
  float m = -INFINITY;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, row[j]);
  return m;
}

// The partial sums of q . k_j: one vector (the reduction tree or a lane sum finishes them).
template <int CH>
inline F partial_dot(const F* qv, const float* kj) {
  F a = qv[0] * load_lanes<F>(kj);
#pragma GCC unroll 16
  for (int c = 1; c < CH; ++c) a += qv[c] * load_lanes<F>(kj + kLanes * c);
  return a;
}

// Scores of one query row for keys [j0, hi): kLanes at a time through one reduction tree, then
// the remaining keys one by one.
template <int CH>
void score_row(const float* q, const float* k, int64_t kv_stride, int64_t j0, int64_t hi,
               float scale, float* row) {
  F qv[CH];
  for (int c = 0; c < CH; ++c) qv[c] = load_lanes<F>(q + kLanes * c);
  int64_t j = j0;
  for (; j + kLanes <= hi; j += kLanes) {
    F acc[kLanes];
#pragma GCC unroll 16
    for (int jj = 0; jj < kLanes; ++jj) acc[jj] = partial_dot<CH>(qv, k + (j + jj) * kv_stride);
    store_lanes(row + j, sum_lanes_tree(acc) * scale);
  }
  for (; j < hi; ++j) row[j] = hsum_lanes(partial_dot<CH>(qv, k + j * kv_stride)) * scale;
}

// Whether two query rows' vectors fit in registers beside a tree's inputs, so that score_pairs
// pays: each key then loads once for both rows (16-lane: every head size; 8-lane: head_dim <= 32).
template <int CH>
constexpr bool kPairs = 2 * CH <= (kLanes == 16 ? 16 : 4);

// Scores of two query rows for keys [j0, j1) (a multiple of kLanes keys): kLanes / 2 keys of
// each row per reduction tree, so each key is loaded once for both rows. Same bits as
// score_row's groups.
template <int CH>
void score_pairs(const float* qa, const float* qb, const float* k, int64_t kv_stride, int64_t j0,
                 int64_t j1, float scale, float* row_a, float* row_b) {
  constexpr int kHalf = kLanes / 2;
  F qva[CH], qvb[CH];
  for (int c = 0; c < CH; ++c) {
    qva[c] = load_lanes<F>(qa + kLanes * c);
    qvb[c] = load_lanes<F>(qb + kLanes * c);
  }
  for (int64_t j = j0; j < j1; j += kHalf) {
    F acc[kLanes];
    for (int jj = 0; jj < kHalf; ++jj) {
      const float* kj = k + (j + jj) * kv_stride;
      acc[jj] = partial_dot<CH>(qva, kj);
      acc[kHalf + jj] = partial_dot<CH>(qvb, kj);
    }
    const F both = sum_lanes_tree(acc) * scale;  // first half of the lanes: row a's keys
    std::memcpy(row_a + j, &both, kHalf * sizeof(float));
    std::memcpy(row_b + j, reinterpret_cast<const float*>(&both) + kHalf, kHalf * sizeof(float));
  }
}

constexpr int64_t kKeyChunk = 64;  // keys whose K rows stay in L1 while every query row passes
constexpr int64_t kRowBlock = 64;  // query rows of a run attended by one task (whole prompts)

// Columns [col0, col0 + G * kLanes) of out[r] = sum_t p[r, t] v_t * inv_sum[r] for ROWS rows;
// row r sees keys [0, first_keys + r) (its probabilities past that are 0, so the pass runs to
// the last row's keys). Each output is one multiply-add chain over t in order, whatever ROWS
// and G.
template <int G, int ROWS>
void weighted_values_rows(const float* p, int64_t ld, const float* inv_sums, int64_t first_keys,
                          const float* v, int64_t kv_stride, float* out, int64_t out_stride) {
  F acc[ROWS][G];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < G; ++c) acc[r][c] = F{};
  const int64_t keys = first_keys + ROWS - 1;
  for (int64_t t = 0; t < keys; ++t) {
    const float* vt = v + t * kv_stride;
    F vv[G];
#pragma GCC unroll 16
    for (int c = 0; c < G; ++c) vv[c] = load_lanes<F>(vt + kLanes * c);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const float pr = p[r * ld + t];
#pragma GCC unroll 16
      for (int c = 0; c < G; ++c) acc[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < G; ++c)
      store_lanes(out + r * out_stride + kLanes * c, acc[r][c] * inv_sums[r]);
}

template <int G, int MAX_ROWS>
void weighted_values(int rows, const float* p, int64_t ld, const float* inv_sums,
                     int64_t first_keys, const float* v, int64_t kv_stride, float* out,
                     int64_t out_stride) {
  if constexpr (MAX_ROWS > 1) {
    if (rows < MAX_ROWS)
      return weighted_values<G, MAX_ROWS - 1>(rows, p, ld, inv_sums, first_keys, v, kv_stride,
                                              out, out_stride);
  }
  weighted_values_rows<G, MAX_ROWS>(p, ld, inv_sums, first_keys, v, kv_stride, out, out_stride);
}

// One (sequence, query head): rows [0, q_len) of q against the keys/values of its KV head.
// CH = head_dim / kLanes. Keys are visited in chunks that stay in L1 for all query rows, and the
// weighted sum of values keeps R rows x G vectors of accumulators in registers while V streams
// (once per G vectors of columns): re-reading K and V from L2 for every query row made the
// first version memory-bound.
template <int CH>
void attend_head(const float* q, int64_t q_stride, int64_t q_len, const float* k, const float* v,
                 int64_t kv_stride, int64_t seq_len, float scale, float* out,
                 int64_t out_stride, std::vector<float>& buffer) {
  constexpr int G = CH < (kLanes == 16 ? 8 : 4) ? CH : (kLanes == 16 ? 8 : 4);  // vectors a pass
  constexpr int R = kAccRegs / G < 8 ? kAccRegs / G : 8;  // rows a pass
  const int64_t first_keys = seq_len - q_len + 1;  // keys seen by the run's first query
  const int64_t ld = ((seq_len + kLanes - 1) / kLanes) * kLanes;  // scores row stride
  buffer.resize(static_cast<size_t>(q_len * ld + q_len));
  float* scores = buffer.data();  // [q_len, ld]: scores, then probabilities (0 past a row's keys)
  float* inv_sums = scores + q_len * ld;  // [q_len]
  // 1. scores. Row i takes the keys of [c0, its limit) in groups of kLanes (one reduction tree)
  // and the rest one by one (a lane sum); which keys go which way depends on the row's own
  // position alone. Where two rows' query vectors fit in registers (kPairs), rows go in pairs
  // while both are in groups: half a group of each shares a tree and each key's loads serve
  // both rows. Same bits (a key's partial sums and its tree do not depend on the vectors beside
  // it); a SmolLM2 layer's attention of 2-9 rows to 251-500 keys took 16-21 % less time on the
  // 2-core Ice Lake Xeon (session 37), 1 row unchanged.
  for (int64_t c0 = 0; c0 < seq_len; c0 += kKeyChunk) {
    const int64_t c1 = std::min(seq_len, c0 + kKeyChunk);
    for (int64_t i = 0; i < q_len; i += 2) {
      const bool pair = i + 1 < q_len;
      const int64_t hi_a = std::max(c0, std::min(c1, first_keys + i));
      const int64_t hi_b = pair ? std::max(c0, std::min(c1, first_keys + i + 1)) : c0;
      // row a's grouped keys (a multiple of kLanes past c0): row b, one key further, has them
      const int64_t both = pair && kPairs<CH> ? c0 + (hi_a - c0) / kLanes * kLanes : c0;
      if (both > c0) score_pairs<CH>(q + i * q_stride, q + (i + 1) * q_stride, k, kv_stride,
                                      c0, both, scale, scores + i * ld, scores + (i + 1) * ld);
      score_row<CH>(q + i * q_stride, k, kv_stride, both, hi_a, scale, scores + i * ld);
      if (pair) score_row<CH>(q + (i + 1) * q_stride, k, kv_stride, both, hi_b, scale,
                              scores + (i + 1) * ld);
    }
  }
  // 2. softmax numerators; keys past a row's limit get probability 0
  for (int64_t i = 0; i < q_len; ++i) {
    float* row = scores + i * ld;
    const int64_t keys = first_keys + i;
    float m = row_max(row, keys);
    for (int64_t j = keys; j < ld; ++j) row[j] = -INFINITY;
    F total = F{};
    for (int64_t j = 0; j < ld; j += kLanes) {
      const F x = load_lanes<F>(row + j) - m;
      F p = exp_lanes<F, I>(x);
      p = x == -INFINITY ? F{} : p;  // masked keys: exactly 0
      store_lanes(row + j, p);
      total += p;
    }
    inv_sums[i] = 1.0f / hsum_lanes(total);
  }
  // 3. out = probabilities @ values, up to R rows and G vectors of columns per pass over V
  for (int64_t r0 = 0; r0 < q_len; r0 += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, q_len - r0));
    for (int c0 = 0; c0 < CH; c0 += G)
      weighted_values<G, R>(rows, scores + r0 * ld, ld, inv_sums + r0, first_keys + r0,
                            v + kLanes * c0, kv_stride, out + r0 * out_stride + kLanes * c0,
                            out_stride);
  }
}

using HeadFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, int64_t,
                        int64_t, float, float*, int64_t, std::vector<float>&);

HeadFn head_fn(int64_t head_dim) {
  if (head_dim % kLanes != 0) return nullptr;
  switch (head_dim / kLanes) {
    case 1: return attend_head<1>;
    case 2: return attend_head<2>;
    case 4: return attend_head<4>;
    case 8: return attend_head<8>;
    case 16: return attend_head<16>;
    default: return nullptr;
  }
}

}  // namespace

torch::Tensor run_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.stride(2) == 1,
              "q must be float32 [T, H, D] with a contiguous last dim");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                  k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "k, v must be float32 [S, KvH, K, D] views with equal strides");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_seqs = k.size(0), kv_heads = k.size(1), max_k = k.size(2);
  const HeadFn fn = head_fn(head_dim);
  TORCH_CHECK(k.size(3) == head_dim && fn != nullptr && head_dim >= 16 && head_dim <= 128,
              "head_dim must be 16, 32, 64 or 128");
  TORCH_CHECK(num_heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query_start.scalar_type() == torch::kInt64 && query_start.numel() == num_seqs + 1 &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.numel() == num_seqs &&
                  !query_start.is_cuda() && !seq_lens.is_cuda(),
              "query_start [S + 1] and seq_lens [S] must be int64 CPU tensors");
  const torch::Tensor qs = query_start.contiguous(), sl = seq_lens.contiguous();
  const int64_t* starts = qs.data_ptr<int64_t>();
  const int64_t* lens = sl.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && lens[s] <= max_k && q_len <= lens[s],
                "each run needs 0 <= query length <= context length <= keys given");
  }
  TORCH_CHECK(starts[num_seqs] == q.size(0), "query_start must end at the number of tokens");
  torch::Tensor out = torch::empty({q.size(0), num_heads, head_dim}, q.options());
  const int64_t group = num_heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kv_stride = k.stride(2);
  // Tasks: (sequence, block of up to kRowBlock query rows, head), in that order, so that the
  // heads sharing a KV head run one after another on one thread while its keys are in cache.
  // A block's rows are attended exactly as in a run of their own that ends at the block's last
  // row (a row's arithmetic never depends on the rows around it), so long runs (whole prompts)
  // keep their score buffer small and spread over threads. Each thread takes a contiguous range
  // of tasks holding an equal share of the work (rows x keys): one long run among many decodes
  // would otherwise load one thread.
  std::vector<int64_t> task_seq, task_row, task_head;
  std::vector<double> work_before{0.0};  // prefix sums of the tasks' work
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    for (int64_t r0 = 0; r0 < q_len; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, q_len - r0);
      const double work = static_cast<double>(rows) * static_cast<double>(lens[s] - q_len + r0 + rows);
      for (int64_t h = 0; h < num_heads; ++h) {
        task_seq.push_back(s);
        task_row.push_back(r0);
        task_head.push_back(h);
        work_before.push_back(work_before.back() + work);
      }
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(task_seq.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  const double total_work = work_before.back();
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t worker = begin; worker < end; ++worker) {
      // tasks whose work starts in this worker's share [w / W, (w + 1) / W) of the total
      const auto first = std::lower_bound(work_before.begin(), work_before.end() - 1,
                                          total_work * worker / workers);
      const auto last = worker + 1 == workers ? work_before.end() - 1
          : std::lower_bound(work_before.begin(), work_before.end() - 1,
                             total_work * (worker + 1) / workers);
      for (int64_t t = first - work_before.begin(); t < last - work_before.begin(); ++t) {
        const int64_t s = task_seq[t], h = task_head[t], kvh = h / group, r0 = task_row[t];
        const int64_t q_len = starts[s + 1] - starts[s];
        const int64_t rows = std::min(kRowBlock, q_len - r0);
        const int64_t t0 = starts[s] + r0;
        fn(qp + t0 * q.stride(0) + h * q.stride(1), q.stride(0), rows,
           kp + s * k.stride(0) + kvh * k.stride(1), vp + s * v.stride(0) + kvh * v.stride(1),
           kv_stride, lens[s] - (q_len - r0 - rows), static_cast<float>(scale),
           op + t0 * out.stride(0) + h * head_dim, out.stride(0), buffer);
      }
    }
  });
  return out;
}
