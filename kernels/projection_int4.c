/* The projection of an out-major 4-bit weight for the CPU, as a typed XLA FFI handler (api_version 4).

   y[m, o] = sum_G s[o, G] sum_{i in G} (c[o, i] - z[o, G]) x[m, i]: codes c two a byte ([O, I / 2]; in a group of
   g inputs, byte j holds input j in its low nibble and j + g / 2 in its high one), an f32 scale s per group of
   g = 32, 64 or 128 inputs ([O, I / g]). int4 (three operands): signed nibbles in [-8, 7], no zero point; uint4
   (a fourth operand, zeros int8 [O, I / g]): unsigned nibbles in [0, 15] less their group's zero.

   As llama.cpp's Q4_0 x Q8_0 dot: x is quantized to int8 per block of 32 inputs (scale amax / 127, rounded half to
   even), and the codes, widened to bytes in registers as unsigned nibbles u (int4: code + 8), meet it in integer
   dot instructions (AVX-512 VNNI vpdpbusd; AVX-512BW or AVX2 vpmaddubsw + vpmaddwd; plain C elsewhere). A block is
   the 32 inputs of 16 consecutive code bytes (their low and high nibbles: for groups of 32, one group), so a lane's
   low-nibble and high-nibble dots share their scales and add as integers; each lane is then scaled in f32 (weight
   scale times x's block scale). The offset is taken off in the integers: the widened bytes are u = code + K - zero
   (int4: K = 8, the code's sign flipped; uint4: K = 16, zeros 0..15, so u is 1..31), and each lane's dot starts
   from -K times the lane's sum of quantized x, one vector a row and chunk that every output shares. x is laid out
   in the codes' order (a chunk of 64 code bytes: the 64 inputs of its low nibbles, then the 64 of its high ones),
   so a chunk of codes is one load, a mask and a shift, widened once for all of a tile's rows. What quantizing x
   adds is bounded by tolerances.activation_quantization_std.

   Operands: x [M, I] f32, codes [O, I / 2] s8, scales [O, I / g] f32 (, zeros [O, I / g] s8). Result [M, O] f32.
   Items (a block of outputs by a block of rows) run on XLA's intra-op threads. */
#include "ffi_common.h"
#include "vectors.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef uint8_t u8x64_u __attribute__((vector_size(64), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));
typedef float f32x4_u __attribute__((vector_size(16), aligned(4)));
typedef float f32x2_u __attribute__((vector_size(8), aligned(4)));

#define CHUNK 64          /* code bytes a chunk: 128 inputs, four of x's blocks */
#define BLOCK_BYTES 16    /* code bytes of one of x's blocks (32 inputs) */
#define OUT_BLOCK 32      /* outputs an item computes */
#define ROW_BLOCK 64      /* rows an item computes */
/* A tile: rows by outputs, each chunk of an output's codes widened once for the tile's rows. AVX-512 holds a 4 x 4
   tile's accumulators, widened codes and scales in its 32 registers; 16 registers hold 2 x 2. */
#ifndef TILE_ROWS
#if defined(__AVX512F__)
#define TILE_ROWS 4
#define TILE_OUTS 4
#elif defined(__AVX2__)
#define TILE_ROWS 1
#define TILE_OUTS 2
#else
#define TILE_ROWS 2
#define TILE_OUTS 2
#endif
#endif

typedef struct {
  const float *x;
  const uint8_t *codes;
  const float *scales;
  const int8_t *zeros;   /* NULL: int4 (signed codes, offset 8) */
  int8_t *xq;            /* [M][chunks * 128] x quantized, in the codes' order */
  float *xscale;         /* [M][chunks][16] each dot lane's x scale (lane l: block 4 c + l / 4) */
  int32_t *xoff;         /* [M][chunks][16] each dot lane's start: -K times its sum of quantized x */
  float *y;
  int M, O, I, G, g, chunks, out_blocks;
  uint8_t flip;          /* 0x88 for int4: a signed nibble XOR 8 is code + 8 */
} Problem;

/* Input i of x's row for byte b of a row's codes: its low nibble (h 0) or high one (h 1). */
static inline int input_of(int b, int h, int g) { return b / (g / 2) * g + h * (g / 2) + b % (g / 2); }

/* Row m of x: quantized to int8 per block (16 code bytes' inputs) in the codes' order, each dot lane's scale and
   start. */
static void quantize_row(const void *problem, int m) {
  const Problem *p = problem;
  const int half = p->I / 2, blocks = p->chunks * (CHUNK / BLOCK_BYTES);
  const float *x = p->x + (size_t)m * p->I;
  int8_t *xq = p->xq + (size_t)m * p->chunks * 2 * CHUNK;
  float *xscale = p->xscale + (size_t)m * p->chunks * 16;
  int32_t *xoff = p->xoff + (size_t)m * p->chunks * 16;
  const int32_t K = p->zeros ? 16 : 8;
  for (int k = 0; k < blocks; k++) {
    float v[2][BLOCK_BYTES], amax = 0.f;
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < BLOCK_BYTES; j++) {
        const int b = k * BLOCK_BYTES + j;
        v[h][j] = b < half ? x[input_of(b, h, p->g)] : 0.f;   /* a chunk past the codes' end: zeros */
        amax = fabsf(v[h][j]) > amax ? fabsf(v[h][j]) : amax;
      }
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    const int c = k / (CHUNK / BLOCK_BYTES), at = k % (CHUNK / BLOCK_BYTES) * BLOCK_BYTES;
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < BLOCK_BYTES; j++) {
        float q = __builtin_rintf(v[h][j] * inverse);    /* the current rounding mode: half to even */
        q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
        xq[(size_t)c * 2 * CHUNK + h * CHUNK + at + j] = (int8_t)q;
      }
    for (int l = 0; l < 4; l++) xscale[c * 16 + at / 4 + l] = scale;
  }
  for (int c = 0; c < p->chunks; c++)
    for (int l = 0; l < 16; l++) {
      int32_t t = 0;
      for (int k = 0; k < 4; k++) t += xq[(size_t)c * 2 * CHUNK + 4 * l + k] + xq[(size_t)c * 2 * CHUNK + CHUNK + 4 * l + k];
      xoff[c * 16 + l] = -K * t;
    }
}

/* Lane l: start[l] + sum_{k < 4} lo[4 l + k] xq[4 l + k] + hi[4 l + k] xq[64 + 4 l + k], unsigned bytes (at most
   31) by signed ones (exact in 32 bits, and vpmaddubsw's 16-bit sums of four products, at most 4 * 31 * 127, do
   not saturate). */
static inline __attribute__((always_inline)) i32x16 chunk_dot(i32x16 start, u8x64 lo, u8x64 hi,
                                                             const int8_t *xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i a = _mm512_dpbusd_epi32((__m512i)start, (__m512i)lo, _mm512_loadu_si512(xq));
  return (i32x16)_mm512_dpbusd_epi32(a, (__m512i)hi, _mm512_loadu_si512(xq + CHUNK));
#elif defined(__AVX512BW__)
  const __m512i a = _mm512_maddubs_epi16((__m512i)lo, _mm512_loadu_si512(xq));
  const __m512i b = _mm512_maddubs_epi16((__m512i)hi, _mm512_loadu_si512(xq + CHUNK));
  return start + (i32x16)_mm512_madd_epi16(_mm512_add_epi16(a, b), _mm512_set1_epi16(1));
#elif defined(__AVX2__)
  typedef uint8_t u8x32 __attribute__((vector_size(32)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  const __m256i one = _mm256_set1_epi16(1);
  i32x8 half[2];
  for (int k = 0; k < 2; k++) {
    const u8x32 l = k ? __builtin_shufflevector(lo, lo, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                                48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
                      : __builtin_shufflevector(lo, lo, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                                18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    const u8x32 h = k ? __builtin_shufflevector(hi, hi, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                                48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
                      : __builtin_shufflevector(hi, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                                18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m256i a = _mm256_maddubs_epi16((__m256i)l, _mm256_loadu_si256((const void *)(xq + 32 * k)));
    const __m256i b = _mm256_maddubs_epi16((__m256i)h, _mm256_loadu_si256((const void *)(xq + CHUNK + 32 * k)));
    half[k] = (i32x8)_mm256_madd_epi16(_mm256_add_epi16(a, b), one);
  }
  return start + __builtin_shufflevector(half[0], half[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  i32x16 s;
  for (int l = 0; l < 16; l++) {
    int32_t t = start[l];
    for (int k = 0; k < 4; k++) t += (int32_t)lo[4 * l + k] * xq[4 * l + k] + (int32_t)hi[4 * l + k] * xq[64 + 4 * l + k];
    s[l] = t;
  }
  return s;
#endif
}

/* Each dot lane's weight scale for chunk c of a row whose scales are s: lane l's bytes 64 c + 4 l .. + 3 lie in
   group (64 c + 4 l) / (g / 2). `part`: the chunk is a row's last, of fewer bytes (its groups copied, so that no
   load reads past the row's scales). */
static inline __attribute__((always_inline)) f32x16 weight_scales(const float *s, int c, const int g, int part,
                                                                  int groups_left) {
  if (g == 128) {
    const f32x16 one = (f32x16){0} + 1.f;
    return one * s[c];
  }
  f32x4_u four = {0};
  if (part) {
    for (int k = 0; k < groups_left && k < (g == 32 ? 4 : 2); k++) four[k] = s[(g == 32 ? 4 : 2) * c + k];
  } else if (g == 32) {
    four = *(const f32x4_u *)(s + 4 * c);
  } else {
    const f32x2_u two = *(const f32x2_u *)(s + 2 * c);
    four = __builtin_shufflevector(two, two, 0, 1, 0, 1);
  }
  if (g == 32) return __builtin_shufflevector(four, four, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return __builtin_shufflevector(four, four, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

/* 16 less each code byte's zero point for chunk c of a row whose zeros are z (groups of g: 4, 2 or 1 to a chunk);
   `part` as weight_scales'. */
static inline __attribute__((always_inline)) u8x64 zero_bytes(const int8_t *z, int c, const int g, int part,
                                                              int groups_left) {
  typedef uint8_t u8x4 __attribute__((vector_size(4)));
  const int per = CHUNK * 2 / g;
  uint32_t word = 0;
  memcpy(&word, z + per * c, part && groups_left < per ? groups_left : per);
  word = 0x10101010u - word;   /* a byte each: the zeros are 0..15, so no byte borrows */
#if defined(__AVX512BW__)   /* a broadcast and one in-lane byte shuffle: byte b takes group b / (g / 2) */
  const __m512i at = g == 32 ? _mm512_set_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303, 0x02020202,
                                                0x02020202, 0x02020202, 0x02020202, 0x01010101, 0x01010101,
                                                0x01010101, 0x01010101, 0, 0, 0, 0)
                 : g == 64 ? _mm512_set_epi32(0x01010101, 0x01010101, 0x01010101, 0x01010101, 0x01010101,
                                              0x01010101, 0x01010101, 0x01010101, 0, 0, 0, 0, 0, 0, 0, 0)
                           : _mm512_setzero_si512();
  return (u8x64)_mm512_shuffle_epi8(_mm512_set1_epi32((int32_t)word), at);
#elif defined(__AVX2__)     /* the same, a half at a time */
  typedef uint8_t u8x32 __attribute__((vector_size(32)));
  const __m256i all = _mm256_set1_epi32((int32_t)word), two = _mm256_set1_epi32(0x02020202);
  const __m256i at = g == 32 ? _mm256_set_epi32(0x01010101, 0x01010101, 0x01010101, 0x01010101, 0, 0, 0, 0)
                             : _mm256_setzero_si256();
  const u8x32 first = (u8x32)_mm256_shuffle_epi8(all, at);
  const u8x32 second = (u8x32)_mm256_shuffle_epi8(all, g == 32 ? _mm256_add_epi8(at, two)
                                                              : g == 64 ? _mm256_set1_epi8(1) : at);
  u8x64 out;   /* the halves joined in memory: a 64-byte shuffle of two halves goes byte by byte */
  memcpy(&out, &first, 32);
  memcpy((char *)&out + 32, &second, 32);
  return out;
#endif
  u8x4 four;
  memcpy(&four, &word, 4);
  if (g == 32)
    return __builtin_shufflevector(four, four, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                   1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                                   3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3);
  if (g == 64)
    return __builtin_shufflevector(four, four, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                   0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                   1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return (u8x64){0} + four[0];
}

static inline float sum16(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Chunk c of the tile's rows and outputs into acc; `part`: the rows' last chunk, of fewer bytes (copied, so that
   no load reads past the codes). */
static inline __attribute__((always_inline)) void chunk_step(f32x16 acc[TILE_ROWS][TILE_OUTS], const uint8_t **wrow,
                                                             const float **srow, const int8_t **zrow,
                                                             const int8_t **xrow, const float **xsrow,
                                                             const int32_t **xorow, int c, int half, int G,
                                                             uint8_t flip, const int MR, const int NR, const int g,
                                                             const int zeroed, int part) {
  u8x64 lo[TILE_OUTS], hi[TILE_OUTS];
  f32x16 ws[TILE_OUTS];
  for (int j = 0; j < NR; j++) {
    u8x64 v;
    if (part) {
      uint8_t last[CHUNK] = {0};
      memcpy(last, wrow[j] + (size_t)c * CHUNK, half - c * CHUNK);
      v = *(const u8x64_u *)last ^ flip;
    } else {
      v = *(const u8x64_u *)(wrow[j] + (size_t)c * CHUNK) ^ flip;
    }
    lo[j] = v & 15;
    hi[j] = v >> 4;
    if (zeroed) {   /* uint4: code + 16 - zero */
      const u8x64 k = zero_bytes(zrow[j], c, g, part, G - c * (CHUNK * 2 / g));
      lo[j] += k;
      hi[j] += k;
    }
    ws[j] = weight_scales(srow[j], c, g, part, G - c * (CHUNK * 2 / g));
  }
  for (int r = 0; r < MR; r++) {
    const int8_t *xq = xrow[r] + (size_t)c * 2 * CHUNK;
    const f32x16 xs = *(const f32x16_u *)(xsrow[r] + (size_t)c * 16);
    const i32x16 start = *(const i32x16 *)(xorow[r] + (size_t)c * 16);
    for (int j = 0; j < NR; j++)
      acc[r][j] += __builtin_convertvector(chunk_dot(start, lo[j], hi[j], xq), f32x16) * (ws[j] * xs);
  }
}

/* Rows [m, m + MR) by outputs [o, o + NR), groups of g; zeroed: uint4 (zero points), a build of its own (the
   branch alone slows the int4 tiles where registers are few). */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m, int o, const int MR, const int NR,
                                                       const int g, const int zeroed) {
  const int half = p->I / 2, whole = half / CHUNK, chunks = p->chunks, G = p->G;
  const uint8_t flip = p->flip;
  const uint8_t *wrow[TILE_OUTS];
  const float *srow[TILE_OUTS], *xsrow[TILE_ROWS];
  const int8_t *zrow[TILE_OUTS], *xrow[TILE_ROWS];
  const int32_t *xorow[TILE_ROWS];
  for (int j = 0; j < NR; j++) {
    wrow[j] = p->codes + (size_t)(o + j) * half;
    srow[j] = p->scales + (size_t)(o + j) * G;
    zrow[j] = zeroed ? p->zeros + (size_t)(o + j) * G : NULL;
  }
  for (int r = 0; r < MR; r++) {
    xrow[r] = p->xq + (size_t)(m + r) * chunks * 2 * CHUNK;
    xsrow[r] = p->xscale + (size_t)(m + r) * chunks * 16;
    xorow[r] = p->xoff + (size_t)(m + r) * chunks * 16;
  }
  f32x16 acc[TILE_ROWS][TILE_OUTS];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = (f32x16){0};
  for (int c = 0; c < whole; c++)
    chunk_step(acc, wrow, srow, zrow, xrow, xsrow, xorow, c, half, G, flip, MR, NR, g, zeroed, 0);
  if (whole < chunks)
    chunk_step(acc, wrow, srow, zrow, xrow, xsrow, xorow, whole, half, G, flip, MR, NR, g, zeroed, 1);
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) p->y[(size_t)(m + r) * p->O + o + j] = sum16(acc[r][j]);
}

/* A tile of R rows by N outputs, where the tile holds them (the others never come). */
#define TILE_CASE(R, N) \
  case (R) * 8 + (N): \
    if ((R) <= TILE_ROWS && (N) <= TILE_OUTS)                                                               \
      tile(p, m, o, (R) <= TILE_ROWS ? (R) : 1, (N) <= TILE_OUTS ? (N) : 1, g, zeroed);                     \
    break;

/* Rows [m0, m1) by outputs [o0, o1), groups of g. */
static inline __attribute__((always_inline)) void block(const Problem *p, int m0, int m1, int o0, int o1,
                                                        const int g, const int zeroed) {
  for (int o = o0; o < o1; o += TILE_OUTS) {
    const int nr = o1 - o < TILE_OUTS ? o1 - o : TILE_OUTS;
    for (int m = m0; m < m1; m += TILE_ROWS) {
      const int mr = m1 - m < TILE_ROWS ? m1 - m : TILE_ROWS;
      switch (mr * 8 + nr) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
      }
    }
  }
}

#define BLOCK_OF(G, Z) \
  static void block##G##_##Z(const Problem *p, int m0, int m1, int o0, int o1) { block(p, m0, m1, o0, o1, G, Z); }
BLOCK_OF(32, 0) BLOCK_OF(64, 0) BLOCK_OF(128, 0) BLOCK_OF(32, 1) BLOCK_OF(64, 1) BLOCK_OF(128, 1)

/* Item i: out block i % out_blocks of row block i / out_blocks. */
static void item(const void *problem, int i) {
  const Problem *p = problem;
  const int ob = i % p->out_blocks, mb = i / p->out_blocks;
  const int o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < p->O ? o0 + OUT_BLOCK : p->O;
  const int m0 = mb * ROW_BLOCK, m1 = m0 + ROW_BLOCK < p->M ? m0 + ROW_BLOCK : p->M;
  if (p->zeros)
    (p->g == 32 ? block32_1 : p->g == 64 ? block64_1 : block128_1)(p, m0, m1, o0, o1);
  else
    (p->g == 32 ? block32_0 : p->g == 64 ? block64_0 : block128_0)(p, m0, m1, o0, o1);
}

XLA_FFI_Error *tlaloc_int4_projection_v1(XLA_FFI_CallFrame *frame) {
  if (answered_metadata(frame) || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const XLA_FFI_Api *api = frame->api;
  const int n = (int)frame->args.size;
  if ((n != 3 && n != 4) || frame->rets.size != 1)
    return refuse(api, "tlaloc_int4_projection_v1: takes x, codes, scales (and zeros) and gives one array");
  for (int a = 0; a < n; a++)
    if (frame->args.types[a] != XLA_FFI_ArgType_BUFFER)
      return refuse(api, "tlaloc_int4_projection_v1: every operand is an array");
  XLA_FFI_Buffer *x = frame->args.args[0], *codes = frame->args.args[1], *scales = frame->args.args[2];
  XLA_FFI_Buffer *zeros = n == 4 ? frame->args.args[3] : NULL, *y = frame->rets.rets[0];
  if (x->rank != 2 || codes->rank != 2 || scales->rank != 2 || y->rank != 2 || x->dtype != XLA_FFI_DataType_F32 ||
      codes->dtype != XLA_FFI_DataType_S8 || scales->dtype != XLA_FFI_DataType_F32 ||
      y->dtype != XLA_FFI_DataType_F32 || (zeros && (zeros->rank != 2 || zeros->dtype != XLA_FFI_DataType_S8)))
    return refuse(api, "tlaloc_int4_projection_v1: operands differ from x [M, I] f32, codes [O, I / 2] s8, "
                       "scales [O, I / g] f32, zeros [O, I / g] s8");
  const int M = (int)x->dims[0], I = (int)x->dims[1], O = (int)codes->dims[0], G = (int)scales->dims[1];
  if (codes->dims[1] * 2 != I || scales->dims[0] != O || G <= 0 || I % G || y->dims[0] != M || y->dims[1] != O ||
      (zeros && (zeros->dims[0] != O || zeros->dims[1] != G)))
    return refuse(api, "tlaloc_int4_projection_v1: x [M, I], codes [O, I / 2], scales and zeros [O, I / g] and the "
                       "result [M, O] do not agree");
  const int g = I / G;
  if (g != 32 && g != 64 && g != 128)
    return refuse(api, "tlaloc_int4_projection_v1: groups of 32, 64 or 128 inputs only");
  const int chunks = (I / 2 + CHUNK - 1) / CHUNK;
  const size_t q_bytes = (size_t)M * chunks * 2 * CHUNK, lanes = (size_t)M * chunks * 16;
  const size_t bytes = q_bytes + lanes * (sizeof(float) + sizeof(int32_t));
  char *scratch = aligned_alloc(64, bytes ? bytes : 64);
  if (!scratch) return refuse(api, "tlaloc_int4_projection_v1: no memory for the quantized rows");
  float *xscale = (float *)(scratch + q_bytes);
  const Problem p = {x->data, codes->data, scales->data, zeros ? zeros->data : NULL, (int8_t *)scratch, xscale,
                     (int32_t *)(xscale + lanes), y->data, M, O, I, G, g, chunks,
                     (O + OUT_BLOCK - 1) / OUT_BLOCK, zeros ? 0 : 0x88};
  run_parallel(api, frame->ctx, quantize_row, &p, M);
  run_parallel(api, frame->ctx, item, &p, p.out_blocks * ((M + ROW_BLOCK - 1) / ROW_BLOCK));
  free(scratch);
  return NULL;
}
