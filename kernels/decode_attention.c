/* Paged decode attention for the CPU, as a typed XLA FFI handler (stablehlo.custom_call, api_version 4).

   One token a row attends over its sequence's pages with an online softmax, one (row, KV head) at a time for that
   head's G query heads. The semantics are paged_attention's with
   T = 1 (tlaloc_jax/kernels/paged_attention.py): row b's token at position p = positions[b] (-1: padding) sees key j
   iff j <= p, j < seq_lens[b] and, with a window W > 0, j > p - W; scores are q.k * scale, soft-capped as
   cap * tanh(s / cap) when cap > 0; a sink logit per query head joins the denominator with no value. A row that
   sees nothing gives 0. The (row, KV head) items run on XLA's own intra-op threads (the FFI thread pool), beside
   the calling thread: threads of another pool would wait for cores XLA's threads hold.

   Operands: q [B, 1, H, D] f32; pool [L, 2, P, S, K, D] f32 or bf16; ints i32[2] = (layer, window);
   tables [B, M] i32; positions [B, 1] i32; seq_lens [B] i32; reals f32[2] = (scale, soft cap, 0 = none);
   optionally sinks [H] f32. Result [B, 1, H, D] f32. G <= MAX_GROUP, D <= MAX_HEAD_DIM. */
#include "ffi_common.h"
#include "vectors.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Query heads a KV head and head size at most: tlaloc_jax/native.py's DEFINES passes them (-D), and the Python side
   refuses larger calls by the same numbers. */
#if !defined(MAX_GROUP) || !defined(MAX_HEAD_DIM)
#error "MAX_GROUP and MAX_HEAD_DIM come from tlaloc_jax/native.py's DEFINES: build this file through tlaloc_jax.native"
#endif
#define STR_(x) #x
#define STR(x) STR_(x)
#define CHUNK 32       /* keys of one page scored, weighed and summed together */
#define KEY_BLOCK 8    /* keys a query head scores at once (lanes_sums8's count) */
#define VALUE_BLOCK 8  /* vectors of a head's output held in registers while a chunk's values are summed */

/* e^x for x <= 0, lane by lane, to about 2 ulp: x = n ln2 + r (n rounded to nearest by adding 1.5 * 2^23, which
   leaves n in the low bits), a degree-6 polynomial for e^r, 2^n from the exponent bits. */
static inline vf exp_nonpositive(vf x) {
  x = pick(x < -87.0f, broadcast(-87.0f), x);
  const vf t = x * 1.44269504f + 12582912.0f, n = t - 12582912.0f;
  const vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
  vf p = broadcast(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * (vf)((((vi)t - 0x4B400000) + 127) << 23);
}

typedef struct {
  const void *pool;
  int bf16, P, S, K, D, H, M, window;
  size_t layer;
  const float *q, *sinks;
  const int32_t *tables, *positions, *seq_lens;
  float scale, cap;
  float *out;
} Problem;

/* Row b's keys [first, end). */
static void key_range(const Problem *a, int b, int *first, int *end) {
  const int p = a->positions[b], n = a->seq_lens[b] < p + 1 ? a->seq_lens[b] : p + 1;
  *first = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
  *end = p < 0 ? 0 : n < a->M * a->S ? n : a->M * a->S;
}

/* The keys of the chunk from key j: to the end of j's page or of the row's keys, at most CHUNK. */
static inline int chunk_keys(int j, int end, int S) {
  const int n = end - j < S - j % S ? end - j : S - j % S;
  return n < CHUNK ? n : CHUNK;
}

/* n rows of D elements, `stride` elements apart from src, as f32 rows of Dp (D rounded up to whole vectors): an
   f32 pool's in place when D is whole vectors, otherwise widened or copied into room, zero past D. */
static inline void rows_f32(const char *src, size_t stride, int n, int bf16, int D, int Dp, float *room,
                            const float **rows) {
  const size_t elem = bf16 ? 2 : 4;
  for (int j = 0; j < n; j++) {
    const char *at = src + (size_t)j * stride * elem;
    if (!bf16 && D == Dp) {
      rows[j] = (const float *)at;
      continue;
    }
    float *r = room + (size_t)j * Dp;
    if (bf16)
      for (int d = 0; d < D; d++) r[d] = bf16_to_f32(((const uint16_t *)at)[d]);
    else
      for (int d = 0; d < D; d++) r[d] = ((const float *)at)[d];
    for (int d = D; d < Dp; d++) r[d] = 0.0f;
    rows[j] = r;
  }
}

/* n rows of `bytes`, `stride` bytes apart from src, fetched into L1: a chunk's rows are a few lines every few
   hundred bytes, from a page anywhere in the pool, which the hardware prefetcher does not foresee. */
static inline void fetch_rows(const char *src, size_t stride, int n, size_t bytes) {
  for (int j = 0; j < n; j++)
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(src + (size_t)j * stride + b, 0, 3);
}

/* s[j] = qg . k[j], j < n: KEY_BLOCK keys at a time, each with its own accumulator along the head, summed across
   lanes together at the block's end (a lane sum per key would cost as much as its products). */
static inline __attribute__((always_inline)) void score(const float *qg, const float *const *k, int n, const int Dp,
                                                        float *s) {
  for (int j = 0; j < n; j += KEY_BLOCK) {
    const float *kb[KEY_BLOCK];
    for (int i = 0; i < KEY_BLOCK; i++) kb[i] = k[j + i < n ? j + i : n - 1];
    vf acc[KEY_BLOCK];
    for (int i = 0; i < KEY_BLOCK; i++) acc[i] = (vf){0};
    for (int d = 0; d < Dp; d += VL) {
      const vf x = *(const vf_u *)(qg + d);
      for (int i = 0; i < KEY_BLOCK; i++) acc[i] += x * *(const vf_u *)(kb[i] + d);
    }
    float sums[KEY_BLOCK];
    lanes_sums8(acc, sums);
    for (int i = 0; i < KEY_BLOCK && j + i < n; i++) s[j + i] = sums[i];
  }
}

/* acc[0, Dp) = acc * rescale + sum_j w[j] v[j], j < n: VALUE_BLOCK vectors of the head held in registers across the
   chunk's values. */
static inline __attribute__((always_inline)) void weigh(float *acc, float rescale, const float *w,
                                                        const float *const *v, int n, const int Dp) {
  for (int d0 = 0; d0 < Dp; d0 += VALUE_BLOCK * VL) {
    const int nv = (Dp - d0) / VL < VALUE_BLOCK ? (Dp - d0) / VL : VALUE_BLOCK;
    vf a[VALUE_BLOCK];
    for (int i = 0; i < nv; i++) a[i] = *(const vf_u *)(acc + d0 + i * VL) * rescale;
    for (int j = 0; j < n; j++) {
      const vf wj = broadcast(w[j]);
      for (int i = 0; i < nv; i++) a[i] += wj * *(const vf_u *)(v[j] + d0 + i * VL);
    }
    for (int i = 0; i < nv; i++) *(vf_u *)(acc + d0 + i * VL) = a[i];
  }
}

/* Row b, KV head kh: its G query heads' outputs, a chunk of one page's keys at a time. Inlined with the common head
   sizes as constants (attend), so that gcc unrolls the loops over a head. */
static inline __attribute__((always_inline)) void attend_d(const Problem *a, int b, int kh, const int D) {
  const int G = a->H / a->K, S = a->S, Dp = (D + VL - 1) / VL * VL;
  const size_t elem = a->bf16 ? 2 : 4, row = (size_t)a->K * D, page = (size_t)S * row, half = (size_t)a->P * page;
  const char *keys = (const char *)a->pool + (a->layer * 2 * half + (size_t)kh * D) * elem;
  const char *values = keys + half * elem;
  float *out = a->out + ((size_t)b * a->H + (size_t)kh * G) * D;
  float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
  vf s[MAX_GROUP][CHUNK / VL];   /* a chunk's scores, then weights */
  vf lane;                       /* 0, 1, ..., VL - 1 */
  for (int i = 0; i < VL; i++) lane[i] = (float)i;
  float room[CHUNK * MAX_HEAD_DIM];
  const float *rows[CHUNK];
  for (int g = 0; g < G; g++) {
    const float *qg = a->q + ((size_t)b * a->H + (size_t)kh * G + g) * D;
    for (int d = 0; d < Dp; d++) q[g][d] = d < D ? qg[d] : 0.0f, acc[g][d] = 0.0f;
    m[g] = a->sinks ? a->sinks[kh * G + g] : -INFINITY;
    l[g] = a->sinks ? 1.0f : 0.0f;
  }
  int first, end;
  key_range(a, b, &first, &end);
  const int32_t *table = a->tables + (size_t)b * a->M;
  for (int j0 = first; j0 < end;) {
    const int n = chunk_keys(j0, end, S);
    const size_t at = ((size_t)table[j0 / S] * page + (size_t)(j0 % S) * row) * elem;
    if (j0 + n < end) {   /* the next chunk's keys and values, fetched while this one computes */
      const int j1 = j0 + n, n1 = chunk_keys(j1, end, S);
      const size_t at1 = ((size_t)table[j1 / S] * page + (size_t)(j1 % S) * row) * elem;
      fetch_rows(keys + at1, row * elem, n1, D * elem);
      fetch_rows(values + at1, row * elem, n1, D * elem);
    }
    rows_f32(keys + at, row, n, a->bf16, D, Dp, room, rows);
    float rescale[MAX_GROUP];
    for (int g = 0; g < G; g++) {
      float *sg = (float *)s[g];
      score(q[g], rows, n, Dp, sg);
      if (a->cap > 0)
        for (int j = 0; j < n; j++) sg[j] = a->cap * tanhf(sg[j] * a->scale / a->cap);
      /* Lanes past n: -inf for the maximum, 0 after e^x. */
      vf top = broadcast(m[g]);
      for (int v = 0; v < (n + VL - 1) / VL; v++) {
        const vf x = a->cap > 0 ? s[g][v] : s[g][v] * a->scale;
        s[g][v] = pick(lane + (float)(v * VL) < (float)n, x, broadcast(-INFINITY));
        top = pick(s[g][v] > top, s[g][v], top);
      }
      float t = top[0];
      for (int i = 1; i < VL; i++) t = top[i] > t ? top[i] : t;
      vf sum = {0};
      for (int v = 0; v < (n + VL - 1) / VL; v++) {
        s[g][v] = pick(lane + (float)(v * VL) < (float)n, exp_nonpositive(s[g][v] - t), (vf){0});
        sum += s[g][v];
      }
      rescale[g] = m[g] == -INFINITY ? 0.0f : exp_nonpositive(broadcast(m[g] - t))[0];
      l[g] = l[g] * rescale[g] + lanes_sum(sum);
      m[g] = t;
    }
    rows_f32(values + at, row, n, a->bf16, D, Dp, room, rows);
    for (int g = 0; g < G; g++) weigh(acc[g], rescale[g], (const float *)s[g], rows, n, Dp);
    j0 += n;
  }
  for (int g = 0; g < G; g++)
    for (int d = 0; d < D; d++) out[(size_t)g * D + d] = l[g] > 0 ? acc[g][d] / l[g] : 0.0f;
}

static void attend(const Problem *a, int b, int kh) {
  switch (a->D) {
    case 64: attend_d(a, b, kh, 64); break;
    case 128: attend_d(a, b, kh, 128); break;
    default: attend_d(a, b, kh, a->D);
  }
}

/* Item i: row i / K, KV head i % K. */
static void item(const void *problem, int i) {
  const Problem *a = problem;
  attend(a, i / a->K, i % a->K);
}

XLA_FFI_Error *tlaloc_decode_attention_v1(XLA_FFI_CallFrame *frame) {
  if (answered_metadata(frame) || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const XLA_FFI_Api *api = frame->api;
  const int64_t nargs = frame->args.size;
  if ((nargs != 7 && nargs != 8) || frame->rets.size != 1)
    return refuse(api, "tlaloc_decode_attention_v1: takes 7 or 8 operands and gives one result");
  for (int64_t i = 0; i < nargs; i++)
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER)
      return refuse(api, "tlaloc_decode_attention_v1: every operand is an array");
  XLA_FFI_Buffer **in = (XLA_FFI_Buffer **)frame->args.args, *res = (XLA_FFI_Buffer *)frame->rets.rets[0];
  XLA_FFI_Buffer *q = in[0], *pool = in[1], *ints = in[2], *tables = in[3], *pos = in[4], *lens = in[5], *reals = in[6];
  if (q->rank != 4 || pool->rank != 6 || tables->rank != 2 || q->dtype != XLA_FFI_DataType_F32 ||
      res->dtype != XLA_FFI_DataType_F32 || ints->dtype != XLA_FFI_DataType_S32 ||
      tables->dtype != XLA_FFI_DataType_S32 || pos->dtype != XLA_FFI_DataType_S32 ||
      lens->dtype != XLA_FFI_DataType_S32 || reals->dtype != XLA_FFI_DataType_F32 || q->dims[1] != 1)
    return refuse(api, "tlaloc_decode_attention_v1: operand ranks or dtypes differ from q [B, 1, H, D] f32, "
                       "pool [L, 2, P, S, K, D], i32[2], tables [B, M] i32, positions [B, 1] i32, seq_lens [B] i32, "
                       "f32[2]");
  if (pool->dtype != XLA_FFI_DataType_F32 && pool->dtype != XLA_FFI_DataType_BF16)
    return refuse(api, "tlaloc_decode_attention_v1: the pool is f32 or bf16");
  const int B = (int)q->dims[0], H = (int)q->dims[2], D = (int)q->dims[3], K = (int)pool->dims[4];
  if (pool->dims[5] != D || K <= 0 || H % K || H / K > MAX_GROUP || D > MAX_HEAD_DIM || tables->dims[0] != B)
    return refuse(api, "tlaloc_decode_attention_v1: heads, head size or rows do not agree (or exceed " STR(MAX_GROUP)
                       " query heads a KV head, " STR(MAX_HEAD_DIM) " a head)");
  const int32_t *iv = (const int32_t *)ints->data;
  const float *rv = (const float *)reals->data;
  if (iv[0] < 0 || iv[0] >= pool->dims[0]) return refuse(api, "tlaloc_decode_attention_v1: layer out of range");
  const Problem a = {pool->data, pool->dtype == XLA_FFI_DataType_BF16, (int)pool->dims[2], (int)pool->dims[3], K, D,
                     H, (int)tables->dims[1], iv[1], (size_t)iv[0], (const float *)q->data,
                     nargs == 8 ? (const float *)in[7]->data : NULL, (const int32_t *)tables->data,
                     (const int32_t *)pos->data, (const int32_t *)lens->data, rv[0], rv[1], (float *)res->data};
  for (int b = 0; b < B; b++) {   /* every page a row reads is in the pool */
    int first, end;
    key_range(&a, b, &first, &end);
    for (int j = first; j < end; j += a.S - j % a.S)
      if (a.tables[(size_t)b * a.M + j / a.S] < 0 || a.tables[(size_t)b * a.M + j / a.S] >= a.P)
        return refuse(api, "tlaloc_decode_attention_v1: a block table names a page outside the pool");
  }
  run_parallel(api, frame->ctx, item, &a, B * K);
  return NULL;
}
