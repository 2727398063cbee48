/* NEON kernels (AArch64), included by kern_neon.c (SI_DOTPROD 0: every AArch64 CPU) and by
 * kern_neon_dotprod.c (SI_DOTPROD 1: the SDOT instruction of Armv8.2's dotprod feature).
 *
 * Integer formats: each block's integer sum is exact however it is formed (SDOT, or widening
 * multiplies and pairwise adds), and the float arithmetic per block is the scalar level's in
 * the scalar level's order (kern_scalar.c), so dot_q and axpy equal the scalar kernels bit for
 * bit; a row of a many-token product is computed exactly as the one-token product computes it.
 * Float weights (dot_f) sum in four lanes: within the accuracy contract of the scalar sum.
 * Attention (attend_impl.h, 4-float vectors) agrees with the portable version within the
 * contract.  The activation quantizer, the KV cache writer and the activations are the
 * portable ones. */
#include <arm_neon.h>
#include "common.h"

#define AI static inline __attribute__((always_inline))

#if SI_DOTPROD
#define NEON_NAME(x) x##_dotprod
/* acc + the sums of each 4 consecutive products of a and b */
AI int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
#else
#define NEON_NAME(x) x
/* acc + sums of pairs of products (|a*b| <= 128*128 fits the 16-bit products) */
AI int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}
#endif

/* sum over 32 values of w * x, w and x int8 (two 16-byte halves each) */
AI int32_t dot32(int8x16_t w0, int8x16_t w1, const int8_t *x0, const int8_t *x1) {
    int32x4_t s = dot16(vdupq_n_s32(0), w0, vld1q_s8(x0));
    return vaddvq_s32(dot16(s, w1, vld1q_s8(x1)));
}

/* One row against one token: the scalar level's per-block arithmetic (kern_scalar.c, dot_q). */
AI float row_dot(const qmat_t *w, const uint8_t *row, const uint16_t *dw, const uint16_t *mw, const xq_t *xq,
                 int64_t t) {
    const int64_t nb = w->nb, ng = nb / 4;
    const int8_t *q = xq->q + t * xq->q_stride;
    const float *dx = xq->d + t * xq->d_stride, *sx = xq->s + t * xq->d_stride;
    const uint8x16_t m4 = vdupq_n_u8(15), m2 = vdupq_n_u8(3);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xl = q + si_xpos(xq->layout, nb, b, 0), *xh = q + si_xpos(xq->layout, nb, b, 16);
        if (w->fmt == FMT_Q6) { /* a scale per 16 values: two integer sums per block */
            int32_t is0 = 0, is1 = 0;
            if (b < 4 * ng) {
                const uint8_t *g = row + 96 * (b / 4);
                const int i = (int)(b % 4);
                const uint8x16_t nib = vld1q_u8(g + 16 * i), hb = vld1q_u8(g + 64 + 16 * (i & 1));
                const int8x16_t sh_lo = vdupq_n_s8((int8_t)(-2 * (i >> 1))), sh_hi = vdupq_n_s8((int8_t)(-2 * ((i >> 1) + 2)));
                const uint8x16_t c0 = vorrq_u8(vandq_u8(nib, m4), vshlq_n_u8(vandq_u8(vshlq_u8(hb, sh_lo), m2), 4));
                const uint8x16_t c1 = vorrq_u8(vshrq_n_u8(nib, 4), vshlq_n_u8(vandq_u8(vshlq_u8(hb, sh_hi), m2), 4));
                const int8x16_t x0 = vld1q_s8(xl), x1 = vld1q_s8(xh);
                is0 = vaddvq_s32(dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(c0), x0)) - 32 * vaddlvq_s8(x0);
                is1 = vaddvq_s32(dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(c1), x1)) - 32 * vaddlvq_s8(x1);
            } else { /* a tail block after the last group of 4 */
                for (int j = 0; j < 16; j++) is0 += (si_q6_code(row, nb, b, j) - 32) * xl[j];
                for (int j = 16; j < 32; j++) is1 += (si_q6_code(row, nb, b, j) - 32) * xh[j - 16];
            }
            acc += ((float)is0 * si_h2f(dw[2 * b]) + (float)is1 * si_h2f(dw[2 * b + 1])) * dx[b];
            continue;
        }
        int32_t isum;
        if (w->fmt == FMT_Q8) {
            const int8_t *wb = (const int8_t *)row + 32 * b;
            isum = dot32(vld1q_s8(wb), vld1q_s8(wb + 16), xl, xh);
        } else { /* q4: byte j holds value j (low nibble) and value j + 16 (high nibble) */
            const uint8x16_t v = vld1q_u8(row + 16 * b);
            isum = dot32(vreinterpretq_s8_u8(vandq_u8(v, m4)), vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xl, xh);
        }
        acc += si_h2f(dw[b]) * dx[b] * (float)isum;
        if (mw) acc += si_h2f(mw[b]) * sx[b];
    }
    return acc;
}

static void dot_q(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1, const xq_t *xq, int64_t T,
                  const yout_t *out) {
    if (w->fmt == FMT_Q4K) { /* no NEON kernel for it yet: the portable one */
        si_kernels_scalar.dot_q(w, rows, i0, i1, xq, T, out);
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = si_row(rows, i);
        const uint8_t *row = w->qs + r * w->row_bytes;
        const uint16_t *dw = w->d + r * w->ds, *mw = w->m ? w->m + r * w->ds : NULL;
        float yv = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            const float acc = row_dot(w, row, dw, mw, xq, t);
            if (!xq->pair) out->y[i * out->ysr + t * out->yst] = acc;
            else if (t & 1) out->y[i * out->ysr + (t >> 1) * out->yst] = yv + acc;
            else yv = acc;
        }
    }
}

/* four float weights at k of a row of a float format */
AI float32x4_t load4f(int fmt, const uint8_t *row, int64_t k) {
    if (fmt == FMT_F32) return vld1q_f32((const float *)row + k);
    const uint16x4_t h = vld1_u16((const uint16_t *)row + k);
    if (fmt == FMT_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

AI float loadf(int fmt, const uint8_t *row, int64_t k) {
    uint16_t h;
    if (fmt == FMT_F32) {
        float f;
        memcpy(&f, row + 4 * k, 4);
        return f;
    }
    memcpy(&h, row + 2 * k, 2);
    return fmt == FMT_F16 ? si_h2f(h) : si_bf2f(h);
}

static void dot_f(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1, const float *x, int64_t xstride,
                  int64_t T, const yout_t *out) {
    const int64_t K = w->cols;
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = w->qs + si_row(rows, i) * w->row_bytes;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * xstride;
            float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                a0 = vaddq_f32(a0, vmulq_f32(load4f(w->fmt, row, k), vld1q_f32(xt + k)));
                a1 = vaddq_f32(a1, vmulq_f32(load4f(w->fmt, row, k + 4), vld1q_f32(xt + k + 4)));
            }
            float acc = vaddvq_f32(vaddq_f32(a0, a1));
            for (; k < K; k++) acc += loadf(w->fmt, row, k) * xt[k];
            out->y[i * out->ysr + t * out->yst] = acc;
        }
    }
}

/* y[c0:c1] = sum_j h[j] * Wt[rows[j], c0:c1], each term as the scalar level forms it
 * (v = d*q, v += m, y += h*v: separate multiplies and adds, in that order). */
static void axpy(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n, int64_t c0, int64_t c1,
                 float *y) {
    for (int64_t c = c0; c < c1; c++) y[c] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const int64_t r = rows[j];
        const uint8_t *row = wt->qs + r * wt->row_bytes;
        const float hj = h[j];
        const float32x4_t hv = vdupq_n_f32(hj);
        int64_t c = c0;
        if (wt->fmt <= FMT_BF16) {
            for (; c + 4 <= c1; c += 4)
                vst1q_f32(y + c, vaddq_f32(vld1q_f32(y + c), vmulq_f32(hv, load4f(wt->fmt, row, c))));
            for (; c < c1; c++) y[c] += hj * loadf(wt->fmt, row, c);
            continue;
        }
        const uint16_t *dw = wt->d + r * wt->ds, *mw = wt->m ? wt->m + r * wt->ds : NULL;
        for (; c + 32 <= c1; c += 32) { /* c0 is a multiple of 32: whole blocks */
            const int64_t b = c / 32;
            const float32x4_t dv = vdupq_n_f32(si_h2f(dw[b])), mv = vdupq_n_f32(mw ? si_h2f(mw[b]) : 0.0f);
            int8x16_t q0, q1;
            if (wt->fmt == FMT_Q8) {
                q0 = vld1q_s8((const int8_t *)row + 32 * b);
                q1 = vld1q_s8((const int8_t *)row + 32 * b + 16);
            } else {
                const uint8x16_t v = vld1q_u8(row + 16 * b);
                q0 = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)));
                q1 = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
            }
            const int16x8_t s[4] = {vmovl_s8(vget_low_s8(q0)), vmovl_high_s8(q0), vmovl_s8(vget_low_s8(q1)),
                                    vmovl_high_s8(q1)};
            for (int u = 0; u < 8; u++) {
                const int16x4_t s4 = u & 1 ? vget_high_s16(s[u / 2]) : vget_low_s16(s[u / 2]);
                float32x4_t v = vmulq_f32(dv, vcvtq_f32_s32(vmovl_s16(s4)));
                if (mw) v = vaddq_f32(v, mv);
                vst1q_f32(y + c + 4 * u, vaddq_f32(vld1q_f32(y + c + 4 * u), vmulq_f32(hv, v)));
            }
        }
        for (; c < c1; c++) { /* the part of a last block before c1 */
            const int64_t b = c / 32;
            const int k = (int)(c & 31);
            const int q = wt->fmt == FMT_Q8 ? (int8_t)row[32 * b + k]
                                            : (k < 16 ? row[16 * b + k] & 15 : row[16 * b + k - 16] >> 4);
            float v = si_h2f(dw[b]) * (float)q;
            if (mw) v += si_h2f(mw[b]);
            y[c] += hj * v;
        }
    }
}

static uint64_t read_sum(const uint8_t *p, int64_t nbytes) {
    uint64x2_t acc = vdupq_n_u64(0);
    int64_t i = 0;
    for (; i + 16 <= nbytes; i += 16) acc = vaddq_u64(acc, vreinterpretq_u64_u8(vld1q_u8(p + i)));
    uint64_t s = vgetq_lane_u64(acc, 0) + vgetq_lane_u64(acc, 1);
    for (; i < nbytes; i++) s += p[i];
    return s;
}

#if !SI_DOTPROD
/* si_attend_neon: attend_impl.h with 4-float vectors for each KV cache type (both NEON
 * levels use it; SDOT plays no part) */
static void softmax_rows(float *sc, int n, int64_t L) {
    for (int j = 0; j < n; j++) {
        float *s = sc + j * L, mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
        for (int64_t t = 0; t < L; t++) sum += (s[t] = expf(s[t] - mx));
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < L; t++) s[t] *= inv;
    }
}
AI float32x4_t q8_load4(const uint8_t *blk, int64_t j) {
    uint16_t d;
    memcpy(&d, blk, 2);
    const int16x8_t q = vmovl_s8(vld1_s8((const int8_t *)blk + 2 + j)); /* 8 loaded, 4 used */
    return vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))), si_h2f(d));
}
#define AT_V float32x4_t
#define AT_W 4
#define AT_LOAD(p) vld1q_f32(p)
#define AT_LOAD_F16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define AT_LOAD_Q8(blk, j) q8_load4(blk, j)
#define AT_STORE(p, v) vst1q_f32(p, v)
#define AT_ZERO() vdupq_n_f32(0.0f)
#define AT_SET1(x) vdupq_n_f32(x)
#define AT_FMA(a, b, c) vfmaq_f32(c, a, b)
#define AT_SUM(v) vaddvq_f32(v)
#define AT_PAIR_MAX SI_ATT_MAXG
#define AT_NAME si_attend_heads_neon
#define AT_SOFTMAX softmax_rows
#define AT_KV 0
#include "attend_impl.h"
#define AT_KV 1
#include "attend_impl.h"
#define AT_KV 2
#include "attend_impl.h"
const struct si_attend_fns si_attend_neon = {{si_attend_heads_neon_f32, si_attend_heads_neon_f16,
                                              si_attend_heads_neon_q8_0}};
#endif

const kernels_t NEON_NAME(si_kernels_neon) = {
    SI_DOTPROD ? "neon_dotprod" : "neon", si_quantize_portable, dot_q, dot_f, axpy, read_sum, si_act_each, 1,
    &si_attend_neon, 4, si_kv_store_portable};
