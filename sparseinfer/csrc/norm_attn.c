/* The non-matrix operations of a decoder layer: RMS norm (si_rms_norm) and single-token
 * attention over the KV cache (si_attend1, with the portable per-head kernel).  Separate from
 * the weight products: they read activations and the cache, not quantized weights. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <math.h>
#include <stdlib.h>

/* ------------------------------------------------------------------ RMS norm
 * y = x / sqrt(mean(x^2) + eps) * w, row by row, on the calling thread.  torch's rms_norm is
 * a composite of ~6 ops whose cost on one row is mostly dispatch; this is one pass, and it runs
 * twice per layer per token.  The sum of squares is accumulated in double in 8 fixed lanes
 * (vectorizable, and the same order on every run). */
void si_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += (double)xr[i + j] * (double)xr[i + j];
        for (; i < n; i++) acc[0] += (double)xr[i] * (double)xr[i];
        double ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

/* ------------------------------------------------------------ single-token attention
 * o[h] = softmax(scale * q[h] . K[h/g]^T) V[h/g] for one query per head, g = H/Hk (query
 * head h reads KV head h // g, as repeat_kv does), over L cached positions.  K, V rows (D
 * values of cache type KV_*, si_kv_row_bytes each) are contiguous, KV heads kstride /
 * vstride bytes apart.  A task takes up to 8 query heads of one KV head and reads that
 * head's K and V once for all of them.  Each head's sums run in a fixed order: results do
 * not depend on the thread count. */
typedef struct {
    const float *q;
    const char *k, *v;
    float *o, *sc;
    int64_t H, Hk, D, L, kstride, vstride, per, ntask_kv;
    int type;
    float scale;
    si_attend_fn fn;
} att_ctx;

/* The portable version of the levels' kernels (si_attend_fn, see common.h), for one cache
 * type: each K and V value converted as it is read (si_kv_value). */
static void attend_heads_type(int type, const float *q, const char *K, const char *V, float *sc, float *o, int n,
                              int64_t D, int64_t L, float scale) {
    const int64_t rb = si_kv_row_bytes(type, D);
    for (int j = 0; j < n; j++) {
        float *s = sc + j * L, mx = -INFINITY;
        for (int64_t l = 0; l < L; l++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < D; i++) acc += q[j * D + i] * si_kv_value(type, K + l * rb, i);
            s[l] = acc * scale;
            mx = s[l] > mx ? s[l] : mx;
        }
        double sum = 0.0;
        for (int64_t l = 0; l < L; l++) sum += (s[l] = expf(s[l] - mx));
        const float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < D; i++) o[j * D + i] = 0.0f;
        for (int64_t l = 0; l < L; l++)
            for (int64_t i = 0; i < D; i++) o[j * D + i] += (s[l] * inv) * si_kv_value(type, V + l * rb, i);
    }
}

static void attend_heads_f32(const float *q, const void *K, const void *V, float *sc, float *o, int n, int64_t D,
                             int64_t L, float scale) {
    attend_heads_type(KV_F32, q, K, V, sc, o, n, D, L, scale);
}
static void attend_heads_f16(const float *q, const void *K, const void *V, float *sc, float *o, int n, int64_t D,
                             int64_t L, float scale) {
    attend_heads_type(KV_F16, q, K, V, sc, o, n, D, L, scale);
}
static void attend_heads_q8_0(const float *q, const void *K, const void *V, float *sc, float *o, int n, int64_t D,
                              int64_t L, float scale) {
    attend_heads_type(KV_Q8_0, q, K, V, sc, o, n, D, L, scale);
}
static const si_attend_fn portable[KV_COUNT] = {attend_heads_f32, attend_heads_f16, attend_heads_q8_0};

static void att_task(void *p, int64_t t) {
    const att_ctx *a = p;
    const int64_t g = a->H / a->Hk, kh = t / a->ntask_kv, part = t % a->ntask_kv;
    const int64_t h0 = kh * g + part * a->per, h1 = h0 + a->per < (kh + 1) * g ? h0 + a->per : (kh + 1) * g;
    const char *K = a->k + kh * a->kstride, *V = a->v + kh * a->vstride;
    if (h1 <= h0) return;
    a->fn(a->q + h0 * a->D, K, V, a->sc + h0 * a->L, a->o + h0 * a->D, (int)(h1 - h0), a->D, a->L, a->scale);
}

void si_attend1(int type, const float *q, const void *k, const void *v, float *o, int64_t H, int64_t Hk, int64_t D,
                int64_t L, int64_t kstride, int64_t vstride, float scale) {
    float *sc = scratch(5, (size_t)(H * L + 16) * sizeof(float));
    if (!sc) abort();
    const int64_t g = H / Hk;
    /* split each KV head's query heads into parts of <= 8, and into more parts when there are
     * fewer KV heads than threads */
    int64_t parts = (g + SI_ATT_MAXG - 1) / SI_ATT_MAXG, want = (nthreads() + Hk - 1) / Hk;
    if (parts < want) parts = want < g ? want : g;
    const kernels_t *kl = si_kern();
    att_ctx a = {q, k, v, o, sc, H, Hk, D, L, kstride, vstride, (g + parts - 1) / parts, parts, type, scale,
                 portable[type]};
    if (kl->attend && D % kl->attend_w == 0) a.fn = kl->attend->by_type[type];
#if SI_X86
    else if (kl->attend && D % 8 == 0) a.fn = si_attend_avx2.by_type[type]; /* the AVX-512 levels' for D = 8 mod 16 */
#endif
    run(att_task, &a, Hk * parts, H * L * D * 8); /* the f32 work estimate for every type */
}

void si_kv_store(int type, const float *x, void *row, int64_t D) { si_kern()->kv_store(type, x, row, D); }
