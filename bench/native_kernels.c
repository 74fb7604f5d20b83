/* Hand-written CPU forms of the decode step's two parts, for bench/native_kernels.py: what a kernel outside XLA
   reaches on this machine (gcc -O3 -march=native, OpenMP), against XLA's forms through the runtime's plugin. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "xla/ffi/api/c_api.h" /* jax.ffi.include_dir(): the typed FFI's C ABI, shared by jaxlib and the plugin */

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

/* Paged attention of one token a row (keys 0 .. seq_len - 1), pool [L, 2, P, S, K, D], q and out [B, H, D], tables
   [B, M]. Each (row, KV head) folds its pages into an online softmax for its G query heads; plain loops that gcc
   vectorizes. G <= 16, D <= 256. */
void decode_attention(const float *pool, int layer, int P, int S, int K, int D, const float *q, int B, int H,
                      const int32_t *tables, int M, const int32_t *seq_lens, float scale, float *out) {
  const int G = H / K;
  const size_t page = (size_t)S * K * D, half = (size_t)P * page;
  const float *keys = pool + (size_t)layer * 2 * half, *values = keys + half;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int kh = 0; kh < K; kh++) {
      float m[16], l[16], acc[16][256], s[256];
      const float *qh = q + ((size_t)b * H + (size_t)kh * G) * D;
      for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
      }
      for (int p0 = 0; p0 < seq_lens[b]; p0 += S) {
        const size_t at = (size_t)tables[(size_t)b * M + p0 / S] * page + (size_t)kh * D;
        const int n = seq_lens[b] - p0 < S ? seq_lens[b] - p0 : S;
        for (int g = 0; g < G; g++) {
          float top = m[g], sum = 0.0f;
          for (int j = 0; j < n; j++) {
            const float *k = keys + at + (size_t)j * K * D;
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += qh[g * D + d] * k[d];
            s[j] = dot * scale;
            top = s[j] > top ? s[j] : top;
          }
          const float rescale = expf(m[g] - top);
          for (int j = 0; j < n; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
          }
          l[g] = l[g] * rescale + sum;
          m[g] = top;
          for (int d = 0; d < D; d++) acc[g][d] *= rescale;
          for (int j = 0; j < n; j++) {
            const float *v = values + at + (size_t)j * K * D;
            for (int d = 0; d < D; d++) acc[g][d] += s[j] * v[d];
          }
        }
      }
      for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) out[((size_t)b * H + (size_t)kh * G + g) * D + d] = l[g] > 0 ? acc[g][d] / l[g] : 0;
    }
}

/* decode_attention as a typed XLA FFI handler (stablehlo.custom_call, api_version 4): operands q [B, 1, H, D] f32,
   pool [L, 2, P, S, K, D] f32, layer i32[], tables [B, M] i32, seq_lens [B] i32, scale f32[]; result [B, 1, H, D].
   Before first use XLA calls it with a metadata extension on the frame, which it answers with the API version. */
XLA_FFI_Error *decode_attention_ffi(XLA_FFI_CallFrame *frame) {
  for (XLA_FFI_Extension_Base *ext = frame->extension_start; ext; ext = ext->next)
    if (ext->type == XLA_FFI_Extension_Metadata) {
      XLA_FFI_Metadata *md = ((XLA_FFI_Metadata_Extension *)ext)->metadata;
      md->api_version.major_version = XLA_FFI_API_MAJOR;
      md->api_version.minor_version = XLA_FFI_API_MINOR;
      md->traits = 0;
      return NULL;
    }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  XLA_FFI_Buffer **in = (XLA_FFI_Buffer **)frame->args.args, *out = (XLA_FFI_Buffer *)frame->rets.rets[0];
  const int64_t *qd = in[0]->dims, *pd = in[1]->dims;
  decode_attention((const float *)in[1]->data, *(const int32_t *)in[2]->data, (int)pd[2], (int)pd[3], (int)pd[4],
                   (int)pd[5], (const float *)in[0]->data, (int)qd[0], (int)qd[2], (const int32_t *)in[3]->data,
                   (int)in[3]->dims[1], (const int32_t *)in[4]->data, *(const float *)in[5]->data,
                   (float *)out->data);
  return NULL;
}
