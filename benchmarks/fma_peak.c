// This CPU's float32 FMA peak: 12 independent chains of its widest FMAs (512-bit, 256-bit without
// AVX-512) per thread, no memory traffic. It is what the GGUF block kernel
// (specserve/model/layers/csrc/gguf_linear.cpp) runs into once a pass carries more than ~5 rows
// of x: every row adds its FMAs, and the weights' bytes are already paid for. Compare its
// GFLOP/s with 2 * rows * parameters / kernel time.
//
//   gcc -O3 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
//   OMP_NUM_THREADS=2 /tmp/fma_peak
//
// (-O3 matters: at -O2 GCC kept the chains in memory here, 3x slower.) Without AVX-512 the
// chains are 256-bit FMAs (AVX2 + FMA: the kernel's 8-lane build).
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

enum { kChains = 12 };  // > FMA latency x FMA ports: the pipes never wait for a result

#if defined(__AVX512F__)
typedef __m512 vec;
enum { kLanes = 16 };
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
static float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
enum { kLanes = 8 };
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
static float vsum(vec v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += lanes[i];
  return s;
}
#endif

int main(void) {
  const long iters = 400000000L;
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = omp_get_wtime();
    float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
    {
      vec acc[kChains];
      const vec b = VSET1(1.0000001f), c = VSET1(1e-7f);
      for (int i = 0; i < kChains; ++i) acc[i] = VSET1((float)i);
      for (long n = 0; n < iters / kChains; ++n)
        for (int i = 0; i < kChains; ++i) acc[i] = VFMA(acc[i], b, c);
      vec s = acc[0];
      for (int i = 1; i < kChains; ++i) s = VADD(s, acc[i]);
      sink += vsum(s);  // keeps the loop alive
    }
    const double seconds = omp_get_wtime() - t0;
    const double gflops = 2.0 * kLanes * iters * omp_get_max_threads() / seconds / 1e9;
    if (gflops > best) best = gflops;
    printf("%d threads: %.1f GFLOP/s (checksum %g)\n", omp_get_max_threads(), gflops, sink);
  }
  printf("peak: %.1f GFLOP/s\n", best);
  return 0;
}
