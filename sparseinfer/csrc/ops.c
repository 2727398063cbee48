/* Operations: activation quantization, work splitting and kernel selection.
 *
 * Determinism: every output element is produced by exactly one kernel call whose sequence of
 * floating-point operations does not depend on the split (gemv/matmul/gemv_rows/sparse_ffn
 * phase 1 split by output rows, axpy and sparse_ffn phase 2 split by output columns), so
 * results are bit-identical across runs and thread counts. */
#define _GNU_SOURCE
#include "ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool.h"

/* ------------------------------------------------------------------ kernel selection */

const char *const si_level_names[] = {
#if SI_X86
    "avx512amx", "avx512vnni", "avx512", "avx2",
#endif
    "scalar", NULL};

static const kernels_t *table_of(const char *name) {
#if SI_X86
    if (!strcmp(name, "avx512amx")) return &si_kernels_avx512amx;
    if (!strcmp(name, "avx512vnni")) return &si_kernels_avx512vnni;
    if (!strcmp(name, "avx512")) return &si_kernels_avx512;
    if (!strcmp(name, "avx2")) return &si_kernels_avx2;
#endif
    if (!strcmp(name, "scalar")) return &si_kernels_scalar;
    return NULL;
}

int si_level_supported(const char *name) {
#if SI_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (!strcmp(name, "avx512amx")) return avx512 && __builtin_cpu_supports("avx512vnni") && si_amx_supported();
    if (!strcmp(name, "avx512vnni")) return avx512 && __builtin_cpu_supports("avx512vnni");
    if (!strcmp(name, "avx512")) return avx512;
    if (!strcmp(name, "avx2")) return avx2;
#endif
    return !strcmp(name, "scalar");
}

static const kernels_t *KERN;

static const kernels_t *kern(void) {
    if (!KERN) {
        const char *env = getenv("SPARSEINFER_SIMD");
        if (env && table_of(env) && si_level_supported(env)) {
            KERN = table_of(env);
        } else {
            for (int i = 0; si_level_names[i]; i++)
                if (si_level_supported(si_level_names[i])) {
                    KERN = table_of(si_level_names[i]);
                    break;
                }
        }
    }
    return KERN;
}

const char *si_level(void) { return kern()->name; }

int si_select(const char *name) {
    const kernels_t *k = table_of(name);
    if (!k) return -1;
    if (!si_level_supported(name)) return -2;
    KERN = k;
    return 0;
}

int si_qmat_init(qmat_t *w, int fmt, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m,
                 int64_t qs_stride, int64_t d_stride) {
    if (fmt < 0 || fmt >= FMT_COUNT || rows < 0 || cols <= 0 || (!qs && rows > 0)) return -1;
    w->fmt = fmt;
    w->rows = rows;
    w->cols = cols;
    w->kp = (cols + 31) / 32 * 32;
    w->nb = w->kp / 32;
    w->qs = (const uint8_t *)qs;
    w->d = (const uint16_t *)d;
    w->m = (const uint16_t *)m;
    switch (fmt) {
    case FMT_F32: w->row_bytes = 4 * cols; break;
    case FMT_F16: case FMT_BF16: w->row_bytes = 2 * cols; break;
    case FMT_Q8: w->row_bytes = w->kp; break;
    case FMT_Q6: w->row_bytes = w->kp / 4 * 3; break;
    default: w->row_bytes = w->kp / 2; break;
    }
    w->nd = fmt == FMT_Q6 ? 2 * w->nb : w->nb;
    w->ds = w->nd;
    /* strides: 0 = natural; never below the natural widths */
    if (qs_stride) {
        if (qs_stride < w->row_bytes) return -1;
        w->row_bytes = qs_stride;
    }
    if (d_stride) {
        if (d_stride < w->nd) return -1;
        w->ds = d_stride;
    }
    if (fmt >= FMT_Q8 && !d && rows > 0) return -1;
    if (fmt == FMT_Q4 && !m && rows > 0) return -1;
    if (fmt < FMT_Q8) w->d = w->m = NULL;
    if (fmt == FMT_Q6) w->m = NULL;
    return 0;
}

/* -------------------------------------------------------------------- scratch memory */

/* Grow-only per-thread buffers (the calling thread's; workers only read/write them during
 * the call).  Slots: 0,1 = quantized activations, 2 = ffn temporaries, 3 = compaction,
 * 4 = axpy partial sums, 5 = attention scores, 6 = fused decode steps (decode.c),
 * 7 = a worker's temporaries in the neuron-record FFN pass, 8,9 = activations of slot 0,1
 * packed for AMX tiles, 10 = axpy rows in tile order. */
static _Thread_local struct { void *p; size_t n; } TLS[11];

void *si_scratch(int slot, size_t n) {
    if (TLS[slot].n < n) {
        free(TLS[slot].p);
        n = (n + 4095) & ~(size_t)4095;
        if (posix_memalign(&TLS[slot].p, 64, n) != 0) {
            TLS[slot].p = NULL;
            TLS[slot].n = 0;
            return NULL;
        }
        TLS[slot].n = n;
    }
    return TLS[slot].p;
}

#define scratch si_scratch

static int64_t up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

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
static int xq_alloc(xq_t *xq, int slot, int layout, int64_t kp, int64_t T) {
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

static int layout_of(int fmt) { return fmt == FMT_Q4 || fmt == FMT_Q6 ? XL_Q4 : XL_NATURAL; }

/* Quantize tokens [t0, t1) of x into xq: one int8 term, or (xq->pair) the two terms
 * q_hi = the level's quantizer on x, q_lo = the same quantizer on the f32 residual
 * x - d_hi*q_hi; each term carries its own block sums d*sum(q), so the m term sees the same
 * x as the products. */
static void quant_tokens(const kernels_t *k, const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1,
                         const xq_t *xq) {
    if (!xq->pair) {
        k->quantize(x, K, kp, t0, t1, xq);
        return;
    }
    const int64_t nb = kp / 32;
    xq_t hi = *xq;
    hi.q_stride *= 2;
    hi.d_stride *= 2;
    hi.de_stride *= 2;
    k->quantize(x, K, kp, t0, t1, &hi);
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
        k->quantize(r, K, kp, 0, tb - ta, &lo);
    }
    free(heap);
}

/* ------------------------------------------------------------------------ splitting */

static int64_t nthreads(void) { return si_pool_get_threads(); }

/* Below this many weight bytes a call runs on the calling thread alone. */
#define SERIAL_BYTES (48 * 1024)

static void run(si_task_fn fn, void *ctx, int64_t nchunks, int64_t bytes) {
    if (nchunks <= 1 || bytes < SERIAL_BYTES || nthreads() == 1) {
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
    } else {
        si_pool_run(fn, ctx, nchunks);
    }
}

/* Rows per chunk of one-token products: a multiple of 8 (the one-token tiles take 8 rows),
 * about 4 chunks per thread (a thread descheduled by a busy machine holds up little work),
 * >= ~32 KB of weights.  Each chunk starts with a tile nothing prefetched (~1 us of misses
 * on scattered rows): against 8 chunks per thread and multiples of 4, alternated in one
 * process, 2 threads, q4 8960x1536 gemv_rows at active fraction 0.05 / 0.1 / 0.25 44.5 ->
 * 38.7 / 64.4 -> 63.9 / 128 -> 124 us, dense gemv 283 -> 281 us (1536x8960 296 -> 292). */
static int64_t row_chunk(int64_t n, int64_t row_bytes) {
    int64_t c = (n + 4 * nthreads() - 1) / (4 * nthreads());
    int64_t minr = (32768 + row_bytes - 1) / (row_bytes ? row_bytes : 1);
    if (c < minr) c = minr;
    return up(c < 8 ? 8 : c, 8);
}

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
    quant_tokens(a->k, a->x, a->K, a->kp, t0, t1, a->xq);
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
static void dots(const qmat_t *w, const int32_t *rows, int64_t n, const float *x, int64_t T,
                 yout_t out, int xslot) {
    const kernels_t *k = kern();
    dot_ctx a = {k, w, rows, n, 0, T, T, NULL, x, w->cols, out};
    xq_t xq;
    if (w->fmt >= FMT_Q8) {
        if (xq_alloc(&xq, xslot, layout_of(w->fmt), w->kp, T) != 0) abort();
        if (T == 1) {
            quant_tokens(k, x, w->cols, w->kp, 0, 1, &xq);
        } else {
            quant_ctx q = {k, x, w->cols, w->kp, T, 8, &xq};
            run(quant_task, &q, (T + 7) / 8, T * w->cols * 64);
        }
        a.xq = &xq;
        a.T = T << xq.pair;
        /* keep a token chunk of quantized activations within ~256 KB (L2) */
        a.tchunk = up(262144 / xq.q_stride, 4);
        if (k->pack_tokens && T >= 16 && !xq.pair) {
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
    if (T == 1) {
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
    run(dot_task, &a, nchunks, n * w->row_bytes * (T > 1 ? 64 : 1));
}

void si_act(int act, float *v, int64_t n) { kern()->act(act, v, n); }

void si_gemv(const qmat_t *w, const float *x, float *y) {
    yout_t o = {y, 1, 0};
    dots(w, NULL, w->rows, x, 1, o, 0);
}

void si_matmul(const qmat_t *w, const float *X, int64_t M, float *Y) {
    yout_t o = {Y, 1, w->rows};
    dots(w, NULL, w->rows, X, M, o, 0);
}

void si_gemv_rows(const qmat_t *w, const float *x, const int32_t *rows, int64_t n, float *y) {
    yout_t o = {y, 1, 0};
    dots(w, rows, n, x, 1, o, 0);
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
 * slower.  Alternated in one process, 2 threads, 8960x1536 down_t, axpy_rows at active
 * fraction 1 / 0.25 / 0.1 / 0.05: AVX-512 q4 480-490 -> 330-351 / 159-164 -> 142-147 /
 * 76-79 -> 74-76 / 46 -> 48 us, q8 743 -> 491 / 217 -> 204 / 99 -> 99 / 58 -> 58 us; AVX2
 * (same Xeon) q4 732 -> 672 / 275 -> 250 / 144 -> 138 us.  A permutation of the sums, fixed
 * by n: results stay independent of the thread count. */
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
    axpy_ctx a = {kern(), wt, hc, rc, n, 0, 1, y, NULL, (float *)order, (int32_t *)(order + 4 * n)};
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
    const kernels_t *k = kern();
    xq_t xu, xg;
    if (upm->fmt >= FMT_Q8) {
        if (xq_alloc(&xu, 0, layout_of(upm->fmt), upm->kp, 1) != 0) abort();
        quant_tokens(k, x, upm->cols, upm->kp, 0, 1, &xu);
    }
    const xq_t *pxg = &xu;
    if (gate && gate->fmt >= FMT_Q8 && (upm->fmt < FMT_Q8 || layout_of(gate->fmt) != layout_of(upm->fmt))) {
        if (xq_alloc(&xg, 1, layout_of(gate->fmt), gate->kp, 1) != 0) abort();
        quant_tokens(k, x, gate->cols, gate->kp, 0, 1, &xg);
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
    kern()->act(a->act, g, a->n);
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
 * its scales elsewhere) run at ~10 GB/s on 2 threads here, whole 3.5 KB records at ~19 (and
 * ~27 read 8 at a time, as the one-token tiles and the axpy read them), so the pass computes,
 * per block of neurons (see rec_prefetch for what it reads ahead):
 * first rows, activation, keep |a| > threshold, second rows of the kept, h, and their down_t
 * rows into a partial sum.  The candidate list is cut into partitions as a function of n only
 * (each summed in order by one thread, partials added in partition order), so results do not
 * depend on the thread count. */
/* History: blocks of 64 neurons, with one partial-sum pass per 256 kept (in practice once per
 * partition): 8 -> 64 and 64 -> 256 took the pass at active fraction 0.1 from 166-170 to
 * 140-155 us for 8960x1536 q4 and from 404-464 to 350-418 us for 11008x4096 (AVX-512 VNNI,
 * 2 threads, builds alternated in separate processes; the AVX2 kernels on the same machine
 * 252 -> 237 us and 722-755 -> 670-708 us). */
/* Blocks of 128 with the AVX-512 kernels, whose dot tiles and axpy read 8 rows at a time:
 * 64 -> 128 took the pass at 0.1 from 162 to 156 us (8960x1536 q4), 463 -> 455 us
 * (11008x4096) and 234 -> 228 us (q8), alternated in one process.  The AVX2 kernels prefetch
 * whole records a block ahead and keep 64 (two blocks of 128 records would overflow a 512 KB
 * L2). */
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
     * same computation either way (bit-identical).  Taken when no threshold rejects rows
     * (`sparse_ffn`, which keeps every row): 8960x1536 q4 at 0.1, alternated in one process,
     * 163 -> 158 and 163 -> 160 us, at 0.25 380 -> 370 us; 11008x4096 and q8 within noise.
     * With a threshold the up rows of rejected candidates would be computed for nothing (the
     * decode step keeps ~70% of them in Qwen2.5-1.5B with its pack). */
    qmat_t pair;
    int32_t pair_step;
} rec_ctx;

/* Start the reads of the next records (levels with rec_prefetch_whole: whole records a block
 * ahead).  The AVX2 kernels do better with whole records (1536-wide q4 FFN at active fraction
 * 0.1: 3.8-4.0x faster than dense vs 3.1-3.2x with first lines only).  The AVX-512 kernels
 * prefetch nothing here: whole records filled the miss buffers and stalled the computation
 * behind them; touching each record's first line a block ahead helped while the dot tiles
 * read 4 rows at a time, but with 8-row tiles (their own prefetch one tile ahead) and blocks
 * of 128 the touches only stalled on full fill buffers (~11% of the pass in `perf`), and
 * dropping them took the pass at 0.1 from 141 to 138 us (8960x1536 q4), 387 to 366 us
 * (11008x4096), q8 -1%, at 0.25 and 0.5 -3% (alternated in one process). */
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
    const kernels_t *k = kern();
    const int64_t cols = down_t->cols;
    xq_t xf, xs;
    if (xq_alloc(&xf, 0, layout_of(first->fmt), first->kp, 1) != 0) abort();
    quant_tokens(k, x, first->cols, first->kp, 0, 1, &xf);
    const xq_t *pxs = &xf;
    if (second && layout_of(second->fmt) != layout_of(first->fmt)) {
        if (xq_alloc(&xs, 1, layout_of(second->fmt), second->kp, 1) != 0) abort();
        quant_tokens(k, x, second->cols, second->kp, 0, 1, &xs);
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

/* ------------------------------------------------------------------ helpers for tests */

void si_quantize(int layout, const float *x, int64_t K, int8_t *q, float *d, float *s) {
    int64_t kp = (K + 31) / 32 * 32;
    xq_t xq;
    if (xq_alloc(&xq, 0, layout, kp, 1) != 0) abort();
    kern()->quantize(x, K, kp, 0, 1, &xq);
    memcpy(q, xq.q, (size_t)kp);
    memcpy(d, xq.d, (size_t)(kp / 32) * sizeof(float));
    memcpy(s, xq.s, (size_t)(kp / 32) * sizeof(float));
}

/* ------------------------------------------------------------------- bandwidth probe */

typedef struct {
    const kernels_t *k;
    const uint8_t *p;
    int64_t nbytes, chunk;
    uint64_t sink[256];
} read_ctx;

static void read_task(void *p, int64_t c) {
    read_ctx *a = p;
    int64_t i0 = c * a->chunk, i1 = i0 + a->chunk < a->nbytes ? i0 + a->chunk : a->nbytes;
    __atomic_fetch_add(&a->sink[c & 255], a->k->read_sum(a->p + i0, i1 - i0), __ATOMIC_RELAXED);
}

typedef struct {
    const kernels_t *k;
    const uint8_t *p;
    int64_t row_bytes, n, chunk;
    int prefetch;
    const int32_t *rows;
    uint64_t sink[256];
} rows_ctx;

static void read_rows_task(void *p, int64_t c) {
    rows_ctx *a = p;
    int64_t j0 = c * a->chunk, j1 = j0 + a->chunk < a->n ? j0 + a->chunk : a->n;
    uint64_t acc = 0;
    if (a->prefetch == 2) {
        /* 8 rows at a time, line by line across them (8 streams for the hardware prefetchers,
         * as the one-token dot tiles read): one word per 64-byte line fetches the line */
        for (int64_t j = j0; j < j1; j += 8) {
            const int nr = j1 - j < 8 ? (int)(j1 - j) : 8;
            const uint8_t *r[8];
            for (int l = 0; l < nr; l++) r[l] = a->p + (int64_t)a->rows[j + l] * a->row_bytes;
            for (int64_t o = 0; o < a->row_bytes; o += 64)
                for (int l = 0; l < nr; l++) {
                    uint64_t v;
                    memcpy(&v, r[l] + o, 8);
                    acc += v;
                }
        }
        __atomic_fetch_add(&a->sink[c & 255], acc, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t j = j0; j < j1; j++) {
        if (a->prefetch && j + 8 < j1) {
            const uint8_t *q = a->p + (int64_t)a->rows[j + 8] * a->row_bytes;
            for (int64_t o = 0; o < a->row_bytes; o += 64) __builtin_prefetch(q + o, 0, 2);
        }
        acc += a->k->read_sum(a->p + (int64_t)a->rows[j] * a->row_bytes, a->row_bytes);
    }
    __atomic_fetch_add(&a->sink[c & 255], acc, __ATOMIC_RELAXED);
}

/* Seconds for `reps` parallel passes reading whole rows rows[0..n) of row_bytes each: the
 * memory system's speed for the access pattern of the sparse kernels, without their work.
 * prefetch: 0 rows one after another (hardware prefetchers only), 1 the same with each row
 * prefetched 8 rows ahead, 2 eight rows at a time, line by line across them. */
double si_read_rows_seconds(const uint8_t *p, int64_t row_bytes, const int32_t *rows, int64_t n, int reps, int prefetch) {
    static volatile uint64_t keep;
    rows_ctx *a = calloc(1, sizeof *a);
    if (!a) abort();
    a->k = kern();
    a->p = p;
    a->row_bytes = row_bytes;
    a->rows = rows;
    a->n = n;
    a->prefetch = prefetch;
    a->chunk = (n + 8 * nthreads() - 1) / (8 * nthreads());
    if (a->chunk < 1) a->chunk = 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < reps; r++) si_pool_run(read_rows_task, a, (n + a->chunk - 1) / a->chunk);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 256; i++) keep += a->sink[i];
    free(a);
    return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
}

double si_read_seconds(const uint8_t *p, int64_t nbytes, int reps) {
    static volatile uint64_t keep;
    read_ctx *a = calloc(1, sizeof *a);
    if (!a) abort();
    a->k = kern();
    a->p = p;
    a->nbytes = nbytes;
    a->chunk = up((nbytes + 16 * nthreads() - 1) / (16 * nthreads()), 4096);
    int64_t nchunks = (nbytes + a->chunk - 1) / a->chunk;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < reps; r++) si_pool_run(read_task, a, nchunks);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 256; i++) keep += a->sink[i];
    free(a);
    return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
}

/* ------------------------------------------------------------------ RMS norm
 * y = x / sqrt(mean(x^2) + eps) * w, row by row, on the calling thread.  torch's rms_norm is
 * a composite of ~6 ops (15-40 us for one 1536-wide row, most of it dispatch); this is ~1 us
 * and it runs twice per layer per token.  The sum of squares is accumulated in double in 8
 * fixed lanes (vectorizable, and the same order on every run). */
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
 * floats) are contiguous, KV heads kstride / vstride floats apart.  A task takes up to 8
 * query heads of one KV head and reads that head's K and V once for all of them.  Each
 * head's sums run in a fixed order: results do not depend on the thread count. */
typedef struct {
    const float *q, *k, *v;
    float *o, *sc;
    int64_t H, Hk, D, L, kstride, vstride, per, ntask_kv;
    float scale;
    void (*fn)(const float *, const float *, const float *, float *, float *, int, int64_t, int64_t, float);
} att_ctx;

/* The portable version of si_attend_heads_avx2 (same arguments, see common.h). */
static void attend_heads(const float *q, const float *K, const float *V, float *sc, float *o, int n, int64_t D,
                         int64_t L, float scale) {
    for (int j = 0; j < n; j++) {
        float *s = sc + j * L, mx = -INFINITY;
        for (int64_t l = 0; l < L; l++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < D; i++) acc += q[j * D + i] * K[l * D + i];
            s[l] = acc * scale;
            mx = s[l] > mx ? s[l] : mx;
        }
        double sum = 0.0;
        for (int64_t l = 0; l < L; l++) sum += (s[l] = expf(s[l] - mx));
        const float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < D; i++) o[j * D + i] = 0.0f;
        for (int64_t l = 0; l < L; l++)
            for (int64_t i = 0; i < D; i++) o[j * D + i] += (s[l] * inv) * V[l * D + i];
    }
}

static void att_task(void *p, int64_t t) {
    const att_ctx *a = p;
    const int64_t g = a->H / a->Hk, kh = t / a->ntask_kv, part = t % a->ntask_kv;
    const int64_t h0 = kh * g + part * a->per, h1 = h0 + a->per < (kh + 1) * g ? h0 + a->per : (kh + 1) * g;
    const float *K = a->k + kh * a->kstride, *V = a->v + kh * a->vstride;
    if (h1 <= h0) return;
    a->fn(a->q + h0 * a->D, K, V, a->sc + h0 * a->L, a->o + h0 * a->D, (int)(h1 - h0), a->D, a->L, a->scale);
}

void si_attend1(const float *q, const float *k, const float *v, float *o, int64_t H, int64_t Hk, int64_t D,
                int64_t L, int64_t kstride, int64_t vstride, float scale) {
    float *sc = scratch(5, (size_t)(H * L + 16) * sizeof(float));
    if (!sc) abort();
    const int64_t g = H / Hk;
    /* split each KV head's query heads into parts of <= 8, and into more parts when there are
     * fewer KV heads than threads */
    int64_t parts = (g + SI_ATT_MAXG - 1) / SI_ATT_MAXG, want = (nthreads() + Hk - 1) / Hk;
    if (parts < want) parts = want < g ? want : g;
    const kernels_t *kl = kern();
    att_ctx a = {q, k, v, o, sc, H, Hk, D, L, kstride, vstride, (g + parts - 1) / parts, parts, scale, attend_heads};
    if (kl->attend && D % kl->attend_w == 0) a.fn = kl->attend;
#if SI_X86
    else if (kl->attend && D % 8 == 0) a.fn = si_attend_heads_avx2; /* the AVX-512 levels' for D = 8 mod 16 */
#endif
    run(att_task, &a, Hk * parts, H * L * D * 8);
}

/* ------------------------------------------------------------------ dequantize rows
 * out[(r - r0) * cols + j] = W[r][j] in float32 for r in [r0, r1), exactly the reference's
 * value (d*q + m, one rounding per operation).  Prefill multiplies many tokens by each
 * weight: there, an f32 matrix product on a dequantized slice of rows beats the integer
 * kernels (their activations are re-quantized per block of 32), and this costs ~1 ns per
 * weight, a few percent of the product. */
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
    const uint16_t *dr = w->d + r * w->ds, *mr = w->m ? w->m + r * w->ds : NULL;
    float blk[32];
    if (w->fmt == FMT_Q6) { /* a scale per 16 values; codes by si_q6_code (layout: quant.py) */
        for (int64_t b = 0; b < w->nb; b++) {
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
