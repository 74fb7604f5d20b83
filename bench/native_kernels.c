/* A hand-written CPU form of the decode step's projections, for bench/native_kernels.py: what a kernel outside XLA
   reaches on this machine (gcc -O3 -march=native, OpenMP), against XLA's form through the runtime's plugin. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* y[b, o] = sum_i w[o, i] x[b, i]: the out-major projection. Each thread takes a strip of four output rows at a time
   and runs every batch row against it, so the weights are read from memory once. Needs I % 8 == 0, O % 4 == 0. */
void projection(const float *w, const float *x, float *y, int B, int O, int I) {
#pragma omp parallel for schedule(static)
  for (int o = 0; o < O; o += 4) {
    const float *w0 = w + (size_t)o * I;
    for (int b = 0; b < B; b++) {
      const float *xb = x + (size_t)b * I;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int i = 0; i < I; i += 8) {
        const __m256 xv = _mm256_loadu_ps(xb + i);
        for (int r = 0; r < 4; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + (size_t)r * I + i), xv, acc[r]);
      }
      for (int r = 0; r < 4; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        y[(size_t)b * O + o + r] = _mm_cvtss_f32(s);
      }
    }
  }
}
