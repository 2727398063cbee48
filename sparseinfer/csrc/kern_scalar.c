/* Portable scalar kernels: the fallback on CPUs without AVX2 or NEON, and the definition of
 * the activation quantizer that the SIMD versions reproduce bit for bit (the NEON levels call
 * it, and the KV cache writer, as they are). */
#include <math.h>
#include "common.h"

/* Quantize one block of 32 values (x beyond K count as 0): q, scale d, and s = d * sum(q),
 * the sum of the block as the dot product sees it (for the m term: with the sum of the
 * rounded values the rounding error meets the true weights d*q + m, which are centred, rather
 * than the nibbles d*q alone, which for q4 carry an offset of ~8d: a smaller error). */
static void quant_block(const float *x, int64_t n, int8_t *q32, float *d, float *s) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        v[j] = j < n ? x[j] : 0.0f;
        float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t isum = 0;
    for (int j = 0; j < 32; j++) {
        q32[j] = (int8_t)lrintf(v[j] * id);
        isum += q32[j];
    }
    *d = amax / 127.0f;
    *s = *d * (float)isum;
}

void si_fill_de(int layout, int64_t nb, const float *d, float *de) {
    if (layout == XL_Q4) {
        for (int64_t g = 0; g < nb / 4; g++)
            for (int i = 0; i < 16; i++) de[g * 16 + i] = d[g * 4 + i / 4];
    } else {
        for (int64_t p = 0; p < nb / 2; p++)
            for (int i = 0; i < 16; i++) de[p * 16 + i] = d[p * 2 + i / 8];
    }
}

void si_quantize_portable(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    int64_t nb = kp / 32;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        for (int64_t b = 0; b < nb; b++) {
            int8_t q32[32];
            int64_t n = K - b * 32;
            quant_block(xt + b * 32, n < 32 ? n : 32, q32, &d[b], &s[b]);
            for (int j = 0; j < 32; j++) q[si_xpos(xq->layout, nb, b, j)] = q32[j];
        }
        si_fill_de(xq->layout, nb, d, xq->de + t * xq->de_stride);
    }
}

void si_quantize_q8k(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    const int64_t nb = kp / 32;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int64_t k0 = 32 * b0, n = K - k0 < 256 ? K - k0 : 256;
            float amax = 0.0f;
            for (int64_t j = 0; j < n; j++) amax = fabsf(xt[k0 + j]) > amax ? fabsf(xt[k0 + j]) : amax;
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f, db = amax / 127.0f;
            for (int64_t b = b0; b < b0 + 8 && b < nb; b++) {
                int32_t isum = 0;
                for (int j = 0; j < 32; j++) {
                    const int64_t k = 32 * b + j;
                    q[k] = (int8_t)(k < K ? lrintf(xt[k] * id) : 0);
                    isum += q[k];
                }
                d[b] = db;
                s[b] = db * (float)isum;
            }
        }
    }
}

/* one q4k row (nb blocks of 32) against XL_Q8K activations q, d, s: per super-block the
 * sub-blocks' integer sums times their 6-bit scales, then d, and the mins against s */
static float q4k_dot(const uint8_t *row, int64_t nb, const int8_t *q, const float *dx, const float *sx) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b += 8) {
        const uint8_t *blk = row + b / 8 * SI_Q4K_BYTES;
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        int32_t isum = 0;
        float msum = 0.0f;
        for (int i = 0; i < 8; i++) {
            int sc, mn;
            si_q4k_sub(blk + 4, i, &sc, &mn);
            const uint8_t *nib = blk + 16 + 32 * (i / 2);
            int32_t si = 0;
            for (int j = 0; j < 32; j++) si += ((i & 1) ? nib[j] >> 4 : nib[j] & 15) * q[32 * (b + i) + j];
            isum += sc * si;
            msum += (float)mn * sx[b + i];
        }
        acc += si_h2f(hd) * dx[b] * (float)isum - si_h2f(hm) * msum;
    }
    return acc;
}

static inline int wq_at(const qmat_t *w, const uint8_t *row, int64_t b, int j) {
    if (w->fmt == FMT_Q8) return (int8_t)row[b * 32 + j];
    uint8_t byte = row[b * 16 + (j & 15)];
    return j < 16 ? (byte & 15) : (byte >> 4);
}

static void dot_q(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const xq_t *xq, int64_t T, const yout_t *out) {
    int64_t nb = w->nb;
    for (int64_t i = i0; i < i1; i++) {
        int64_t r = si_row(rows, i);
        const uint8_t *row = w->qs + r * w->row_bytes;
        const uint16_t *dw = w->d ? w->d + r * w->ds : NULL, *mw = w->m ? w->m + r * w->ds : NULL;
        float yv = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *q = xq->q + t * xq->q_stride;
            const float *dx = xq->d + t * xq->d_stride, *sx = xq->s + t * xq->d_stride;
            float acc = 0.0f;
            if (w->fmt == FMT_Q4K) acc = q4k_dot(row, nb, q, dx, sx);
            for (int64_t b = 0; b < nb && w->fmt != FMT_Q4K; b++) {
                if (w->fmt == FMT_Q6) { /* a scale per 16 values: two integer sums per block */
                    int32_t is0 = 0, is1 = 0;
                    for (int j = 0; j < 16; j++) is0 += (si_q6_code(row, nb, b, j) - 32) * q[si_xpos(xq->layout, nb, b, j)];
                    for (int j = 16; j < 32; j++) is1 += (si_q6_code(row, nb, b, j) - 32) * q[si_xpos(xq->layout, nb, b, j)];
                    acc += ((float)is0 * si_h2f(dw[2 * b]) + (float)is1 * si_h2f(dw[2 * b + 1])) * dx[b];
                    continue;
                }
                int32_t isum = 0;
                for (int j = 0; j < 32; j++) isum += wq_at(w, row, b, j) * q[si_xpos(xq->layout, nb, b, j)];
                acc += si_h2f(dw[b]) * dx[b] * (float)isum;
                if (mw) acc += si_h2f(mw[b]) * sx[b];
            }
            if (!xq->pair) out->y[i * out->ysr + t * out->yst] = acc;
            else if (t & 1) out->y[i * out->ysr + (t >> 1) * out->yst] = yv + acc;
            else yv = acc;
        }
    }
}

static inline float wf_at(const qmat_t *w, const uint8_t *row, int64_t k) {
    switch (w->fmt) {
    case FMT_F32: { float f; memcpy(&f, row + 4 * k, 4); return f; }
    case FMT_F16: { uint16_t h; memcpy(&h, row + 2 * k, 2); return si_h2f(h); }
    default: { uint16_t h; memcpy(&h, row + 2 * k, 2); return si_bf2f(h); }
    }
}

static void dot_f(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const float *x, int64_t xstride, int64_t T, const yout_t *out) {
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = w->qs + si_row(rows, i) * w->row_bytes;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * xstride;
            float acc = 0.0f;
            for (int64_t k = 0; k < w->cols; k++) acc += wf_at(w, row, k) * xt[k];
            out->y[i * out->ysr + t * out->yst] = acc;
        }
    }
}

static void axpy(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n,
                 int64_t c0, int64_t c1, float *y) {
    for (int64_t c = c0; c < c1; c++) y[c] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        int64_t r = rows[j];
        const uint8_t *row = wt->qs + r * wt->row_bytes;
        float hj = h[j];
        if (wt->fmt <= FMT_BF16) {
            for (int64_t c = c0; c < c1; c++) y[c] += hj * wf_at(wt, row, c);
            continue;
        }
        const uint16_t *dw = wt->d + r * wt->ds, *mw = wt->m ? wt->m + r * wt->ds : NULL;
        for (int64_t c = c0; c < c1; c++) {
            int64_t b = c / 32;
            float v = si_h2f(dw[b]) * (float)wq_at(wt, row, b, (int)(c & 31));
            if (mw) v += si_h2f(mw[b]);
            y[c] += hj * v;
        }
    }
}

static uint64_t read_sum(const uint8_t *p, int64_t nbytes) {
    uint64_t acc = 0;
    for (int64_t i = 0; i + 8 <= nbytes; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        acc += v;
    }
    return acc;
}

/* One cache row (common.h, KV_*), the portable conversions that the SIMD levels reproduce. */
void si_kv_store_portable(int type, const float *x, void *row, int64_t D) {
    if (type == KV_F32) memcpy(row, x, (size_t)D * sizeof(float));
    else if (type == KV_F16)
        for (int64_t i = 0; i < D; i++) ((uint16_t *)row)[i] = si_f2h(x[i]);
    else si_q8_0_row(x, D, row);
}

const kernels_t si_kernels_scalar = {"scalar", si_quantize_portable, dot_q, dot_f, axpy, read_sum, si_act_each, 1, NULL, 0,
                                     si_kv_store_portable};
