/* Fused single-token decode steps of a pre-norm transformer block (Llama family).
 *
 * Why: in Python each block costs ~35 small torch operations per token (norm, bias, rotary,
 * cache writes, residual adds, activation), 0.4-0.7 ms per layer on this machine class, a
 * quarter of a 1.5B model's decode time, and the weight streaming in between evicts the
 * interpreter's working set.  Here one call does one half-block with the same kernels
 * (`si_gemv`, `si_attend1`, `si_rms_norm`) and the same element-wise arithmetic as the
 * Python layers (sparseinfer/models/layers.py: Attention, MLP, Rotary), which stay the
 * reference and the path for everything else (prefill, GPUs, sparse FFNs).
 *
 * Temporaries live in scratch slot 6 of the calling thread. */
#include "ops.h"

#include <stdlib.h>
#include <string.h>

static int64_t up16(int64_t v) { return (v + 15) / 16 * 16; }

/* Rotate-half rotary embedding of the first n_rot values of each of nh heads of D values, in
 * place: out_i = v_i cos_i - v_{i+h} sin_i, out_{i+h} = v_{i+h} cos_{i+h} + v_i sin_{i+h}
 * (h = n_rot / 2; Rotary.forward's order of operations). */
static void rope(float *v, int64_t nh, int64_t D, int64_t n_rot, const float *cos, const float *sin) {
    const int64_t half = n_rot / 2;
    for (int64_t h = 0; h < nh; h++) {
        float *p = v + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = p[i], b = p[i + half];
            p[i] = a * cos[i] + -(b * sin[i]);
            p[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* xo = x + o(attention(rope(qkv(rms_norm(x))))) for one token at position `pos`.
 * q, k, v: the projections (rows H*D, Hk*D, Hk*D), or k == v == NULL and q the fused one
 * (all rows stacked); bq, bk, bv: their biases or NULL.  This token's k and v are written to
 * the caches (KV head h, row pos at kc + h*kstride + pos*D) and the attention runs over rows
 * 0..pos.  x and xo may be the same buffer. */
void si_decode_attn(const float *x, float *xo, int64_t n, const float *norm_w, float eps, const qmat_t *q,
                    const qmat_t *k, const qmat_t *v, const float *bq, const float *bk, const float *bv, int64_t H,
                    int64_t Hk, int64_t D, int64_t n_rot, const float *cos, const float *sin, float *kc, float *vc,
                    int64_t kstride, int64_t vstride, int64_t pos, const qmat_t *o, const float *o_bias,
                    float scale) {
    const int64_t nq = H * D, nkv = Hk * D, nt = nq + 2 * nkv;
    float *xn = si_scratch(6, (size_t)(up16(n) * 2 + up16(nt) + up16(nq)) * sizeof(float));
    if (!xn) abort();
    float *y = xn + up16(n), *att = y + up16(nt), *ob = att + up16(nq);
    si_rms_norm(x, norm_w, xn, 1, n, eps);
    si_gemv(q, xn, y);
    if (k) {
        si_gemv(k, xn, y + nq);
        si_gemv(v, xn, y + nq + nkv);
    }
    if (bq)
        for (int64_t i = 0; i < (k ? nq : nt); i++) y[i] += bq[i];
    if (bk)
        for (int64_t i = 0; i < nkv; i++) y[nq + i] += bk[i];
    if (bv)
        for (int64_t i = 0; i < nkv; i++) y[nq + nkv + i] += bv[i];
    if (n_rot > 0) rope(y, H + Hk, D, n_rot, cos, sin);
    for (int64_t h = 0; h < Hk; h++) {
        memcpy(kc + h * kstride + pos * D, y + nq + h * D, (size_t)D * sizeof(float));
        memcpy(vc + h * vstride + pos * D, y + nq + nkv + h * D, (size_t)D * sizeof(float));
    }
    si_attend1(y, kc, vc, att, H, Hk, D, pos + 1, kstride, vstride, scale);
    si_gemv(o, att, ob);
    if (o_bias)
        for (int64_t i = 0; i < n; i++) ob[i] += o_bias[i];
    for (int64_t i = 0; i < n; i++) xo[i] = x[i] + ob[i];
}

/* xo = x + down(act(gate(xn)) * up(xn)), xn = rms_norm(x), with F neurons; gate and up are
 * the projections, or up == NULL and gate the fused one (F gate rows, then F up rows);
 * relu_up also applies ReLU to up (dReLU). */
void si_decode_mlp(const float *x, float *xo, int64_t n, const float *norm_w, float eps, int act, int relu_up,
                   const qmat_t *gate, const qmat_t *upm, int64_t F, const qmat_t *down) {
    float *xn = si_scratch(6, (size_t)(up16(n) * 2 + up16(2 * F)) * sizeof(float));
    if (!xn) abort();
    float *gu = xn + up16(n), *dn = gu + up16(2 * F);
    si_rms_norm(x, norm_w, xn, 1, n, eps);
    si_gemv(gate, xn, gu);
    if (upm) si_gemv(upm, xn, gu + F);
    for (int64_t i = 0; i < F; i++) {
        float u = gu[F + i];
        if (relu_up && !(u > 0.0f)) u = 0.0f;
        gu[i] = si_act_apply(act, gu[i]) * u;
    }
    si_gemv(down, gu, dn);
    for (int64_t i = 0; i < n; i++) xo[i] = x[i] + dn[i];
}
