/* The vector of the instruction set a kernel is built for (gcc's generic vectors: one source for SSE, AVX and
   AVX-512), sums across its lanes, and bf16 widened one value at a time. Included by each kernel's C file. */
#ifndef TLALOC_VECTORS_H
#define TLALOC_VECTORS_H
#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));         /* an unaligned load */
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));   /* a comparison's lanes: -1 true, 0 false */

/* A bf16 value as f32: its bits are the f32's upper half. */
static inline float bf16_to_f32(uint16_t h) {
  union { uint32_t i; float f; } u = {.i = (uint32_t)h << 16};
  return u.f;
}

/* live ? a : b, lane by lane. */
static inline vf pick(vi live, vf a, vf b) { return (vf)(((vi)a & live) | ((vi)b & ~live)); }

/* The sum of a vector's lanes, halving it. */
static inline float lanes_sum(vf v) {
#if VL == 16
  typedef float v8 __attribute__((vector_size(32)));
  const v8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
#elif VL == 8
  const v4 h4 = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  const v4 h4 = v;
#endif
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* x in every lane. */
static inline vf broadcast(float x) {
  const vf one = (vf){0} + 1.0f;   /* x * 1 is x exactly, so gcc emits a single broadcast (a lane loop it did not) */
  return one * x;
}

/* a's and b's neighbouring lanes summed within each 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3, a4 + a5, ...]
   (x86's shufps, which does not cross 128-bit lanes). */
static inline vf pair_sums(vf a, vf b) {
#if VL == 16
  return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
#elif VL == 8
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
#else
  return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
#endif
}

/* out[i] = the sum of a[i]'s lanes, i < 8: pairs summed twice within 128-bit lanes (each holding a[0..3]'s, or
   a[4..7]'s, partial sums in order), then the 128-bit lanes added: one sum per lane rather than a lane sum per
   vector. */
static inline void lanes_sums8(const vf a[8], float out[8]) {
  const vf q0 = pair_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3]));
  const vf q1 = pair_sums(pair_sums(a[4], a[5]), pair_sums(a[6], a[7]));
#if VL == 4
  for (int i = 0; i < 4; i++) out[i] = q0[i], out[4 + i] = q1[i];
#elif VL == 8
  const vf r = __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 8; i++) out[i] = r[i];
#else
  const vf t = __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(q0, q1, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 8; i++) out[i] = t[i] + t[8 + i];
#endif
}

#endif
