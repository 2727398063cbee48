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
#include <time.h>

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
    si_act(act, gu, F);
    for (int64_t i = 0; i < F; i++) {
        float u = gu[F + i];
        if (relu_up && !(u > 0.0f)) u = 0.0f;
        gu[i] *= u;
    }
    si_gemv(down, gu, dn);
    for (int64_t i = 0; i < n; i++) xo[i] = x[i] + dn[i];
}

/* ----------------------------------------------------------------- sparse FFN half-block */

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The k-th largest of v[0..n) (1 <= k <= n): a radix select on order-preserving integer
 * keys, 11 + 11 + 10 bits, the first pass over all n and the later ones over the keys left in
 * the chosen bucket.  Branch-free counting: a quickselect's data-dependent branches cost ~3x
 * more here (8960 predictor scores per layer and token).  tmp: room for n uint32. */
static float kth_largest(const float *v, int64_t n, int64_t k, uint32_t *tmp) {
    uint32_t cnt[2048];
    const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    uint32_t prefix = 0;
    int64_t m = n, want = k;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, v + i, 4);
        tmp[i] = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    for (int p = 0; p < 3; p++) {
        const uint32_t top = (1u << width[p]) - 1;
        memset(cnt, 0, (size_t)(top + 1) * sizeof(uint32_t));
        for (int64_t i = 0; i < m; i++) cnt[(tmp[i] >> shift[p]) & top]++;
        uint32_t d = top;
        while (want > (int64_t)cnt[d]) want -= cnt[d--];
        prefix |= d << shift[p];
        if (p < 2) { /* keep the keys of bucket d */
            int64_t q = 0;
            for (int64_t i = 0; i < m; i++) {
                tmp[q] = tmp[i];
                q += ((tmp[i] >> shift[p]) & top) == d;
            }
            m = q;
        }
    }
    const uint32_t bits = (prefix & 0x80000000u) ? (prefix & 0x7fffffffu) : ~prefix;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Predicted rows of one token, ascending: score_i = (W2t^T relu(W1 x + b1))_i; active when
 * score_i > cut_i, or (topk > 0) the topk highest score_i - cut_i (ties: lowest ids).
 * QPredictor (sparseinfer/sparse/predictor.py) is the same arithmetic in Python. */
static int64_t predict_rows(const sparse_mlp_t *s, const float *xn, float *z, float *sc, int32_t *ids,
                            int32_t *rows) {
    const int64_t r = s->w1->rows, F = s->F;
    si_gemv(s->w1, xn, z);
    for (int64_t j = 0; j < r; j++) {
        const float v = z[j] + s->b1[j];
        z[j] = v > 0.0f ? v : 0.0f;
        ids[j] = (int32_t)j;
    }
    si_axpy_rows(s->w2t, z, ids, r, sc);
    int64_t m = 0;
    if (s->topk <= 0) {
        for (int64_t i = 0; i < F; i++)
            if (sc[i] > s->cut[i]) rows[m++] = (int32_t)i;
        return m;
    }
    const int64_t k = s->topk < F ? s->topk : F;
    for (int64_t i = 0; i < F; i++) sc[i] -= s->cut[i];
    /* ids (room for max(r, F) values) is free again */
    const float t = kth_largest(sc, F, k, (uint32_t *)ids);
    int64_t above = 0;
    for (int64_t i = 0; i < F; i++) above += sc[i] > t;
    for (int64_t i = 0, ties = k - above; i < F; i++)
        if (sc[i] > t || (sc[i] == t && ties-- > 0)) rows[m++] = (int32_t)i;
    return m;
}

/* One token through a SparseFFN (sparseinfer/sparse/ffn.py, `SparseFFN._sparse_rows`, the
 * reference): candidate rows (given, predicted, or all), then the one pass over neuron records
 * (`records`: first, activation, keep, second and down_t of the kept), or the fused kernel
 * over them, or: first projection on the candidates (all: with up in one pass when gate and up are
 * one weight), activation, keep |a| > threshold, up on the kept rows (dense above
 * up_crossover), down_t over the kept rows (the stored down, dense, above crossover).
 * norm_w non-NULL: xo = x + ffn(rms_norm(x)); NULL: xo = ffn(x).  x and xo may alias. */
void si_decode_sparse_mlp(const float *x, float *xo, int64_t n, const float *norm_w, float eps,
                          const sparse_mlp_t *s, const int32_t *given, int64_t n_given) {
    const int64_t F = s->F, r = s->w1 ? s->w1->rows : 0;
    const int64_t nf = up16(F), ni = up16(r > F ? r : F), fl = (int64_t)sizeof(float);
    char *base = si_scratch(6, (size_t)((2 * up16(n) + up16(r) + ni + 6 * nf) * fl));
    if (!base) abort();
    float *xn = (float *)base, *y = xn + up16(n), *z = y + up16(n), *sc = z + up16(r);
    int32_t *ids = (int32_t *)(sc + nf), *cand = ids + ni, *kept = cand + nf;
    /* a then u adjacent (one dense gemv over gate and up writes both), h after */
    float *a = (float *)(kept + nf), *u = a + F, *h = a + 2 * nf;
    int64_t *cnt = s->counters;
    if (norm_w) si_rms_norm(x, norm_w, xn, 1, n, eps);
    else memcpy(xn, x, (size_t)n * sizeof(float));
    cnt[0]++;
    const int32_t *rows = given;
    int64_t nc = n_given;
    if (!given && s->w1) {
        const double t0 = now_seconds();
        nc = predict_rows(s, xn, z, sc, ids, cand);
        *s->pred_seconds += now_seconds() - t0;
        cnt[9]++;
        rows = cand;
    }
    const qmat_t *second = s->second;
    if (rows && nc == 0) {
        memset(y, 0, (size_t)n * sizeof(float));
    } else if (rows && s->records) {
        /* one pass over whole neuron records: up and down on the kept rows, never dense */
        const int64_t nk = si_sparse_records(s->records, s->act, s->relu_up, s->first, s->first_bias, second,
                                             s->second_bias, s->down_t, xn, rows, nc, s->threshold, y);
        cnt[2] += nc, cnt[8] += nk, cnt[7] += nk;
        if (second) cnt[5] += nk;
    } else if (rows && s->fused) {
        si_sparse_ffn(s->act, second ? s->first : NULL, second ? second : s->first, s->down_t, xn, rows, nc, y);
        cnt[1] += nc;
    } else {
        /* no candidate rows and gate/up one fused weight: one dense pass computes both */
        const int gate_up = !rows && s->first_up;
        if (rows) si_gemv_rows(s->first, xn, rows, nc, a);
        else si_gemv(gate_up ? s->first_up : s->first, xn, a), nc = F;
        if (gate_up) cnt[3]++;
        else cnt[2] += nc;
        if (s->first_bias)
            for (int64_t j = 0; j < nc; j++) a[j] += s->first_bias[rows ? rows[j] : j];
        si_act(s->act, a, nc);
        int64_t nk = 0; /* branch-free compaction: |a| > threshold is unpredictable */
        const float thr = s->threshold;
        for (int64_t j = 0; j < nc; j++) {
            const float v = a[j];
            kept[nk] = rows ? rows[j] : (int32_t)j;
            h[nk] = v;
            nk += fabsf(v) > thr;
        }
        cnt[8] += nk;
        if (second && nk) {
            /* up of the kept neurons: from the fused pass, dense above its crossover, else rows */
            int full = gate_up;
            if (!gate_up && (float)nk > s->up_crossover * (float)F) {
                si_gemv(second, xn, u);
                full = 1, cnt[4]++;
            } else if (!gate_up) {
                si_gemv_rows(second, xn, kept, nk, u);
                cnt[5] += nk;
            }
            for (int64_t j = 0; j < nk; j++) {
                const float uj = full ? u[kept[j]] : u[j];
                float v = s->second_bias ? uj + s->second_bias[kept[j]] : uj;
                if (s->relu_up && !(v > 0.0f)) v = 0.0f;
                h[j] *= v;
            }
        }
        if ((float)nk > s->crossover * (float)F) {
            /* most neurons kept: down dense in its stored format and column order, h scattered */
            memset(a, 0, (size_t)F * sizeof(float));
            for (int64_t j = 0; j < nk; j++) a[s->order[kept[j]]] = h[j];
            si_gemv(s->down, a, y);
            cnt[6]++;
        } else if (nk) {
            si_axpy_rows(s->down_t, h, kept, nk, y);
            cnt[7] += nk;
        } else {
            memset(y, 0, (size_t)n * sizeof(float));
        }
    }
    if (s->down_bias)
        for (int64_t i = 0; i < n; i++) y[i] += s->down_bias[i];
    if (norm_w)
        for (int64_t i = 0; i < n; i++) xo[i] = x[i] + y[i];
    else
        memcpy(xo, y, (size_t)n * sizeof(float));
}
