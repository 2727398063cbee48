/* Dense products on row-tiled q4 weights: y = W x for matrices whose rows are short (a few
 * hundred inputs: the output head's low-rank preview, vocab x rank).
 *
 * Why a third layout: the row-major kernels (dense.c) reduce each row's sum across a vector
 * at its end and walk up to 8 rows as separate streams with their scales in other arrays;
 * on rows of 256 inputs (128 bytes of codes) that per-row work, not memory, sets the pace.
 * Here 16 rows are interleaved so that one 64-byte line holds 4 inputs of each of the 16 rows:
 * a 4-way byte dot product against the broadcast inputs leaves one row's sum per lane, no
 * reduction, and a tile is one contiguous stream, its scales included.
 *
 * Layout (tmat_t, sparseinfer/quant.py `to_tiles` is the authority): W has N rows and K
 * columns; G = ceil(K/32) blocks of 32 inputs; ntiles = ceil(N/16).  The values are exactly
 * our row-major q4's: value(r, j) = d[r][b] * q + m[r][b], q in 0..15, b = j / 32, d and m f16.
 * Tile t, block b is TQ4_BLOCK_BYTES = 320 bytes at qs + (t * G + b) * 320: four lines of 64
 * bytes, then the 16 rows' d (32 bytes), then their m (32 bytes).  In line l, byte 4i + c holds
 * row 16t + i, input 32b + 8l + c in its low nibble and input 32b + 8l + 4 + c in its high
 * nibble (i < 16, c < 4).  Padding rows and columns hold q = 0 with d = m = 0.
 *
 * The token is quantized as for the q8 kernels (XL_NATURAL: int8 per input, d_x and
 * s = d_x * sum(q_x) per block), always one int8 term (the precise activation mode's second
 * term is not applied: these products feed approximations), and a block contributes
 *   y[r] += d_x d[r][b] sum_j q_x[j] q[r][j]  +  m[r][b] s[b]
 * with the integer sums exact.  Each tile is computed by one kernel call in a fixed order,
 * so the result does not depend on the thread count. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* the code of row i (< 16), input c (< 32) of a tile's block at bp */
static int tq4_code(const uint8_t *bp, int i, int c) {
    const int l = c / 8, k = c % 8;
    const uint8_t v = bp[64 * l + 4 * i + k % 4];
    return k < 4 ? v & 15 : v >> 4;
}

static void tiles_q4_portable(const tmat_t *w, int64_t t0, int64_t t1, const int8_t *q, const float *d,
                              const float *s, float *y) {
    for (int64_t t = t0; t < t1; t++)
        for (int i = 0; i < TQ4_ROWS; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < w->g; b++) {
                const uint8_t *bp = w->qs + (t * w->g + b) * TQ4_BLOCK_BYTES;
                uint16_t dh, mh;
                memcpy(&dh, bp + 256 + 2 * i, 2);
                memcpy(&mh, bp + 288 + 2 * i, 2);
                int32_t sum = 0;
                for (int c = 0; c < 32; c++) sum += (int32_t)q[32 * b + c] * tq4_code(bp, i, c);
                acc += (float)sum * (si_h2f(dh) * d[b]) + si_h2f(mh) * s[b];
            }
            y[TQ4_ROWS * (t - t0) + i] = acc;
        }
}

typedef struct {
    const tmat_t *w;
    void (*fn)(const tmat_t *, int64_t, int64_t, const int8_t *, const float *, const float *, float *);
    const int8_t *q;
    const float *d, *s;
    int64_t chunk;
    float *y;
} tiles_ctx;

static void tiles_task(void *p, int64_t c) {
    const tiles_ctx *a = p;
    const tmat_t *w = a->w;
    const int64_t t0 = c * a->chunk, t1 = t0 + a->chunk < w->ntiles ? t0 + a->chunk : w->ntiles;
    const int64_t full = w->rows / TQ4_ROWS; /* tiles whose 16 rows all exist */
    const int64_t tf = t1 < full ? t1 : full > t0 ? full : t0;
    if (tf > t0) a->fn(w, t0, tf, a->q, a->d, a->s, a->y + TQ4_ROWS * t0);
    if (t1 > tf) { /* the last tile, partly padding */
        float tmp[TQ4_ROWS];
        a->fn(w, tf, t1, a->q, a->d, a->s, tmp);
        memcpy(a->y + TQ4_ROWS * tf, tmp, (size_t)(w->rows - TQ4_ROWS * tf) * sizeof(float));
    }
}

void si_gemv_tiles(const tmat_t *w, const float *x, float *y) {
    const kernels_t *k = si_kern();
    const int64_t kp = w->g * 32;
    xq_t xq;
    if (si_xq_alloc(&xq, 0, XL_NATURAL, kp, 1) != 0) abort();
    /* the level's quantizer directly: one int8 term whatever the activation mode (see above) */
    k->quantize(x, w->cols, kp, 0, 1, &xq);
    /* about 4 chunks per thread, >= ~32 KB each (row_chunk's reasoning, in tiles) */
    const int64_t tile_bytes = w->g * TQ4_BLOCK_BYTES;
    int64_t chunk = (w->ntiles + 4 * nthreads() - 1) / (4 * nthreads());
    const int64_t minc = (32768 + tile_bytes - 1) / tile_bytes;
    if (chunk < minc) chunk = minc;
    tiles_ctx a = {w, k->tiles_q4 ? k->tiles_q4 : tiles_q4_portable, xq.q, xq.d, xq.s, chunk, y};
    run(tiles_task, &a, (w->ntiles + chunk - 1) / chunk, w->ntiles * tile_bytes);
}

int si_tmat_init(tmat_t *w, int64_t rows, int64_t cols, const void *qs) {
    if (rows < 1 || cols < 1 || !qs) return -1;
    w->rows = rows;
    w->cols = cols;
    w->g = (cols + 31) / 32;
    w->ntiles = (rows + TQ4_ROWS - 1) / TQ4_ROWS;
    w->qs = qs;
    return 0;
}
