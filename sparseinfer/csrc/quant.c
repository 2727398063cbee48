/* Activation quantization for the integer kernels: the activation precision (si_act_mode:
 * one int8 term, or two for ACT_PRECISE), the scratch layout of quantized tokens
 * (si_xq_alloc), quantizing tokens (si_quant_tokens) and si_quantize for the tests.  Separate
 * because the dense and the sparse products both quantize their activations this way before
 * calling the kernels. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* Activation precision (see common.h, enum ACT_*): ACT_INT8 unless $SPARSEINFER_ACT_MODE
 * ("int8", "precise") at first use or si_set_act_mode() says otherwise. */
static int ACT_MODE = -1;

int si_act_mode(void) {
    if (ACT_MODE < 0) {
        const char *e = getenv("SPARSEINFER_ACT_MODE");
        ACT_MODE = e && !strcmp(e, "precise") ? ACT_PRECISE : ACT_INT8;
    }
    return ACT_MODE;
}

void si_set_act_mode(int mode) { ACT_MODE = mode; }

/* Layout T quantized token vectors of kp values in scratch slot `slot` (2T virtual tokens
 * in precise mode, see xq_t.pair). */
int si_xq_alloc(xq_t *xq, int slot, int layout, int64_t kp, int64_t T) {
    int64_t nb = kp / 32;
    xq->pair = si_act_mode() == ACT_PRECISE;
    T <<= xq->pair;
    xq->layout = layout;
    xq->tiles = NULL;
    xq->q_stride = up(kp, 64);
    xq->d_stride = up(nb, 16);
    xq->de_stride = up(si_de_len(nb), 16);
    size_t bytes = (size_t)T * (xq->q_stride + 4 * (2 * xq->d_stride + xq->de_stride)) + 256;
    char *p = scratch(slot, bytes);
    if (!p) return -1;
    xq->q = (int8_t *)p;
    xq->d = (float *)(p + T * xq->q_stride);
    xq->s = xq->d + T * xq->d_stride;
    xq->de = xq->s + T * xq->d_stride;
    return 0;
}


/* Quantize tokens [t0, t1) of x into xq: one int8 term, or (xq->pair) the two terms
 * q_hi = the level's quantizer on x, q_lo = the same quantizer on the f32 residual
 * x - d_hi*q_hi; each term carries its own block sums d*sum(q), so the m term sees the same
 * x as the products. */
typedef void (*quantize_fn)(const float *, int64_t, int64_t, int64_t, int64_t, const xq_t *);

/* level k's quantizer for an activation layout (XL_Q8K: its own, or the portable one) */
static quantize_fn quantizer(const kernels_t *k, int layout) {
    return layout != XL_Q8K ? k->quantize : k->quantize_q8k ? k->quantize_q8k : si_quantize_q8k;
}

void si_quant_tokens(const kernels_t *k, const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1,
                     const xq_t *xq) {
    const quantize_fn quantize = quantizer(k, xq->layout);
    if (!xq->pair) {
        quantize(x, K, kp, t0, t1, xq);
        return;
    }
    const int64_t nb = kp / 32;
    xq_t hi = *xq;
    hi.q_stride *= 2;
    hi.d_stride *= 2;
    hi.de_stride *= 2;
    quantize(x, K, kp, t0, t1, &hi);
    /* residuals of up to RT tokens at a time */
    enum { RBUF = 8192 };
    float buf[RBUF], *r = buf, *heap = NULL;
    int64_t rt = RBUF / K;
    if (rt < 1) {
        heap = malloc((size_t)K * sizeof(float));
        if (!heap) abort();
        r = heap;
        rt = 1;
    }
    for (int64_t ta = t0; ta < t1; ta += rt) {
        const int64_t tb = ta + rt < t1 ? ta + rt : t1;
        for (int64_t t = ta; t < tb; t++) {
            const float *xt = x + t * K, *d = hi.d + t * hi.d_stride;
            const int8_t *q = hi.q + t * hi.q_stride;
            float *rt_ = r + (t - ta) * K;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *q0 = q + si_xpos(xq->layout, nb, b, 0), *q1 = q + si_xpos(xq->layout, nb, b, 16);
                const float db = d[b];
                const int64_t n = K - 32 * b < 32 ? K - 32 * b : 32;
                const float *xb = xt + 32 * b;
                float *rb = rt_ + 32 * b;
                if (n == 32) {
                    for (int j = 0; j < 16; j++) rb[j] = xb[j] - db * (float)q0[j];
                    for (int j = 0; j < 16; j++) rb[16 + j] = xb[16 + j] - db * (float)q1[j];
                } else {
                    for (int j = 0; j < n; j++) rb[j] = xb[j] - db * (float)(j < 16 ? q0[j] : q1[j - 16]);
                }
            }
        }
        xq_t lo = hi;
        lo.q += xq->q_stride + ta * hi.q_stride;
        lo.d += xq->d_stride + ta * hi.d_stride;
        lo.s += xq->d_stride + ta * hi.d_stride;
        lo.de += xq->de_stride + ta * hi.de_stride;
        quantize(r, K, kp, 0, tb - ta, &lo);
    }
    free(heap);
}

/* ------------------------------------------------------------------ helpers for tests */

void si_quantize(int layout, const float *x, int64_t K, int8_t *q, float *d, float *s) {
    int64_t kp = (K + 31) / 32 * 32;
    xq_t xq;
    if (si_xq_alloc(&xq, 0, layout, kp, 1) != 0) abort();
    quantizer(si_kern(), layout)(x, K, kp, 0, 1, &xq);
    memcpy(q, xq.q, (size_t)kp);
    memcpy(d, xq.d, (size_t)(kp / 32) * sizeof(float));
    memcpy(s, xq.s, (size_t)(kp / 32) * sizeof(float));
}
