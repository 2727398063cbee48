/* Row-sparse products, for the activation-sparse FFN: products over a list of rows
 * (si_gemv_rows on si_dots; si_axpy_rows with its thread-count-independent split and spread
 * row order), the sparse FFN (si_sparse_ffn), the thresholded hidden rows of the T > 1 path
 * (si_hidden_rows) and the one-pass FFN over neuron records (si_record_base,
 * si_sparse_records).  Separate from dense.c because these take a list of active rows: their
 * splits, row orders and prefetching are built for scattered reads, not streaming. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void si_gemv_rows(const qmat_t *w, const float *x, const int32_t *rows, int64_t n, float *y) {
    yout_t o = {y, 1, 0};
    si_dots(w, rows, n, x, 1, o, 0);
}

/* ----------------------------------------------------------------------------- axpy */

/* Two splits, both independent of the thread count (each list, the whole one or a
 * partition's, taken in spread_rows order):
 *  - few rows: by output columns (each column sums all rows in order);
 *  - many rows: the row list is cut into P partitions, P a function of n only; each
 *    partition streams whole rows into its own partial vector, and the partials are added
 *    in partition order.  Whole-row reads matter: column chunks read every row in pieces of a
 *    few hundred bytes, which random DRAM access serves at a fraction of the bandwidth. */
#define AXPY_MAX_COLS 4096 /* kernel limit per call (AXPY_MAXB * 32) */
#define AXPY_ROWS_PER_PART 96
#define AXPY_MAX_PARTS 8

typedef struct {
    const kernels_t *k;
    const qmat_t *wt;
    const float *h;
    const int32_t *rows;
    int64_t n, width, nparts;
    float *y, *part;
    float *hs; /* h and rows of each partition in tile order (spread_rows) */
    int32_t *rs;
} axpy_ctx;

/* The row list [0, n) in the order the axpy kernels should take it: each group of 8
 * consecutive entries takes one row from each eighth of the list (t, t + q, ..., t + 7q with
 * q = n / 8), the last n % 8 rows stay at the end.  The kernels read 8 rows at a time, and
 * 8 rows far apart are 8 separate streams for the hardware prefetchers, as in the one-token
 * dot tiles' walk (si_dot_rows8); 8 neighbours of a sorted list share pages (dense-like lists) and read
 * slower.  It helps most on long lists (high active fractions) and matters little on short
 * ones, with the AVX-512 and the AVX2 kernels alike.  A permutation of the sums, fixed by n:
 * results stay independent of the thread count. */
static void spread_rows(const float *h, const int32_t *rows, int64_t n, float *ho, int32_t *ro) {
    const int64_t q = n / 8;
    int64_t o = 0;
    if (q >= 2)
        for (int64_t t = 0; t < q; t++)
            for (int r = 0; r < 8; r++, o++) {
                ho[o] = h[t + r * q];
                ro[o] = rows[t + r * q];
            }
    for (; o < n; o++) {
        ho[o] = h[o];
        ro[o] = rows[o];
    }
}

static void axpy_cols_task(void *p, int64_t c) {
    const axpy_ctx *a = p;
    int64_t c0 = c * a->width, c1 = c0 + a->width < a->wt->cols ? c0 + a->width : a->wt->cols;
    a->k->axpy(a->wt, a->h, a->rows, a->n, c0, c1, a->y);
}

static int64_t part_start(int64_t n, int64_t nparts, int64_t p) { return n * p / nparts; }

static void axpy_part_task(void *p, int64_t c) {
    const axpy_ctx *a = p;
    const int64_t j0 = part_start(a->n, a->nparts, c), j1 = part_start(a->n, a->nparts, c + 1);
    float *y = a->part + c * a->wt->cols;
    spread_rows(a->h + j0, a->rows + j0, j1 - j0, a->hs + j0, a->rs + j0);
    for (int64_t c0 = 0; c0 < a->wt->cols; c0 += AXPY_MAX_COLS) {
        int64_t c1 = c0 + AXPY_MAX_COLS < a->wt->cols ? c0 + AXPY_MAX_COLS : a->wt->cols;
        a->k->axpy(a->wt, a->hs + j0, a->rs + j0, j1 - j0, c0, c1, y);
    }
}

static void axpy_reduce_task(void *p, int64_t c) {
    const axpy_ctx *a = p;
    const int64_t cols = a->wt->cols, c0 = c * a->width, c1 = c0 + a->width < cols ? c0 + a->width : cols;
    float *y = a->y;
    memcpy(y + c0, a->part + c0, (size_t)(c1 - c0) * sizeof(float));
    for (int64_t q = 1; q < a->nparts; q++) {
        const float *src = a->part + q * cols;
        for (int64_t i = c0; i < c1; i++) y[i] += src[i];
    }
}

/* Drop rows whose coefficient is exactly 0 (ReLU models: many predicted-active neurons). */
static int64_t compact(const float *h, const int32_t *rows, int64_t n, const float **ho, const int32_t **ro) {
    int64_t nz = 0;
    for (int64_t j = 0; j < n; j++) nz += h[j] == 0.0f;
    *ho = h;
    *ro = rows;
    if (nz == 0) return n;
    char *p = scratch(3, (size_t)(n - nz) * 8 + 64);
    if (!p) abort();
    float *hc = (float *)p;
    int32_t *rc = (int32_t *)(p + 4 * (n - nz));
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++)
        if (h[j] != 0.0f) {
            hc[m] = h[j];
            rc[m++] = rows[j];
        }
    *ho = hc;
    *ro = rc;
    return m;
}

void si_axpy_rows(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n, float *y) {
    const float *hc;
    const int32_t *rc;
    n = compact(h, rows, n, &hc, &rc);
    char *order = scratch(10, (size_t)n * 8 + 64);
    if (!order) abort();
    axpy_ctx a = {si_kern(), wt, hc, rc, n, 0, 1, y, NULL, (float *)order, (int32_t *)(order + 4 * n)};
    int64_t nparts = n / AXPY_ROWS_PER_PART;
    if (nparts > AXPY_MAX_PARTS) nparts = AXPY_MAX_PARTS;
    if (nparts <= 1 || n * wt->row_bytes < SERIAL_BYTES) {
        /* column chunks: multiples of 128 columns, <= 4096, ~2 per thread */
        spread_rows(hc, rc, n, a.hs, a.rs);
        a.h = a.hs;
        a.rows = a.rs;
        a.width = up((wt->cols + 2 * nthreads() - 1) / (2 * nthreads()), 128);
        if (a.width > AXPY_MAX_COLS) a.width = AXPY_MAX_COLS;
        run(axpy_cols_task, &a, (wt->cols + a.width - 1) / a.width, n * wt->row_bytes);
        return;
    }
    a.nparts = nparts;
    a.part = scratch(4, (size_t)(nparts * wt->cols) * sizeof(float) + 64);
    if (!a.part) abort();
    run(axpy_part_task, &a, nparts, n * wt->row_bytes);
    a.width = up((wt->cols + nthreads() - 1) / nthreads(), 64);
    run(axpy_reduce_task, &a, (wt->cols + a.width - 1) / a.width, nparts * wt->cols * 4);
}

/* ------------------------------------------------------------------------ sparse FFN */

typedef struct {
    const kernels_t *k;
    int act;
    const qmat_t *gate, *up;
    const xq_t *xg, *xu;
    const float *x;
    const int32_t *rows;
    int64_t n, chunk;
    float *g, *h;
} ffn_ctx;

static void ffn_dot(const kernels_t *k, const qmat_t *w, const xq_t *xq, const float *x,
                    const int32_t *rows, int64_t i0, int64_t i1, float *y) {
    yout_t o = {y, 1, 0};
    if (w->fmt >= FMT_Q8) k->dot_q(w, rows, i0, i1, xq, 1 << xq->pair, &o);
    else k->dot_f(w, rows, i0, i1, x, w->cols, 1, &o);
}

static void ffn_task(void *p, int64_t c) {
    const ffn_ctx *a = p;
    int64_t i0 = c * a->chunk, i1 = i0 + a->chunk < a->n ? i0 + a->chunk : a->n;
    ffn_dot(a->k, a->up, a->xu, a->x, a->rows, i0, i1, a->h);
    if (a->gate) {
        ffn_dot(a->k, a->gate, a->xg, a->x, a->rows, i0, i1, a->g);
        a->k->act(a->act, a->g + i0, i1 - i0);
        for (int64_t i = i0; i < i1; i++) a->h[i] *= a->g[i];
    } else {
        a->k->act(a->act, a->h + i0, i1 - i0);
    }
}

void si_sparse_ffn(int act, const qmat_t *gate, const qmat_t *upm, const qmat_t *down_t,
                   const float *x, const int32_t *rows, int64_t n, float *y) {
    const qmat_t *first = gate ? gate : upm, *second = gate ? upm : NULL;
    const uint8_t *rec = si_record_base(first, second, down_t);
    if (rec) { /* neuron records: their one pass, keeping every row */
        si_sparse_records(rec, act, 0, first, NULL, second, NULL, down_t, x, rows, n, -1.0f, y);
        return;
    }
    const kernels_t *k = si_kern();
    xq_t xu, xg;
    if (upm->fmt >= FMT_Q8) {
        if (si_xq_alloc(&xu, 0, layout_of(upm->fmt), upm->kp, 1) != 0) abort();
        si_quant_tokens(k, x, upm->cols, upm->kp, 0, 1, &xu);
    }
    const xq_t *pxg = &xu;
    if (gate && gate->fmt >= FMT_Q8 && (upm->fmt < FMT_Q8 || layout_of(gate->fmt) != layout_of(upm->fmt))) {
        if (si_xq_alloc(&xg, 1, layout_of(gate->fmt), gate->kp, 1) != 0) abort();
        si_quant_tokens(k, x, gate->cols, gate->kp, 0, 1, &xg);
        pxg = &xg;
    }
    float *tmp = scratch(2, (size_t)(2 * n + 32) * sizeof(float));
    if (!tmp) abort();
    ffn_ctx a = {k, act, gate, upm, pxg, &xu, x, rows, n, 0, tmp, tmp + n + 16};
    int64_t rb = upm->row_bytes + (gate ? gate->row_bytes : 0);
    a.chunk = row_chunk(n, rb);
    run(ffn_task, &a, (n + a.chunk - 1) / a.chunk, n * rb);
    si_axpy_rows(down_t, a.h, rows, n, y);
}

/* ------------------------------------------------------- thresholded hidden rows (prefill) */

/* Row m of the sparsified FFN's hidden activations, for SparseFFN's T > 1 path: a = act(g),
 * h = a * (relu_up ? relu(u) : u) (u NULL: h = a), kept where |a| > thr (h = 0 elsewhere),
 * written to out[m * n + order[k]] (order NULL: k), i.e. back in the weights' column order.
 * One pass instead of ~8 torch element-wise passes over M x n. */
typedef struct {
    int act, relu_up;
    float *g;
    const float *u;
    int64_t gs, us, n;
    float thr;
    const int64_t *order;
    float *out;
} hid_ctx;

static void hid_task(void *p, int64_t m) {
    const hid_ctx *a = p;
    float *g = a->g + m * a->gs, *o = a->out + m * a->n;
    const float *u = a->u ? a->u + m * a->us : NULL;
    si_kern()->act(a->act, g, a->n);
    for (int64_t k = 0; k < a->n; k++) {
        float v = g[k];
        if (u) {
            float w = u[k];
            if (a->relu_up && !(w > 0.0f)) w = 0.0f;
            v = fabsf(v) > a->thr ? v * w : 0.0f;
        } else {
            v = fabsf(v) > a->thr ? v : 0.0f;
        }
        o[a->order ? a->order[k] : k] = v;
    }
}

void si_hidden_rows(int act, int relu_up, float *g, int64_t gs, const float *u, int64_t us, int64_t M, int64_t n,
                    float thr, const int64_t *order, float *out) {
    hid_ctx a = {act, relu_up, g, u, gs, us, n, thr, order, out};
    run(hid_task, &a, M, M * n * 12);
}

/* ------------------------------------------------------- sparse FFN over neuron records */

/* One pass over the candidate neurons when each neuron's first (gate) row, second (up) row and
 * down_t row, scales included, lie in one contiguous record (the three weights are row views
 * with one common stride; SparseFFN's `records`).  Random reads of ~1 KB pieces (a row, then
 * its scales elsewhere) are much slower than reads of whole records, and whole records read 8
 * at a time (as the one-token tiles and the axpy read them) faster still, so the pass computes,
 * per block of neurons (see rec_prefetch for what it reads ahead):
 * first rows, activation, keep |a| > threshold, second rows of the kept, h, and their down_t
 * rows into a partial sum.  The candidate list is cut into partitions as a function of n only
 * (each summed in order by one thread, partials added in partition order), so results do not
 * depend on the thread count. */
/* Block sizes: neurons go in blocks, not a few at a time, and the kept rows' down_t rows are
 * summed in one partial-sum pass per many kept (REC_FLUSH), not per block; both made the pass
 * faster with the AVX-512 and the AVX2 kernels.  Blocks of 128 with the AVX-512 kernels, whose
 * dot tiles and axpy read 8 rows at a time (faster than 64).  The AVX2 kernels prefetch whole
 * records a block ahead and keep 64 (two blocks of 128 records would overflow a 512 KB L2).
 * Tuned with `python benchmarks/kernels.py` (its sparse_ffn_records rows); the #ifndef macros
 * below can be set at compile time to compare. */
#ifndef REC_BLOCK
#define REC_BLOCK 128
#endif
#define REC_BLOCK_WHOLE 64
#ifndef REC_AHEAD
#define REC_AHEAD 1
#endif
#ifndef REC_FLUSH
#define REC_FLUSH 512
#endif
/* ... and before the kept records pass this many bytes, so that their down rows are still in
 * a 512 KB L2 when summed (wide records: 11008x4096 q4 flushes every block) */
#ifndef REC_FLUSH_BYTES
#define REC_FLUSH_BYTES (384 << 10)
#endif
#ifndef REC_ROWS_PER_PART
#define REC_ROWS_PER_PART 64
#endif
#define REC_MAX_PARTS 8

typedef struct {
    const kernels_t *k;
    int act, relu_up;
    const qmat_t *first, *second, *down_t;
    const float *fb, *sb;
    const xq_t *xf, *xs;
    const float *x;
    const int32_t *rows;
    int64_t n, nparts;
    float thr;
    const uint8_t *rec;   /* record of neuron r at rec + r * rec_bytes */
    int64_t rec_bytes;
    float *part;          /* nparts x cols */
    int64_t *kept;        /* per partition */
    /* gate and up as one weight of "virtual rows" one piece apart (row r's gate is virtual
     * row r * pair_step, its up the next), so that a dot reads each record's gate and up as
     * one stream; pair_step 0 where the pieces are not evenly spaced.  Each row's dot is the
     * same computation either way (bit-identical).  Taken only when no threshold rejects rows
     * (`sparse_ffn`, which keeps every row), where one stream per record is a little faster.
     * With a threshold the up rows of rejected candidates would be computed for nothing (the
     * decode step rejects part of its candidates). */
    qmat_t pair;
    int32_t pair_step;
} rec_ctx;

/* Start the reads of the next records (levels with rec_prefetch_whole: whole records a block
 * ahead).  The AVX2 kernels do better with whole records than with first lines only.  The
 * AVX-512 kernels prefetch nothing here: whole records filled the miss buffers and stalled the
 * computation behind them; touching each record's first line a block ahead helped while the
 * dot tiles read 4 rows at a time, but with 8-row tiles (their own prefetch one tile ahead)
 * and blocks of 128 the touches only stalled on full fill buffers, and the pass is faster
 * without them. */
static void rec_prefetch(const rec_ctx *a, const int32_t *rows, int64_t n) {
    if (!a->k->rec_prefetch_whole) return;
    for (int64_t j = 0; j < n; j++) {
        const char *p = (const char *)(a->rec + (int64_t)rows[j] * a->rec_bytes);
        for (int64_t o = 0; o < a->rec_bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
    }
}

/* y part += sum of h_i * down_t[kr_i] over the collected rows */
static void rec_flush(const rec_ctx *a, const float *h, const int32_t *kr, int64_t q, float *tmp, float *yp) {
    const int64_t cols = a->down_t->cols;
    for (int64_t c0 = 0; c0 < cols; c0 += AXPY_MAX_COLS) {
        const int64_t c1 = c0 + AXPY_MAX_COLS < cols ? c0 + AXPY_MAX_COLS : cols;
        a->k->axpy(a->down_t, h, kr, q, c0, c1, tmp);
    }
    for (int64_t i = 0; i < cols; i++) yp[i] += tmp[i];
}

static void rec_task(void *p, int64_t c) {
    const rec_ctx *a = p;
    const int64_t j0 = part_start(a->n, a->nparts, c), j1 = part_start(a->n, a->nparts, c + 1);
    const int64_t cols = a->down_t->cols;
    float *yp = a->part + c * cols;
    float *tmp = scratch(7, (size_t)(cols + 64) * sizeof(float));
    if (!tmp) abort();
    memset(yp, 0, (size_t)cols * sizeof(float));
    /* the kept rows' h and ids since the last flush: their down_t rows are summed REC_FLUSH
     * at a time (still in cache from the record prefetch; one partial-sum pass per flush) */
    float g[REC_BLOCK], u[REC_BLOCK], h[REC_FLUSH], gu[2 * REC_BLOCK];
    int32_t kr[REC_FLUSH], vr[2 * REC_BLOCK];
    int64_t kept = 0, q = 0;
    const int64_t blk = a->k->rec_prefetch_whole ? REC_BLOCK_WHOLE : REC_BLOCK;
    const int paired = a->pair_step != 0; /* gate and up rows of a block in one dot */
    rec_prefetch(a, a->rows + j0, j1 - j0 < REC_AHEAD * blk ? j1 - j0 : REC_AHEAD * blk);
    for (int64_t jb = j0; jb < j1; jb += blk) {
        const int64_t nb = j1 - jb < blk ? j1 - jb : blk;
        const int32_t *rows = a->rows + jb;
        const int64_t pf = jb + REC_AHEAD * blk;
        if (pf < j1) rec_prefetch(a, a->rows + pf, j1 - pf < blk ? j1 - pf : blk);
        if (paired) {
            for (int64_t i = 0; i < nb; i++) {
                vr[2 * i] = rows[i] * a->pair_step;
                vr[2 * i + 1] = rows[i] * a->pair_step + 1;
            }
            ffn_dot(a->k, &a->pair, a->xf, a->x, vr, 0, 2 * nb, gu);
            for (int64_t i = 0; i < nb; i++) g[i] = gu[2 * i];
        } else {
            ffn_dot(a->k, a->first, a->xf, a->x, rows, 0, nb, g);
        }
        if (a->fb)
            for (int64_t i = 0; i < nb; i++) g[i] += a->fb[rows[i]];
        a->k->act(a->act, g, nb);
        float *hb = h + q;
        int32_t *kb = kr + q;
        int64_t m = 0;
        for (int64_t i = 0; i < nb; i++) {
            kb[m] = rows[i];
            hb[m] = g[i];
            m += fabsf(g[i]) > a->thr;
        }
        kept += m;
        if (a->second && m) {
            if (paired) {
                int64_t mu = 0;
                for (int64_t i = 0; i < nb; i++) {
                    u[mu] = gu[2 * i + 1];
                    mu += fabsf(g[i]) > a->thr;
                }
            } else {
                ffn_dot(a->k, a->second, a->xs, a->x, kb, 0, m, u);
            }
            for (int64_t i = 0; i < m; i++) {
                float v = a->sb ? u[i] + a->sb[kb[i]] : u[i];
                if (a->relu_up && !(v > 0.0f)) v = 0.0f;
                hb[i] *= v;
            }
        }
        for (int64_t i = 0; i < m; i++) { /* rows with h == 0 add nothing */
            kr[q] = kb[i];
            h[q] = hb[i];
            q += hb[i] != 0.0f;
        }
        if (q > REC_FLUSH - blk || q * a->rec_bytes > REC_FLUSH_BYTES) {
            rec_flush(a, h, kr, q, tmp, yp);
            q = 0;
        }
    }
    if (q) rec_flush(a, h, kr, q, tmp, yp);
    a->kept[c] = kept;
}

/* The record layout of (first, second, down_t), or NULL: one row stride for all three, 2x the
 * scales' (in bytes), and every row's pieces within one stride of the lowest pointer. */
const uint8_t *si_record_base(const qmat_t *first, const qmat_t *second, const qmat_t *down_t) {
    const qmat_t *ws[3] = {first, second, down_t};
    const uint8_t *lo = NULL, *hi = NULL;
    const int64_t rb = first->row_bytes;
    for (int i = 0; i < 3; i++) {
        const qmat_t *w = ws[i];
        if (!w) continue;
        if ((w->fmt != FMT_Q8 && w->fmt != FMT_Q4) || w->row_bytes != rb || 2 * w->ds != rb) return NULL;
        const uint8_t *ps[3] = {w->qs, (const uint8_t *)w->d, (const uint8_t *)w->m};
        const int64_t len[3] = {w->fmt == FMT_Q4 ? w->kp / 2 : w->kp, 2 * w->nd, 2 * w->nd};
        for (int t = 0; t < 3; t++) {
            if (!ps[t]) continue;
            if (!lo || ps[t] < lo) lo = ps[t];
            if (!hi || ps[t] + len[t] > hi) hi = ps[t] + len[t];
        }
    }
    return hi - lo <= rb ? lo : NULL;
}

int64_t si_sparse_records(const uint8_t *rec, int act, int relu_up, const qmat_t *first, const float *fb,
                          const qmat_t *second, const float *sb, const qmat_t *down_t, const float *x,
                          const int32_t *rows, int64_t n, float thr, float *y) {
    const kernels_t *k = si_kern();
    const int64_t cols = down_t->cols;
    xq_t xf, xs;
    if (si_xq_alloc(&xf, 0, layout_of(first->fmt), first->kp, 1) != 0) abort();
    si_quant_tokens(k, x, first->cols, first->kp, 0, 1, &xf);
    const xq_t *pxs = &xf;
    if (second && layout_of(second->fmt) != layout_of(first->fmt)) {
        if (si_xq_alloc(&xs, 1, layout_of(second->fmt), second->kp, 1) != 0) abort();
        si_quant_tokens(k, x, second->cols, second->kp, 0, 1, &xs);
        pxs = &xs;
    }
    int64_t nparts = n / REC_ROWS_PER_PART;
    if (nparts < 1) nparts = 1;
    if (nparts > REC_MAX_PARTS) nparts = REC_MAX_PARTS;
    float *part = scratch(4, (size_t)(nparts * cols) * sizeof(float) + 64);
    if (!part) abort();
    int64_t kept[REC_MAX_PARTS];
    rec_ctx a = {k, act, relu_up, first, second, down_t, fb, sb, &xf, pxs, x, rows, n, nparts, thr,
                 rec, first->row_bytes, part, kept};
    a.pair_step = 0; /* pairs only when every candidate is kept (thr < 0), see rec_ctx.pair */
    if (thr < 0.0f && second && second->fmt == first->fmt && second->cols == first->cols && pxs == &xf) {
        const int64_t P = second->qs - first->qs;
        if (P > 0 && P % 2 == 0 && first->row_bytes % P == 0 && (const uint8_t *)second->d - (const uint8_t *)first->d == P &&
            (!first->m || (const uint8_t *)second->m - (const uint8_t *)first->m == P)) {
            a.pair = *first;
            a.pair.row_bytes = P;
            a.pair.ds = P / 2;
            a.pair_step = (int32_t)(first->row_bytes / P);
            a.pair.rows = first->rows * a.pair_step;
        }
    }
    run(rec_task, &a, nparts, n * first->row_bytes);
    memcpy(y, part, (size_t)cols * sizeof(float));
    int64_t total = kept[0];
    for (int64_t q = 1; q < nparts; q++) {
        const float *src = part + q * cols;
        for (int64_t i = 0; i < cols; i++) y[i] += src[i];
        total += kept[q];
    }
    return total;
}

/* ------------------------------------------------------------ candidate selection */

/* One pass instead of a compare, a count, a scatter of the extra ids and a nonzero over the
 * whole vector (the output head's candidates, sparseinfer/sparse/head.py): the extra ids are
 * marked in a bitmap, then each run of 64 values gives a word of bits (value >= thr, or marked)
 * whose set bits are the ids, in order. */
int64_t si_select_ids(const float *p, int64_t n, float thr, const int64_t *extra, int64_t n_extra, int32_t *out,
                      int64_t *n_thr) {
    const int64_t nw = (n + 63) / 64;
    uint64_t *mark = scratch(3, (size_t)nw * sizeof(uint64_t));
    if (!mark) abort();
    memset(mark, 0, (size_t)nw * sizeof(uint64_t));
    for (int64_t i = 0; i < n_extra; i++)
        if (extra[i] >= 0 && extra[i] < n) mark[extra[i] >> 6] |= (uint64_t)1 << (extra[i] & 63);
    int64_t k = 0, above = 0;
    for (int64_t w = 0; w < nw; w++) {
        const int64_t base = 64 * w, m = n - base < 64 ? n - base : 64;
        const float *pw = p + base;
        uint64_t bits = 0;
        int64_t j = 0;
#if defined(__SSE2__)
        /* 4 compares per instruction (SSE2 is part of x86-64; the scalar loop does not vectorize) */
        const __m128 vt = _mm_set1_ps(thr);
        for (; j + 4 <= m; j += 4) bits |= (uint64_t)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(pw + j), vt)) << j;
#endif
        for (; j < m; j++) bits |= (uint64_t)(pw[j] >= thr) << j;
        above += __builtin_popcountll(bits);
        bits |= mark[w];
        while (bits) {
            out[k++] = (int32_t)(base + __builtin_ctzll(bits));
            bits &= bits - 1;
        }
    }
    *n_thr = above;
    return k;
}
