/* Input-sparse products on column-grouped weights: y = W (x masked to |x_j| > thr), reading
 * only the columns of the kept inputs.
 *
 * Why a second layout: the row-major formats (common.h) quantize along a row's inputs, so an
 * input channel's weights are spread over every row in pieces of half a byte; skipping an
 * input saves no bytes.  Here the weights of one input channel (a column of W) are
 * contiguous, so a token whose input j is small skips column j's bytes.
 *
 * Layout (cmat_t, sparseinfer/quant.py `to_cols` is the authority):
 *   W has N rows (outputs) and K columns (inputs); Np = N rounded up to 64, G = ceil(K/32)
 *   groups of 32 input channels.  cq4 holds exactly the values of our row-major q4:
 *   value(r, j) = d[g][r] * q + m[g][r], q in 0..15, g = j / 32, with d, m f16 (G x Np).
 *   qs is G x 32 columns x Np/2 bytes: column j at qs + j * Np/2.  A column's rows go in
 *   blocks of 128 (64 bytes), the last block of 64 rows (32 bytes) when Np is not a multiple
 *   of 128.  In a block of R rows (L = R/32 lanes of 16 bytes), byte 16*l + 4*k + i holds row
 *   4L*k + 4l + i in its low nibble and row R/2 + 4L*k + 4l + i in its high nibble
 *   (l < L, k < 4, i < 4): the order in which four columns' bytes, interleaved by two
 *   unpack steps, line up as dwords of consecutive rows for a 4-way byte dot product.
 *   Padding rows hold q = 0 with d = m = 0; padding columns hold q = 0 and are never read.
 *
 * The kept inputs of each group are quantized to int8 (d_x = max|x|/127 over the kept ones,
 * q_x = round(x / d_x)), so a group contributes
 *   y[r] += d_x * d[g][r] * sum_j q_x[j] q[r][j]  +  m[g][r] * d_x * sum_j q_x[j]
 * with the integer sums exact.  The groups are cut into partitions whose count depends on G
 * only; each partition sums its groups in order into its own vector and the vectors are added
 * in partition order, so the result does not depend on the thread count. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* the byte of row rho in a column block of R rows, the high nibble when *hi */
static int64_t cols_byte(int64_t rho, int64_t R, int *hi) {
    const int64_t h = R / 2, L = R / 32, p = rho % h, k = p / (4 * L), rem = p % (4 * L);
    *hi = rho >= h;
    return (rem / 4) * 16 + 4 * k + rem % 4;
}

/* One group's kept columns, four at a time (any level; see kernels_t.cols_group): the sums of a
 * block of rows in a small array, then scaled into y. */
static void cols_group_portable(const uint8_t *const *p, const uint32_t *xw, int nq, int64_t Np, const uint16_t *d,
                                const uint16_t *m, float dx, float sx, float *y) {
    for (int64_t b0 = 0; b0 < Np; b0 += 128) {
        const int64_t R = Np - b0 >= 128 ? 128 : 64;
        int32_t acc[128] = {0};
        for (int j = 0; j < 4 * nq; j++) {
            const uint8_t *col = p[j] + b0 / 2;
            const int32_t x = (int8_t)(uint8_t)(xw[j / 4] >> (8 * (j % 4)));
            for (int64_t rho = 0; rho < R; rho++) {
                int hi;
                const uint8_t v = col[cols_byte(rho, R, &hi)];
                acc[rho] += x * (hi ? v >> 4 : v & 15);
            }
        }
        for (int64_t r = 0; r < R; r++)
            y[b0 + r] += dx * si_h2f(d[b0 + r]) * (float)acc[r] + si_h2f(m[b0 + r]) * sx;
    }
}

#define COLS_MAX_PARTS 8

typedef struct {
    const kernels_t *k;
    const cmat_t *w;
    const float *x;       /* all inputs (threshold form), or the kept inputs' values (list form) */
    int list;             /* 1: list form (idx, n), 0: threshold form (thr) */
    const int32_t *idx;   /* list form: the kept inputs, ascending */
    int64_t n;            /* list form: how many */
    float thr;
    int64_t G, nparts;
    float *part;     /* nparts x Np partial sums */
    int64_t *kept;   /* per partition: inputs kept */
    float *y;
} cols_ctx;

/* One group's kept inputs as the kernels take them: the kept columns' addresses p and their
 * int8 values (d_x = max|x|/127, q = round(x / d_x)) packed four to a word xw, in quads (a last
 * incomplete quad repeats a column with value 0); nq quads; dx and sx = dx * sum(q). */
typedef struct {
    const uint8_t *p[32];
    uint32_t xw[8];
    int nq, na;
    float dx, sx;
} group_in;

static void group_inputs(const cols_ctx *a, int64_t g, int64_t *pos, group_in *gi) {
    int32_t cs[32];
    float xs[32], amax = 0.0f;
    int na = 0;
    if (a->list) {
        for (; *pos < a->n && a->idx[*pos] < (g + 1) * 32; ++*pos) {
            const float v = a->x[*pos];
            cs[na] = a->idx[*pos] - (int32_t)(g * 32), xs[na++] = v;
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
    } else {
        const int64_t K = a->w->cols;
        for (int j = 0; j < 32 && g * 32 + j < K; j++) {
            const float v = a->x[g * 32 + j];
            if (fabsf(v) > a->thr) {
                cs[na] = j, xs[na++] = v;
                amax = fabsf(v) > amax ? fabsf(v) : amax;
            }
        }
    }
    gi->na = gi->nq = 0;
    if (!na || amax == 0.0f) /* nothing kept, or only zeros: nothing to add */
        return;
    const uint8_t *gp = a->w->qs + g * 32 * (a->w->np / 2);
    const float id = 127.0f / amax;
    int32_t sq = 0;
    gi->na = na, gi->nq = (na + 3) / 4;
    for (int j = 0; j < 4 * gi->nq; j++) {
        int32_t q = 0;
        if (j < na) {
            q = (int32_t)lrintf(xs[j] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            sq += q;
        }
        if (j % 4 == 0) gi->xw[j / 4] = 0;
        gi->xw[j / 4] |= (uint32_t)(uint8_t)(int8_t)q << (8 * (j % 4));
        gi->p[j] = gp + (int64_t)cs[j < na ? j : j - j % 4] * (a->w->np / 2);
    }
    gi->dx = amax / 127.0f;
    gi->sx = gi->dx * (float)sq;
}

static void cols_task(void *p, int64_t c) {
    const cols_ctx *a = p;
    const cmat_t *w = a->w;
    const int64_t Np = w->np;
    const int64_t g0 = a->G * c / a->nparts, g1 = a->G * (c + 1) / a->nparts;
    float *y = a->part + c * Np;
    memset(y, 0, (size_t)Np * sizeof(float));
    int64_t kept = 0, pos = 0;
    if (a->list) { /* the first kept input of group g0 */
        int64_t lo = 0, hi = a->n;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (a->idx[mid] < g0 * 32) lo = mid + 1;
            else hi = mid;
        }
        pos = lo;
    }
    /* the next group's inputs are chosen before this group runs, and the starts of its kept
     * columns prefetched: short columns (a few hundred bytes) would otherwise begin with misses */
    group_in in[2];
    if (g0 < g1) group_inputs(a, g0, &pos, &in[0]);
    for (int64_t g = g0; g < g1; g++) {
        group_in *cur = &in[(g - g0) & 1], *next = &in[(g - g0 + 1) & 1];
        if (g + 1 < g1) {
            group_inputs(a, g + 1, &pos, next);
            for (int j = 0; j < next->na; j++) {
                __builtin_prefetch(next->p[j]);
                __builtin_prefetch(next->p[j] + 64);
            }
        }
        if (!cur->na) continue;
        kept += cur->na;
        const uint16_t *d = w->d + g * Np, *m = w->m + g * Np;
        (a->k->cols_group ? a->k->cols_group : cols_group_portable)(cur->p, cur->xw, cur->nq, Np, d, m, cur->dx,
                                                                    cur->sx, y);
    }
    a->kept[c] = kept;
}

static void cols_reduce_task(void *p, int64_t c) {
    const cols_ctx *a = p;
    const int64_t N = a->w->rows, Np = a->w->np, chunk = up((N + nthreads() - 1) / nthreads(), 16);
    const int64_t r0 = c * chunk, r1 = r0 + chunk < N ? r0 + chunk : N;
    for (int64_t r = r0; r < r1; r++) {
        float s = a->part[r];
        for (int64_t q = 1; q < a->nparts; q++) s += a->part[q * Np + r];
        a->y[r] = s;
    }
}

static int64_t gemv_cols(cols_ctx *a) {
    const cmat_t *w = a->w;
    const int64_t G = (w->cols + 31) / 32, Np = w->np;
    int64_t nparts = G < COLS_MAX_PARTS ? G : COLS_MAX_PARTS;
    float *part = scratch(4, (size_t)(nparts * Np) * sizeof(float) + (size_t)nparts * 8 + 64);
    if (!part) abort();
    a->k = si_kern();
    a->G = G, a->nparts = nparts, a->part = part, a->kept = (int64_t *)(part + nparts * Np);
    run(cols_task, a, nparts, G * 32 * (Np / 2));
    const int64_t chunk = up((w->rows + nthreads() - 1) / nthreads(), 16);
    run(cols_reduce_task, a, (w->rows + chunk - 1) / chunk, nparts * Np * 4);
    int64_t total = 0;
    for (int64_t q = 0; q < nparts; q++) total += a->kept[q];
    return total;
}

int64_t si_gemv_cols(const cmat_t *w, const float *x, float thr, float *y) {
    cols_ctx a = {NULL, w, x, 0, NULL, 0, thr, 0, 0, NULL, NULL, y};
    return gemv_cols(&a);
}

void si_gemv_cols_list(const cmat_t *w, const float *h, const int32_t *idx, int64_t n, float *y) {
    cols_ctx a = {NULL, w, h, 1, idx, n, 0.0f, 0, 0, NULL, NULL, y};
    gemv_cols(&a);
}

int si_cmat_init(cmat_t *w, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m) {
    if (rows < 1 || cols < 1 || !qs || !d || !m) return -1;
    w->rows = rows;
    w->cols = cols;
    w->np = (rows + 63) / 64 * 64;
    w->qs = qs;
    w->d = d;
    w->m = m;
    return 0;
}
