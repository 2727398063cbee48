/* Dense products: the tiled dot-product engine (si_dots: quantize the activations, split
 * by output rows, and for many tokens pack them for the tile kernels), si_gemv and si_matmul
 * over every row of a weight, and si_dequantize_rows, which prefill uses to multiply many
 * tokens by a weight in float32.  The row-list products built on si_dots are in sparse.c. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------- dot-product ops */

typedef struct {
    const kernels_t *k;
    const qmat_t *w;
    const int32_t *rows;
    int64_t n, chunk, T, tchunk;
    const xq_t *xq;
    const float *x;
    int64_t xstride;
    yout_t out;
} dot_ctx;

static void dot_task(void *p, int64_t c) {
    const dot_ctx *a = p;
    int64_t i0 = c * a->chunk, i1 = i0 + a->chunk < a->n ? i0 + a->chunk : a->n;
    /* in pair mode T and tchunk count virtual tokens (both even) */
    const int P = a->xq && a->xq->pair;
    for (int64_t t0 = 0; t0 < a->T; t0 += a->tchunk) {
        int64_t tn = a->T - t0 < a->tchunk ? a->T - t0 : a->tchunk;
        yout_t o = {a->out.y + (t0 >> P) * a->out.yst, a->out.ysr, a->out.yst};
        if (a->xq) {
            xq_t s = *a->xq;
            s.q += t0 * s.q_stride;
            s.d += t0 * s.d_stride;
            s.s += t0 * s.d_stride;
            s.de += t0 * s.de_stride;
            a->k->dot_q(a->w, a->rows, i0, i1, &s, tn, &o);
        } else {
            a->k->dot_f(a->w, a->rows, i0, i1, a->x + t0 * a->xstride, a->xstride, tn, &o);
        }
    }
}

typedef struct {
    const kernels_t *k;
    const float *x;
    int64_t K, kp, T, chunk;
    const xq_t *xq;
} quant_ctx;

static void quant_task(void *p, int64_t c) {
    const quant_ctx *a = p;
    int64_t t0 = c * a->chunk, t1 = t0 + a->chunk < a->T ? t0 + a->chunk : a->T;
    si_quant_tokens(a->k, a->x, a->K, a->kp, t0, t1, a->xq);
}

typedef struct {
    const kernels_t *k;
    const xq_t *xq;
    int64_t nb;
} pack_ctx;

static void pack_task(void *p, int64_t g) {
    const pack_ctx *a = p;
    a->k->pack_tokens(a->xq, a->nb, g, g + 1);
}

/* y[i*ysr + t*yst] = W[rows[i]] . x_t for i < n, t < T. */
void si_dots(const qmat_t *w, const int32_t *rows, int64_t n, const float *x, int64_t T,
             yout_t out, int xslot) {
    const kernels_t *k = si_kern();
    dot_ctx a = {k, w, rows, n, 0, T, T, NULL, x, w->cols, out};
    xq_t xq;
    if (w->fmt >= FMT_Q8) {
        if (si_xq_alloc(&xq, xslot, layout_of(w->fmt), w->kp, T) != 0) abort();
        if (T == 1) {
            si_quant_tokens(k, x, w->cols, w->kp, 0, 1, &xq);
        } else {
            quant_ctx q = {k, x, w->cols, w->kp, T, 8, &xq};
            run(quant_task, &q, (T + 7) / 8, T * w->cols * 64);
        }
        a.xq = &xq;
        a.T = T << xq.pair;
        /* a token chunk's quantized activations (codes, expanded and block scales) within a
         * quarter of L2, the rest of it for the rows they pass over (counting the codes alone
         * overfilled a 512 KB L2) */
        a.tchunk = up(si_l2_bytes() / 4 / (xq.q_stride + 4 * (xq.de_stride + 2 * xq.d_stride)), 4);
        if (si_fmt_tiled(w->fmt)) { /* whole-matrix products only (callers check: no rows) */
            if (rows || out.ysr != 1) abort();
            si_tiles_dots(w, &xq, T, a.tchunk >> xq.pair, out.y, out.yst);
            return;
        }
        if (k->pack_tokens && T >= 16 && !xq.pair && w->fmt != FMT_Q4K) {
            /* the tile kernels take every token at once (they block over K themselves) */
            const int64_t nb = w->kp / 32;
            xq.tiles = scratch(8 + xslot, (size_t)(T / 16) * k->tiles_bytes(nb) + 64);
            if (!xq.tiles) abort();
            pack_ctx pc = {k, &xq, nb};
            run(pack_task, &pc, T / 16, T * w->cols * 64);
            a.tchunk = T;
        }
    } else {
        a.tchunk = up(262144 / (4 * w->cols), 4);
    }
    if (a.tchunk < 4) a.tchunk = 4;
    if (T <= FEW_TOKENS) {
        /* each tile passes all the tokens over its rows at once: split as for one token */
        a.chunk = row_chunk(n, w->row_bytes);
    } else {
        /* matmul: row chunks small enough to stay in L2 while all tokens pass over them */
        int64_t c = (n + 4 * nthreads() - 1) / (4 * nthreads());
        int64_t maxr = 262144 / (w->row_bytes ? w->row_bytes : 1);
        if (c > maxr) c = maxr;
        const int64_t align = k->matmul_row_align > 4 ? k->matmul_row_align : 4;
        a.chunk = up(c < align ? align : c, align);
    }
    int64_t nchunks = (n + a.chunk - 1) / a.chunk;
    run(dot_task, &a, nchunks, n * w->row_bytes * (T > FEW_TOKENS ? 64 : T));
}

void si_gemv(const qmat_t *w, const float *x, float *y) {
    yout_t o = {y, 1, 0};
    si_dots(w, NULL, w->rows, x, 1, o, 0);
}

void si_matmul_ld(const qmat_t *w, const float *X, int64_t M, float *Y, int64_t ldy) {
    yout_t o = {Y, 1, ldy};
    si_dots(w, NULL, w->rows, X, M, o, 0);
}

void si_matmul(const qmat_t *w, const float *X, int64_t M, float *Y) { si_matmul_ld(w, X, M, Y, w->rows); }

/* ------------------------------------------------------------------ dequantize rows
 * out[(r - r0) * cols + j] = W[r][j] in float32 for r in [r0, r1), exactly the reference's
 * value (d*q + m, one rounding per operation).  Prefill multiplies many tokens by each
 * weight: there, an f32 matrix product on a dequantized slice of rows beats the integer
 * kernels (their activations are re-quantized per block of 32), and dequantizing costs little
 * next to the product. */
typedef struct {
    const qmat_t *w;
    int64_t r0, r1, chunk;
    float *out;
} deq_ctx;

static void deq_row(const qmat_t *w, int64_t r, float *o) {
    const int64_t cols = w->cols;
    const uint8_t *q = w->qs + r * w->row_bytes;
    if (w->fmt == FMT_F32) {
        memcpy(o, q, (size_t)cols * sizeof(float));
        return;
    }
    if (w->fmt == FMT_F16 || w->fmt == FMT_BF16) {
        const uint16_t *h = (const uint16_t *)q;
        if (w->fmt == FMT_F16)
            for (int64_t j = 0; j < cols; j++) o[j] = si_h2f(h[j]);
        else
            for (int64_t j = 0; j < cols; j++) o[j] = si_bf2f(h[j]);
        return;
    }
    if (si_fmt_tiled(w->fmt)) {
        si_tile_row(w, r, o);
        return;
    }
    if (w->fmt == FMT_Q4K) { /* value = d*sc*q - dmin*mn per sub-block of 32 (common.h) */
        for (int64_t sb = 0; sb < cols / 256; sb++) {
            const uint8_t *blk = q + sb * SI_Q4K_BYTES;
            uint16_t hd, hm;
            memcpy(&hd, blk, 2);
            memcpy(&hm, blk + 2, 2);
            for (int i = 0; i < 8; i++) {
                int sc, mn;
                si_q4k_sub(blk + 4, i, &sc, &mn);
                const float d = si_h2f(hd) * (float)sc, m = si_h2f(hm) * (float)mn;
                const uint8_t *nib = blk + 16 + 32 * (i / 2);
                for (int j = 0; j < 32; j++) o[256 * sb + 32 * i + j] = d * (float)((i & 1) ? nib[j] >> 4 : nib[j] & 15) - m;
            }
        }
        return;
    }
    const uint16_t *dr = w->d + r * w->ds, *mr = w->m ? w->m + r * w->ds : NULL;
    float blk[32];
    if (w->fmt == FMT_Q6) { /* a scale per 16 values; codes by si_q6_code (layout: quant.py) */
        /* full groups of 4 blocks: byte p of the 64 nibble bytes holds value p % 16 of block
         * p / 16 (low nibble) and value 16 + p % 16 (high nibble); their 2-bit high parts are
         * fields p / 32 and 2 + p / 32 of high byte p % 32.  The same values as si_q6_code's,
         * in a loop the compiler can vectorize. */
        const int64_t ng = w->nb / 4;
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *gp = q + 96 * g;
            float dl[4], dh[4], t[128];
            for (int b = 0; b < 4; b++) dl[b] = si_h2f(dr[8 * g + 2 * b]), dh[b] = si_h2f(dr[8 * g + 2 * b + 1]);
            for (int p = 0; p < 64; p++) {
                const int b = p >> 4, j = p & 15, h = gp[64 + (p & 31)], sh = 2 * (p >> 5);
                t[32 * b + j] = (float)(((gp[p] & 15) | (((h >> sh) & 3) << 4)) - 32) * dl[b];
                t[32 * b + 16 + j] = (float)(((gp[p] >> 4) | (((h >> (sh + 4)) & 3) << 4)) - 32) * dh[b];
            }
            const int64_t n = cols - 128 * g < 128 ? cols - 128 * g : 128;
            memcpy(o + 128 * g, t, (size_t)n * sizeof(float));
        }
        for (int64_t b = 4 * ng; b < w->nb; b++) {
            const float d0 = si_h2f(dr[2 * b]), d1 = si_h2f(dr[2 * b + 1]);
            for (int j = 0; j < 32; j++) blk[j] = (float)(si_q6_code(q, w->nb, b, j) - 32) * (j < 16 ? d0 : d1);
            int64_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
            memcpy(o + b * 32, blk, (size_t)n * sizeof(float));
        }
        return;
    }
    for (int64_t b = 0; b < w->nb; b++) {
        const float d = si_h2f(dr[b]), m = mr ? si_h2f(mr[b]) : 0.0f;
        if (w->fmt == FMT_Q8) {
            const int8_t *qb = (const int8_t *)q + b * 32;
            for (int j = 0; j < 32; j++) blk[j] = (float)qb[j] * d;
        } else {
            const uint8_t *qb = q + b * 16;
            for (int j = 0; j < 16; j++) {
                blk[j] = (float)(qb[j] & 15) * d;
                blk[j + 16] = (float)(qb[j] >> 4) * d;
            }
        }
        if (mr)
            for (int j = 0; j < 32; j++) blk[j] += m;
        int64_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
        memcpy(o + b * 32, blk, (size_t)n * sizeof(float));
    }
}

static void deq_task(void *p, int64_t c) {
    deq_ctx *a = p;
    int64_t ra = a->r0 + c * a->chunk, rb = ra + a->chunk < a->r1 ? ra + a->chunk : a->r1;
    for (int64_t r = ra; r < rb; r++) deq_row(a->w, r, a->out + (r - a->r0) * a->w->cols);
}

void si_dequantize_rows(const qmat_t *w, int64_t r0, int64_t r1, float *out) {
    deq_ctx a = {w, r0, r1, 16, out};
    int64_t n = r1 - r0;
    if (n <= 0) return;
    run(deq_task, &a, (n + a.chunk - 1) / a.chunk, n * w->row_bytes);
}
