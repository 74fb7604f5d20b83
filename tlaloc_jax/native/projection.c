/* The projection of an out-major weight for the CPU, as a typed XLA FFI handler (stablehlo.custom_call, api_version 4).

   y[m, o] = sum_i x[m, i] w[o, i], the products and their sum in f32 (a dot's arithmetic), w widened exactly in
   registers: out_major_product's semantics (tlaloc_jax/kernels/quantized_matmul.py) without the weight-sized f32
   copy XLA's dot makes of a narrow weight, and with the register tiling XLA's multiply-reduce lacks at a few dozen
   rows. A tile of MR input rows by NR weight rows keeps MR x NR vector accumulators along i (the weight row's
   inputs are contiguous), summed across lanes at its end; up to 8 rows a tile takes one weight row (one stream). Items (a block of outputs, by a block of rows when there
   are many) run on XLA's intra-op threads.

   Operands: x [M, I] f32; w [O, I] f32, bf16 or s8. Result [M, O] f32. */
#include "ffi_common.h"
#include "vectors.h"

#include <stddef.h>
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));
typedef int8_t vb_u __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

enum { F32, BF16, S8 };
#define OUT_BLOCK 48  /* outputs an item computes */
#define ROW_BLOCK 48  /* rows an item computes when there are more (a multiple of every MR) */

typedef struct {
  const float *x;
  const void *w;
  float *y;
  int M, O, I, kind, out_blocks;
} Problem;

/* VL weights from w's row at element i, as f32. x86 has one instruction that widens a narrow vector in place;
   gcc's generic conversions split it into halves, so those widenings are written with the intrinsics. */
static inline vf load_w(const void *w, size_t at, int kind) {
  if (kind == F32) return (vf) * (const vf_u *)((const float *)w + at);
#if defined(__AVX512F__)
  const void *p = kind == BF16 ? (const void *)((const uint16_t *)w + at) : (const void *)((const int8_t *)w + at);
  if (kind == BF16) return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
  const void *p = kind == BF16 ? (const void *)((const uint16_t *)w + at) : (const void *)((const int8_t *)w + at);
  if (kind == BF16) return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
  if (kind == BF16) return (vf)(__builtin_convertvector(*(const vh_u *)((const uint16_t *)w + at), vu) << 16);
  return __builtin_convertvector(__builtin_convertvector(*(const vb_u *)((const int8_t *)w + at), vi), vf);
#endif
}

static inline float load_w1(const void *w, size_t at, int kind) {
  if (kind == F32) return ((const float *)w)[at];
  if (kind == BF16) return bf16_to_f32(((const uint16_t *)w)[at]);
  return (float)((const int8_t *)w)[at];
}

/* gcc folds a load each FMA uses into the FMA, so a weight vector MR rows share would be read MR times (loads,
   not FMAs, then bound the tile); an empty asm that claims to change it keeps it in a register. */
#if defined(__x86_64__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif
#define MAX_MR 3
#define MAX_NR 8
#define MAX_STREAM_ROWS 8  /* the most rows stream_rows takes (STREAM_ROWS calls go through it) */
/* Rows [m, m + MR) by weight rows [o, o + NR): MR x NR accumulators along i, the tail of i past a whole vector
   one element at a time. MR, NR and kind are constants where it is inlined (the arrays have fixed sizes so that
   the unrolled tile keeps them in registers). */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m, int o, const int MR, const int NR,
                                                       const int kind) {
  const int I = p->I, whole = I - I % VL;
  vf acc[MAX_MR][MAX_NR];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) acc[r][c] = (vf){0};
  const float *x = p->x + (size_t)m * I;
  const size_t w0 = (size_t)o * I;
  for (int i = 0; i < whole; i += VL) {
    vf xv[MAX_MR];
    for (int r = 0; r < MR; r++) {
      xv[r] = (vf) * (const vf_u *)(x + (size_t)r * I + i);
      KEEP_IN_REGISTER(xv[r]);
    }
    for (int c = 0; c < NR; c++) {
      vf wv = load_w(p->w, w0 + (size_t)c * I + i, kind);
      KEEP_IN_REGISTER(wv);
      for (int r = 0; r < MR; r++) acc[r][c] += xv[r] * wv;
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) {
      float s = lanes_sum(acc[r][c]);
      for (int i = whole; i < I; i++) s += x[(size_t)r * I + i] * load_w1(p->w, w0 + (size_t)c * I + i, kind);
      p->y[(size_t)(m + r) * p->O + o + c] = s;
    }
}

/* Row m by weight row o, four accumulators along i: a single row reads the weights in one sequential pass, row
   after row, which the hardware prefetcher follows (short strided streams, as a tile of rows reads them, it does
   not: an int8 weight's row is a few cache lines). */
static inline __attribute__((always_inline)) void row_dot(const Problem *p, int m, int o, const int kind) {
  const int I = p->I, whole = I - I % (4 * VL);
  const float *x = p->x + (size_t)m * I;
  const size_t w0 = (size_t)o * I;
  vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  for (int i = 0; i < whole; i += 4 * VL) {
    a0 += (vf) * (const vf_u *)(x + i) * load_w(p->w, w0 + i, kind);
    a1 += (vf) * (const vf_u *)(x + i + VL) * load_w(p->w, w0 + i + VL, kind);
    a2 += (vf) * (const vf_u *)(x + i + 2 * VL) * load_w(p->w, w0 + i + 2 * VL, kind);
    a3 += (vf) * (const vf_u *)(x + i + 3 * VL) * load_w(p->w, w0 + i + 3 * VL, kind);
  }
  float s = lanes_sum((a0 + a1) + (a2 + a3));
  for (int i = whole; i < I; i++) s += x[i] * load_w1(p->w, w0 + i, kind);
  p->y[(size_t)m * p->O + o] = s;
}

/* Rows [m, m + MR) by weight row o, for a few rows: the weight row read once, in one sequential pass (so the
   block's weights are one stream the prefetcher follows, as row_dot's are), each vector of it multiplied into every
   row. Two accumulators a row along i up to 4 rows, one from 5 (8 rows: 8 chains keep the FMA units busy); the
   line a kilobyte ahead is fetched as the pass goes (memory, not arithmetic, bounds a few rows). */
#define STREAM_AHEAD 1024
static inline __attribute__((always_inline)) void stream_rows(const Problem *p, int m, int o, const int MR,
                                                              const int kind) {
  const int I = p->I, A = MR <= 4 ? 2 : 1, whole = I - I % (A * VL);
  const size_t elem = kind == F32 ? 4 : kind == BF16 ? 2 : 1;
  const float *x = p->x + (size_t)m * I;
  const size_t w0 = (size_t)o * I;
  const char *ahead = (const char *)p->w + w0 * elem + STREAM_AHEAD;
  vf acc[MAX_STREAM_ROWS][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (vf){0};
  for (int i = 0; i < whole; i += A * VL) {
    if ((i * elem) % 64 < A * VL * elem) __builtin_prefetch(ahead + i * elem, 0, 3);
    for (int a = 0; a < A; a++) {
      vf wv = load_w(p->w, w0 + i + a * VL, kind);
      KEEP_IN_REGISTER(wv);
      for (int r = 0; r < MR; r++) acc[r][a] += (vf) * (const vf_u *)(x + (size_t)r * I + i + a * VL) * wv;
    }
  }
  for (int r = 0; r < MR; r++) {
    float s = lanes_sum(A == 2 ? acc[r][0] + acc[r][1] : acc[r][0]);
    for (int i = whole; i < I; i++) s += x[(size_t)r * I + i] * load_w1(p->w, w0 + i, kind);
    p->y[(size_t)(m + r) * p->O + o] = s;
  }
}

/* The weights of the item a thread runs next, fetched into L2 a few lines after each tile while this item computes:
   an item of many rows reads its weights from memory in its first row tile, which then waits on the read. */
typedef struct {
  const char *at, *end;
  size_t lines;    /* a tile's share */
} Ahead;

static inline void fetch_ahead(Ahead *a) {
  for (size_t k = 0; k < a->lines && a->at < a->end; k++, a->at += 64) __builtin_prefetch(a->at, 0, 2);
}

static inline __attribute__((always_inline)) void rows_by(const Problem *p, int m, int o0, int o1, const int MR,
                                                          const int NR, const int kind, Ahead *ahead) {
  int o = o0;
  for (; o + NR <= o1; o += NR) {
    tile(p, m, o, MR, NR, kind);
    fetch_ahead(ahead);
  }
  for (; o < o1; o++) tile(p, m, o, MR, 1, kind);
}

/* Rows [m0, m1) by outputs [o0, o1). A single row: row_dot over each weight row; up to STREAM_ROWS rows:
   stream_rows over each weight row, 8, 4, 3 or 2 rows at a time (the block's weights stay in L2 for a second
   pass). More: tiles of rows (kept in L1) by the block's weight rows a few at a time: 3 x 4 tiles, rows left over
   in 2 x 4 or 1 x 8 tiles (8 accumulators keep the FMA units busy), the last outputs one at a time. */
#define STREAM_ROWS 8
#define TILES(kind)                                                                                         \
  static void block_##kind(const Problem *p, int m0, int m1, int o0, int o1, Ahead *a) {                  \
    const int n = m1 - m0;                                                                                 \
    int m = m0;                                                                                            \
    if (n == 1) {                                                                                          \
      for (int o = o0; o < o1; o++) row_dot(p, m0, o, kind);                                                \
      return;                                                                                              \
    }                                                                                                      \
    if (n <= STREAM_ROWS) {                                                                                \
      for (; m + 8 <= m1; m += 8)                                                                          \
        for (int o = o0; o < o1; o++) stream_rows(p, m, o, 8, kind);                                       \
      for (; m + 4 <= m1; m += 4)                                                                          \
        for (int o = o0; o < o1; o++) stream_rows(p, m, o, 4, kind);                                       \
      if (m + 3 == m1)                                                                                     \
        for (int o = o0; o < o1; o++) stream_rows(p, m, o, 3, kind);                                       \
      if (m + 2 == m1)                                                                                     \
        for (int o = o0; o < o1; o++) stream_rows(p, m, o, 2, kind);                                       \
      if (m + 1 == m1)                                                                                     \
        for (int o = o0; o < o1; o++) row_dot(p, m, o, kind);                                              \
      return;                                                                                              \
    }                                                                                                      \
    for (; m + 3 <= m1; m += 3) rows_by(p, m, o0, o1, 3, 4, kind, a);                                          \
    if (m + 2 <= m1) rows_by(p, m, o0, o1, 2, 4, kind, a), m += 2;                                             \
    if (m < m1) rows_by(p, m, o0, o1, 1, 8, kind, a);                                                          \
  }
TILES(F32)
TILES(BF16)
TILES(S8)

/* Item i: out block i % out_blocks of row block i / out_blocks. From AHEAD_ROWS rows the next item's weights are
   fetched ahead (fewer rows read them at the rate memory gives them). */
#define AHEAD_ROWS 12
static void item(const void *problem, int i, int next) {
  const Problem *p = problem;
  const int ob = i % p->out_blocks, mb = i / p->out_blocks;
  const int o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < p->O ? o0 + OUT_BLOCK : p->O;
  const int m0 = mb * ROW_BLOCK, m1 = m0 + ROW_BLOCK < p->M ? m0 + ROW_BLOCK : p->M;
  Ahead a = {NULL, NULL, 0};
  if (next >= 0 && m1 - m0 >= AHEAD_ROWS) {
    const int n0 = next % p->out_blocks * OUT_BLOCK, n1 = n0 + OUT_BLOCK < p->O ? n0 + OUT_BLOCK : p->O;
    const size_t elem = p->kind == F32 ? 4 : p->kind == BF16 ? 2 : 1, row = (size_t)p->I * elem;
    const size_t tiles = (size_t)((m1 - m0) / 3) * ((o1 - o0) / 4) + 1;
    a.at = (const char *)p->w + n0 * row;
    a.end = (const char *)p->w + n1 * row;
    a.lines = ((size_t)(a.end - a.at) / 64 + tiles - 1) / tiles;
  }
  if (p->kind == F32) block_F32(p, m0, m1, o0, o1, &a);
  else if (p->kind == BF16) block_BF16(p, m0, m1, o0, o1, &a);
  else block_S8(p, m0, m1, o0, o1, &a);
}

XLA_FFI_Error *tlaloc_projection_v1(XLA_FFI_CallFrame *frame) {
  if (answered_metadata(frame) || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const XLA_FFI_Api *api = frame->api;
  if (frame->args.size != 2 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
      frame->args.types[1] != XLA_FFI_ArgType_BUFFER)
    return refuse(api, "tlaloc_projection_v1: takes two arrays and gives one");
  XLA_FFI_Buffer *x = frame->args.args[0], *w = frame->args.args[1], *y = frame->rets.rets[0];
  const int kind = w->dtype == XLA_FFI_DataType_F32 ? F32 : w->dtype == XLA_FFI_DataType_BF16 ? BF16
                   : w->dtype == XLA_FFI_DataType_S8 ? S8 : -1;
  if (x->rank != 2 || w->rank != 2 || y->rank != 2 || x->dtype != XLA_FFI_DataType_F32 || kind < 0 ||
      y->dtype != XLA_FFI_DataType_F32)
    return refuse(api, "tlaloc_projection_v1: operands differ from x [M, I] f32, w [O, I] f32, bf16 or s8");
  const int M = (int)x->dims[0], I = (int)x->dims[1], O = (int)w->dims[0];
  if (w->dims[1] != I || y->dims[0] != M || y->dims[1] != O)
    return refuse(api, "tlaloc_projection_v1: x [M, I], w [O, I] and the result [M, O] do not agree");
  const int out_blocks = (O + OUT_BLOCK - 1) / OUT_BLOCK, row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  const Problem p = {x->data, w->data, y->data, M, O, I, kind, out_blocks};
  run_parallel(api, frame->ctx, item, &p, out_blocks * row_blocks);
  return NULL;
}
