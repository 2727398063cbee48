/* One token through a pre-norm transformer half-block: the steps a decode plan runs; and the
 * same for one token of each of B sequences at once (batched decode: every product over all
 * the rows, so each weight is read once per step).
 *
 * Why: in Python each block costs a few dozen small torch operations per token (norm, bias,
 * rotary, cache writes, residual adds, activation, row choice), and the weight streaming in
 * between evicts the interpreter's working set.  Here one call runs one half-block on its plan
 * (ops.h: si_attn_plan_t, si_ffn_plan_t, built once per layer by
 * sparseinfer/kernels/decode_plan.py), with the same kernels and element-wise arithmetic as
 * the Python layers (sparseinfer/models/layers.py) and the one-token sparse FFN reference
 * (sparseinfer/kernels/reference.py: sparse_ffn_token), which tests compare it with.
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

/* One token's q/k/v outputs y (nt floats, rotated in place) -> its attention output att (H*D
 * floats): biases, rotary, the new k/v written to the cache (converted, quantized, once),
 * then attention over the cache up to and including it. */
static void attend_row(const si_attn_plan_t *p, float *y, float *att, const float *cos, const float *sin,
                       const si_kv_ref_t *kv) {
    const int64_t H = p->H, Hk = p->Hk, D = p->D;
    const int64_t nq = H * D, nkv = Hk * D, nt = nq + 2 * nkv;
    const int fused = p->k.fmt < 0;
    if (p->bq)
        for (int64_t i = 0; i < (fused ? nt : nq); i++) y[i] += p->bq[i];
    if (p->bk)
        for (int64_t i = 0; i < nkv; i++) y[nq + i] += p->bk[i];
    if (p->bv)
        for (int64_t i = 0; i < nkv; i++) y[nq + nkv + i] += p->bv[i];
    if (p->n_rot > 0) rope(y, H + Hk, D, p->n_rot, cos, sin);
    const int type = (int)p->kv_type;
    const int64_t rb = si_kv_row_bytes(type, D);
    for (int64_t h = 0; h < Hk; h++) {
        si_kv_store(type, y + nq + h * D, (char *)kv->k + h * kv->kstride + kv->pos * rb, D);
        si_kv_store(type, y + nq + nkv + h * D, (char *)kv->v + h * kv->vstride + kv->pos * rb, D);
    }
    si_attend1(type, y, kv->k, kv->v, att, H, Hk, D, kv->pos + 1, kv->kstride, kv->vstride, p->scale);
}

void si_decode_attn_rows(const si_attn_plan_t *p, int64_t B, const float *x, float *xo, const float *cos,
                         const float *sin, const si_kv_ref_t *kv) {
    const int64_t n = p->n, H = p->H, Hk = p->Hk, D = p->D;
    const int64_t nq = H * D, nkv = Hk * D, nt = nq + 2 * nkv;
    /* rows back to back (the products read token t at t * cols): xn, y, att, ob */
    float *xn = si_scratch(6, (size_t)(B * (2 * n + nt + nq) + 64) * sizeof(float));
    if (!xn) abort();
    float *y = xn + B * n, *att = y + B * nt, *ob = att + B * nq;
    si_rms_norm(x, p->norm_w, xn, B, n, p->eps);
    si_matmul_ld(&p->q, xn, B, y, nt);
    if (p->k.fmt >= 0) {
        si_matmul_ld(&p->k, xn, B, y + nq, nt);
        si_matmul_ld(&p->v, xn, B, y + nq + nkv, nt);
    }
    for (int64_t b = 0; b < B; b++)
        attend_row(p, y + b * nt, att + b * nq, cos ? cos + b * p->n_rot : NULL, sin ? sin + b * p->n_rot : NULL,
                   kv + b);
    si_matmul_ld(&p->o, att, B, ob, n);
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * n, *obb = ob + b * n;
        float *xob = xo + b * n;
        for (int64_t i = 0; i < n; i++) xob[i] = xb[i] + (p->bo ? obb[i] + p->bo[i] : obb[i]);
    }
}

void si_decode_attn(const si_attn_plan_t *p, const float *x, float *xo, const float *cos, const float *sin,
                    void *kc, void *vc, int64_t kstride, int64_t vstride, int64_t pos) {
    const si_kv_ref_t kv = {kc, vc, kstride, vstride, pos};
    si_decode_attn_rows(p, 1, x, xo, cos, sin, &kv);
}

static int has(const qmat_t *w) { return w->fmt >= 0; }

/* One token's hidden activations of the dense MLP from its first (gate) outputs g and second
 * (up) outputs u (F each; u unused by a plain FFN): h = act(g + b1) * (u + b2); g is
 * overwritten with act(g + b1). */
static void hidden_row(const si_ffn_plan_t *p, float *g, const float *u, float *h) {
    const int64_t F = p->F;
    if (p->first_bias)
        for (int64_t i = 0; i < F; i++) g[i] += p->first_bias[i];
    si_act(p->act, g, F);
    if (!has(&p->second)) {
        memcpy(h, g, (size_t)F * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < F; i++) {
        float v = u[i];
        if (p->second_bias) v += p->second_bias[i];
        if (p->relu_up && !(v > 0.0f)) v = 0.0f;
        h[i] = g[i] * v;
    }
}

void si_decode_ffn_rows(si_ffn_plan_t *p, int64_t B, const float *x, float *xo) {
    const int64_t n = p->n, F = p->F;
    if (p->kind != FFN_DENSE) { /* each row its own candidate neurons */
        for (int64_t b = 0; b < B; b++) si_decode_ffn(p, x + b * n, xo + b * n, NULL, -1);
        return;
    }
    /* rows back to back: xn, gate and up outputs (2F per row), hidden h, y */
    float *xn = si_scratch(6, (size_t)(B * (2 * n + 3 * F) + 64) * sizeof(float));
    if (!xn) abort();
    float *gu = xn + B * n, *h = gu + 2 * B * F, *y = h + B * F;
    if (p->norm_w) si_rms_norm(x, p->norm_w, xn, B, n, p->eps);
    else memcpy(xn, x, (size_t)(B * n) * sizeof(float));
    if (p->flags & FFN_GATE_UP) {
        si_matmul_ld(&p->gate_up, xn, B, gu, 2 * F);
    } else {
        si_matmul_ld(&p->first, xn, B, gu, 2 * F);
        if (has(&p->second)) si_matmul_ld(&p->second, xn, B, gu + F, 2 * F);
    }
    for (int64_t b = 0; b < B; b++) hidden_row(p, gu + 2 * b * F, gu + 2 * b * F + F, h + b * F);
    si_matmul_ld(&p->down, h, B, y, n);
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * n, *yb = y + b * n;
        float *xob = xo + b * n;
        for (int64_t i = 0; i < n; i++) {
            const float v = p->down_bias ? yb[i] + p->down_bias[i] : yb[i];
            xob[i] = p->norm_w ? xb[i] + v : v;
        }
    }
}

/* ----------------------------------------------------------------- sparse FFN half-block */

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The k-th largest of v[0..n) (1 <= k <= n): a radix select on order-preserving integer
 * keys, 11 + 11 + 10 bits, the first pass over all n and the later ones over the keys left in
 * the chosen bucket.  Branch-free counting: a quickselect's data-dependent branches mispredict
 * on these scores (thousands per layer and token) and cost more.  tmp: room for n uint32. */
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
static int64_t predict_rows(const si_ffn_plan_t *s, const float *xn, float *z, float *sc, int32_t *ids,
                            int32_t *rows) {
    const int64_t r = s->w1.rows, F = s->F;
    si_gemv(&s->w1, xn, z);
    for (int64_t j = 0; j < r; j++) {
        const float v = z[j] + s->b1[j];
        z[j] = v > 0.0f ? v : 0.0f;
        ids[j] = (int32_t)j;
    }
    si_axpy_rows(&s->w2t, z, ids, r, sc);
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

/* The one-token sparse FFN (reference: sparseinfer/kernels/reference.py, sparse_ffn_token):
 * candidate rows (given, predicted, or all), then the one pass over neuron records (FFN_RECORDS:
 * first, activation, keep, second and down_t of the kept), or the fused kernel over them
 * (FFN_FUSED), or: first projection on the candidates (all: with up in one pass when gate and
 * up are one weight, FFN_GATE_UP), activation, keep |a| > threshold, up on the kept rows (dense
 * above up_crossover), down_t over the kept rows (the stored down, dense, above crossover).
 * y = ffn(xn); the scratch after xn and y holds the rest. */
static void sparse_ffn(si_ffn_plan_t *s, const float *xn, float *y, float *z, const int32_t *given,
                       int64_t n_given) {
    const int64_t F = s->F, n = s->n, r = has(&s->w1) ? s->w1.rows : 0;
    const int64_t nf = up16(F), ni = up16(r > F ? r : F);
    float *sc = z + up16(r);
    int32_t *ids = (int32_t *)(sc + nf), *cand = ids + ni, *kept = cand + nf;
    /* a then u adjacent (one dense gemv over gate and up writes both), h after */
    float *a = (float *)(kept + nf), *u = a + F, *h = a + 2 * nf;
    si_ffn_stats_t *st = &s->stats;
    st->tokens++;
    const int32_t *rows = given;
    int64_t nc = n_given;
    if (!given && r) {
        const double t0 = now_seconds();
        nc = predict_rows(s, xn, z, sc, ids, cand);
        st->predictor_seconds += now_seconds() - t0;
        st->predictions++;
        rows = cand;
    }
    const qmat_t *second = has(&s->second) ? &s->second : NULL;
    if (rows && nc == 0) {
        memset(y, 0, (size_t)n * sizeof(float));
    } else if (rows && (s->flags & FFN_RECORDS)) {
        /* one pass over whole neuron records: up and down on the kept rows, never dense */
        const int64_t nk = si_sparse_records(s->records, s->act, s->relu_up, &s->first, s->first_bias, second,
                                             s->second_bias, &s->down_t, xn, rows, nc, s->threshold, y);
        st->first_rows += nc, st->kept += nk, st->down_rows += nk;
        if (second) st->up_rows += nk;
    } else if (rows && (s->flags & FFN_FUSED)) {
        si_sparse_ffn(s->act, second ? &s->first : NULL, second ? second : &s->first, &s->down_t, xn, rows, nc, y);
        st->fused_rows += nc;
    } else {
        /* no candidate rows and gate/up one fused weight: one dense pass computes both */
        const int gate_up = !rows && (s->flags & FFN_GATE_UP);
        if (rows) si_gemv_rows(&s->first, xn, rows, nc, a);
        else si_gemv(gate_up ? &s->gate_up : &s->first, xn, a), nc = F;
        if (gate_up) st->gate_up_passes++;
        else st->first_rows += nc;
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
        st->kept += nk;
        if (second && nk) {
            /* up of the kept neurons: from the fused pass, dense above its crossover, else rows */
            int full = gate_up;
            if (!gate_up && (float)nk > s->up_crossover * (float)F) {
                si_gemv(second, xn, u);
                full = 1, st->dense_ups++;
            } else if (!gate_up) {
                si_gemv_rows(second, xn, kept, nk, u);
                st->up_rows += nk;
            }
            for (int64_t j = 0; j < nk; j++) {
                const float uj = full ? u[kept[j]] : u[j];
                float v = s->second_bias ? uj + s->second_bias[kept[j]] : uj;
                if (s->relu_up && !(v > 0.0f)) v = 0.0f;
                h[j] *= v;
            }
        }
        if (has(&s->down) && (float)nk > s->crossover * (float)F) {
            /* most neurons kept: down dense in its stored format and column order, h scattered */
            memset(a, 0, (size_t)F * sizeof(float));
            for (int64_t j = 0; j < nk; j++) a[s->order[kept[j]]] = h[j];
            si_gemv(&s->down, a, y);
            st->dense_downs++;
        } else if (nk) {
            si_axpy_rows(&s->down_t, h, kept, nk, y);
            st->down_rows += nk;
        } else {
            memset(y, 0, (size_t)n * sizeof(float));
        }
    }
}

void si_decode_ffn(si_ffn_plan_t *p, const float *x, float *xo, const int32_t *rows, int64_t n_rows) {
    if (p->kind == FFN_DENSE) {
        si_decode_ffn_rows(p, 1, x, xo);
        return;
    }
    const int64_t n = p->n, F = p->F, r = has(&p->w1) ? p->w1.rows : 0;
    const int64_t nf = up16(F), ni = up16(r > F ? r : F), fl = (int64_t)sizeof(float);
    /* xn, y, then the sparse step's z, scores, ids, candidates, kept, a, u, h */
    char *base = si_scratch(6, (size_t)((2 * up16(n) + up16(r) + ni + 6 * nf) * fl));
    if (!base) abort();
    float *xn = (float *)base, *y = xn + up16(n), *z = y + up16(n);
    if (p->norm_w) si_rms_norm(x, p->norm_w, xn, 1, n, p->eps);
    else memcpy(xn, x, (size_t)n * sizeof(float));
    sparse_ffn(p, xn, y, z, rows, n_rows);
    if (p->down_bias)
        for (int64_t i = 0; i < n; i++) y[i] += p->down_bias[i];
    if (p->norm_w)
        for (int64_t i = 0; i < n; i++) xo[i] = x[i] + y[i];
    else
        memcpy(xo, y, (size_t)n * sizeof(float));
}

/* ----------------------------------------------------------------- plan checks */

/* complete a descriptor filled from Python (fmt, rows, cols, qs, d, m, row_bytes and ds as
 * strides, 0 = natural), checking it; fmt -1 = absent, allowed where `optional` */
static int complete(qmat_t *w, int optional) {
    if (w->fmt < 0) return optional ? 0 : -1;
    return si_qmat_init(w, w->fmt, w->rows, w->cols, w->qs, w->d, w->m, w->row_bytes, w->ds);
}

static int shape(const qmat_t *w, int64_t rows, int64_t cols) { return w->rows == rows && w->cols == cols; }

const char *si_check_attn_plan(si_attn_plan_t *p) {
    if (complete(&p->q, 0) || complete(&p->k, 1) || complete(&p->v, 1) || complete(&p->o, 0))
        return "invalid weight descriptor";
    const int64_t n = p->n, H = p->H, Hk = p->Hk, D = p->D;
    if (n < 1 || H < 1 || Hk < 1 || D < 1 || H % Hk || p->n_rot < 0 || p->n_rot > D || p->n_rot % 2)
        return "bad head counts or sizes";
    if (p->kv_type < 0 || p->kv_type >= KV_COUNT) return "unknown KV cache type";
    if ((p->k.fmt < 0) != (p->v.fmt < 0)) return "k and v must both be given or both fused into q";
    if (p->k.fmt < 0) {
        if (!shape(&p->q, (H + 2 * Hk) * D, n) || p->bk || p->bv) return "fused q/k/v weight has the wrong shape";
    } else if (!shape(&p->q, H * D, n) || !shape(&p->k, Hk * D, n) || !shape(&p->v, Hk * D, n)) {
        return "q/k/v weights have the wrong shape";
    }
    if (!shape(&p->o, n, H * D)) return "o weight has the wrong shape";
    if (!p->norm_w) return "null norm weight";
    return 0;
}

const char *si_check_ffn_plan(si_ffn_plan_t *p) {
    if (complete(&p->first, 0) || complete(&p->second, 1) || complete(&p->down, 1) ||
        complete(&p->down_t, p->kind == FFN_DENSE) || complete(&p->w1, 1) || complete(&p->w2t, 1) ||
        (p->kind == FFN_DENSE && !has(&p->down)))
        return "invalid weight descriptor";
    const int64_t n = p->n, F = p->F;
    const int gated = has(&p->second);
    if (p->kind != FFN_DENSE && p->kind != FFN_SPARSE) return "unknown FFN kind";
    if (p->act < 0 || p->act >= ACT_COUNT) return "unknown activation code";
    if (n < 1 || F < 1 || !shape(&p->first, F, n) || (gated && !shape(&p->second, F, n)) ||
        (has(&p->down) && !shape(&p->down, n, F)))
        return "gate/up/down weights have the wrong shape";
    p->gate_up.fmt = -1;
    if (p->flags & FFN_GATE_UP) {
        /* gate and up adjacent row blocks of one weight: the dense first projection covers both */
        const qmat_t *f = &p->first, *u = &p->second;
        if (!gated || u->fmt != f->fmt || u->row_bytes != f->row_bytes || u->ds != f->ds ||
            u->qs != f->qs + F * f->row_bytes || (f->d && u->d != f->d + F * f->ds) ||
            (f->m && u->m != f->m + F * f->ds) || (!f->d) != (!u->d) || (!f->m) != (!u->m) ||
            si_qmat_init(&p->gate_up, f->fmt, 2 * F, n, f->qs, f->d, f->m, f->row_bytes, f->ds) != 0)
            return "gate and up are not one fused weight";
    }
    p->records = NULL;
    if (p->kind == FFN_DENSE) {
        if (p->flags & ~FFN_GATE_UP) return "a dense FFN takes no sparse flags";
        return 0;
    }
    if (!shape(&p->down_t, F, n)) return "down_t must be (neurons, width)";
    const qmat_t *rowed[5] = {&p->first, &p->second, &p->down_t, &p->w1, &p->w2t};
    for (int i = 0; i < 5; i++)
        if (si_fmt_tiled(rowed[i]->fmt))
            return "row-tiled (tq4, tq6, tq4k) weights have no row-sparse kernels: give the sparse FFN row-major weights";
    if (p->down_t.fmt == FMT_Q6 || p->down_t.fmt == FMT_Q4K ||
        (has(&p->w2t) && (p->w2t.fmt == FMT_Q6 || p->w2t.fmt == FMT_Q4K)))
        return "q6 and q4k weights have no column-sparse (axpy) kernel";
    if (has(&p->down) && !p->order) return "null neuron order";
    if (has(&p->w1) != has(&p->w2t)) return "predictor needs both w1 and w2t";
    if (has(&p->w1) && (p->w1.cols != n || !shape(&p->w2t, p->w1.rows, F) || !p->b1 || !p->cut))
        return "predictor weights have the wrong shape";
    if (p->topk < 0 || p->topk > F) return "topk out of range";
    if (p->flags & FFN_RECORDS) {
        p->records = si_record_base(&p->first, gated ? &p->second : NULL, &p->down_t);
        if (!p->records) return "first, second and down_t are not neuron records";
    }
    return 0;
}
