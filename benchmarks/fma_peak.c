// This CPU's float32 FMA peak: 12 independent chains of 512-bit FMAs per thread, no memory
// traffic. It is what the GGUF block kernel (specserve/model/layers/csrc/gguf_linear.cpp) runs
// into once a pass carries more than ~5 rows of x: every row adds its FMAs, and the weights'
// bytes are already paid for. Compare its GFLOP/s with 2 * rows * parameters / kernel time.
//
//   gcc -O3 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
//   OMP_NUM_THREADS=2 /tmp/fma_peak
//
// (Needs AVX-512. -O3 matters: at -O2 GCC kept the chains in memory here, 3x slower.)
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

enum { kChains = 12 };  // > FMA latency x FMA ports: the pipes never wait for a result

int main(void) {
  const long iters = 400000000L;
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = omp_get_wtime();
    float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 acc[kChains];
      const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps((float)i);
      for (long n = 0; n < iters / kChains; ++n)
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
      __m512 s = acc[0];
      for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
      sink += _mm512_reduce_add_ps(s);  // keeps the loop alive
    }
    const double seconds = omp_get_wtime() - t0;
    const double gflops = 2.0 * 16 * iters * omp_get_max_threads() / seconds / 1e9;
    if (gflops > best) best = gflops;
    printf("%d threads: %.1f GFLOP/s (checksum %g)\n", omp_get_max_threads(), gflops, sink);
  }
  printf("peak: %.1f GFLOP/s\n", best);
  return 0;
}
