/* The projection of an out-major weight for the CPU, as a typed XLA FFI handler (stablehlo.custom_call, api_version 4).

   y[m, o] = sum_i x[m, i] w[o, i], the products and their sum in f32 (a dot's arithmetic), w widened exactly in
   registers: out_major_product's semantics (tlaloc_jax/kernels/quantized_matmul.py) without the weight-sized f32
   copy XLA's dot makes of a narrow weight. Up to 8 rows each weight row is read once, in one sequential pass, into
   every row (memory bounds a few rows); more rows are copied into panels of 2 * VL rows laid out input by input, and
   a tile broadcasts one input of 6 weight rows against a panel's two vectors: 12 FMAs for 2 vector loads and 6
   broadcasts, no sums across lanes (arithmetic bounds many rows). Items (a block of outputs, by a block of rows when
   there are many) run on XLA's intra-op threads.

   Operands: x [M, I] f32; w [O, I] f32, bf16 or s8. Result [M, O] f32. */
#include "ffi_common.h"
#include "vectors.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));
typedef int8_t vb_u __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

enum { F32, BF16, S8 };
#define OUT_BLOCK 48        /* outputs an item computes (a multiple of WEIGHT_ROWS) */
#define PANEL (2 * VL)      /* rows a panel holds */
/* Rows an item computes when there are more: 3 panels for f32 weights; 8 for narrow ones, so that each block of
   widened weights serves more panels. */
#define ROW_BLOCK(kind) ((kind) == F32 ? 3 * PANEL : 8 * PANEL)
#define WEIGHT_ROWS 6       /* weight rows a panel tile broadcasts */
#define STREAM_ROWS 8       /* up to this many rows (stream_rows' most), one stream of weights; panels past */

typedef struct {
  const float *x;
  const float *panels;   /* x in panels (pack_panels), when M > STREAM_ROWS */
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
/* Row m by weight rows [o, o + R), the R rows read side by side (a vector of each a step, x's vector loaded once
   for them), A accumulators a row along i. f32 weights 3 rows of one accumulator: three short streams keep more
   reads in flight than one row's pass (4-5% faster on the 100M model's projections, docs/cpu.md), and a block's
   rows are still one stretch of memory. Narrow weights one row of four: widening, not memory, bounds their pass. */
#define F32_ROWS 3
static inline __attribute__((always_inline)) void rows_dot(const Problem *p, int m, int o, const int R, const int A,
                                                           const int kind) {
  const int I = p->I, whole = I - I % (A * VL);
  const float *x = p->x + (size_t)m * I;
  const size_t w0 = (size_t)o * I;
  vf acc[F32_ROWS][4];
  for (int r = 0; r < R; r++)
    for (int a = 0; a < A; a++) acc[r][a] = (vf){0};
  for (int i = 0; i < whole; i += A * VL)
    for (int a = 0; a < A; a++) {
      vf xv = *(const vf_u *)(x + i + a * VL);
      if (R > 1) KEEP_IN_REGISTER(xv);   /* one row: folded into its FMA (a narrow weight's pass is bound by uops) */
      for (int r = 0; r < R; r++) acc[r][a] += xv * load_w(p->w, w0 + (size_t)r * I + i + a * VL, kind);
    }
  for (int r = 0; r < R; r++) {
    vf v = acc[r][0];
    for (int a = 1; a < A; a++) v += acc[r][a];
    float s = lanes_sum(v);
    for (int i = whole; i < I; i++) s += x[i] * load_w1(p->w, w0 + (size_t)r * I + i, kind);
    p->y[(size_t)m * p->O + o + r] = s;
  }
}

/* Row m by weight rows [o0, o1). */
static inline __attribute__((always_inline)) void row_by(const Problem *p, int m, int o0, int o1, const int kind) {
  int o = o0;
  if (kind == F32) {
    for (; o + F32_ROWS <= o1; o += F32_ROWS) rows_dot(p, m, o, F32_ROWS, 1, kind);
    for (; o < o1; o++) rows_dot(p, m, o, 1, 1, kind);
  } else {
    for (; o < o1; o++) rows_dot(p, m, o, 1, 4, kind);
  }
}

/* Rows [m, m + MR) by weight row o, for a few rows: the weight row read once, in one sequential pass (so the
   block's weights are one stream the prefetcher follows, as rows_dot's are), each vector of it multiplied into every
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
  vf acc[STREAM_ROWS][2];
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

/* x [M, I] -> panels of PANEL rows, each [I][PANEL] (row r of panel k at [i * PANEL + r]), rows past M zero. */
static void pack_panels(const float *x, int M, int I, float *panels) {
  for (int p0 = 0; p0 < M; p0 += PANEL) {
    float *dst = panels + (size_t)p0 * I;
    const int rows = M - p0 < PANEL ? M - p0 : PANEL;
    for (int r = 0; r < rows; r++)
      for (int i = 0; i < I; i++) dst[(size_t)i * PANEL + r] = x[(size_t)(p0 + r) * I + i];
    for (int r = rows; r < PANEL; r++)
      for (int i = 0; i < I; i++) dst[(size_t)i * PANEL + r] = 0.f;
  }
}

/* Inputs [k0, k0 + kn) of the panel at row m by NW f32 weight rows (row j's input k0 + k at w[j * stride + k]),
   outputs [o, o + NW): for each input, its value in each weight row broadcast and multiplied into the panel's two
   vectors (2 * NW accumulators, one lane a row), added to y unless k0 is 0. NW is a constant where it is inlined. */
static inline __attribute__((always_inline)) void panel_tile(const Problem *p, const float *w, size_t stride, int k0,
                                                             int kn, int m, int o, const int NW) {
  const float *panel = p->panels + (size_t)m * p->I + (size_t)k0 * PANEL;
  vf lo[WEIGHT_ROWS], hi[WEIGHT_ROWS];
  for (int j = 0; j < NW; j++) lo[j] = hi[j] = (vf){0};
  for (int k = 0; k < kn; k++) {
    vf x0 = *(const vf *)(panel + (size_t)k * PANEL), x1 = *(const vf *)(panel + (size_t)k * PANEL + VL);
    KEEP_IN_REGISTER(x0);
    KEEP_IN_REGISTER(x1);
    for (int j = 0; j < NW; j++) {
      const vf wb = broadcast(w[j * stride + k]);
      lo[j] += x0 * wb;
      hi[j] += x1 * wb;
    }
  }
  const int rows = p->M - m < PANEL ? p->M - m : PANEL;
  for (int j = 0; j < NW; j++) {
    float sums[PANEL] __attribute__((aligned(64)));   /* stored whole: a lane picked by a variable index would make
                                                         gcc keep an accumulator in memory through the loop */
    *(vf *)sums = lo[j];
    *(vf *)(sums + VL) = hi[j];
    for (int r = 0; r < rows; r++) {
      float *out = p->y + (size_t)(m + r) * p->O + o + j;
      *out = (k0 ? *out : 0.f) + sums[r];
    }
  }
}

/* Inputs [k0, k0 + kn) of weight rows [o, o + n) as f32 rows: w itself for f32 weights (row stride I), else widened
   into `wide` (row stride kn). */
static inline __attribute__((always_inline)) const float *f32_rows(const Problem *p, int o, int n, int k0, int kn,
                                                                   float *wide, size_t *stride, const int kind) {
  const size_t I = (size_t)p->I, whole = kn - kn % VL;
  if (kind == F32) {
    *stride = I;
    return (const float *)p->w + (size_t)o * I + k0;
  }
  for (int j = 0; j < n; j++) {
    const size_t from = (size_t)(o + j) * I + k0;
    float *to = wide + (size_t)j * kn;
    for (size_t k = 0; k < whole; k += VL) *(vf_u *)(to + k) = load_w(p->w, from + k, kind);
    for (size_t k = whole; k < (size_t)kn; k++) to[k] = load_w1(p->w, from + k, kind);
  }
  *stride = kn;
  return wide;
}

/* Rows [m0, m1) of the panels by outputs [o0, o1): WEIGHT_ROWS weight rows at a time (the last outputs of the block
   fewer; in L1) against each panel of the block (in L2); narrow weights INPUT_BLOCK inputs at a time, widened once
   for all the block's panels (f32 ones whole). Each block past the first reads and writes the tiles' results again
   (scattered over y's rows), so the blocks are long: 48 KB of stack. */
#define INPUT_BLOCK 2048
static inline __attribute__((always_inline)) void panels_by(const Problem *p, int m0, int m1, int o0, int o1,
                                                            const int kind) {
  float wide[WEIGHT_ROWS * INPUT_BLOCK];
  const int kb = kind == F32 ? p->I : INPUT_BLOCK;
  for (int o = o0; o < o1; o += WEIGHT_ROWS) {
    const int nw = o1 - o < WEIGHT_ROWS ? o1 - o : WEIGHT_ROWS;
    for (int k0 = 0; k0 < p->I; k0 += kb) {
      const int kn = p->I - k0 < kb ? p->I - k0 : kb;
      size_t stride;
      const float *w = f32_rows(p, o, nw, k0, kn, wide, &stride, kind);
      for (int m = m0; m < m1; m += PANEL) switch (nw) {
          case 6: panel_tile(p, w, stride, k0, kn, m, o, 6); break;
          case 5: panel_tile(p, w, stride, k0, kn, m, o, 5); break;
          case 4: panel_tile(p, w, stride, k0, kn, m, o, 4); break;
          case 3: panel_tile(p, w, stride, k0, kn, m, o, 3); break;
          case 2: panel_tile(p, w, stride, k0, kn, m, o, 2); break;
          default: panel_tile(p, w, stride, k0, kn, m, o, 1);
        }
    }
  }
}

/* Rows [m0, m1) by outputs [o0, o1). A single row: row_by; up to STREAM_ROWS rows:
   stream_rows over each weight row, 8, 4, 3 or 2 rows at a time (the block's weights stay in L2 for a second
   pass). More: panels_by. */
#define BLOCK(kind)                                                                                          \
  static void block_##kind(const Problem *p, int m0, int m1, int o0, int o1) {                              \
    const int n = m1 - m0;                                                                                 \
    int m = m0;                                                                                            \
    if (n == 1) {                                                                                          \
      row_by(p, m0, o0, o1, kind);                                                                         \
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
      if (m + 1 == m1) row_by(p, m, o0, o1, kind);                                                         \
      return;                                                                                              \
    }                                                                                                      \
    panels_by(p, m0, m1, o0, o1, kind);                                                                    \
  }
BLOCK(F32)
BLOCK(BF16)
BLOCK(S8)

/* Item i: out block i % out_blocks of row block i / out_blocks. */
static void item(const void *problem, int i) {
  const Problem *p = problem;
  const int ob = i % p->out_blocks, mb = i / p->out_blocks;
  const int o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < p->O ? o0 + OUT_BLOCK : p->O;
  const int rb = ROW_BLOCK(p->kind), m0 = mb * rb, m1 = m0 + rb < p->M ? m0 + rb : p->M;
  if (p->kind == F32) block_F32(p, m0, m1, o0, o1);
  else if (p->kind == BF16) block_BF16(p, m0, m1, o0, o1);
  else block_S8(p, m0, m1, o0, o1);
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
  const int out_blocks = (O + OUT_BLOCK - 1) / OUT_BLOCK, row_blocks = (M + ROW_BLOCK(kind) - 1) / ROW_BLOCK(kind);
  float *panels = NULL;
  if (M > STREAM_ROWS) {
    const size_t bytes = (size_t)(M + PANEL - 1) / PANEL * PANEL * I * sizeof(float);
    panels = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!panels) return refuse(api, "tlaloc_projection_v1: no memory for the rows' panels");
    pack_panels(x->data, M, I, panels);
  }
  const Problem p = {x->data, panels, w->data, y->data, M, O, I, kind, out_blocks};
  run_parallel(api, frame->ctx, item, &p, out_blocks * row_blocks);
  free(panels);
  return NULL;
}
