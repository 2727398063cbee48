/* Dense products on row-tiled q4 weights (format tq4): y = W x for one token or many.
 *
 * Why a layout of its own: the row-major kernels (dense.c) reduce each row's sum across a
 * vector at its end, expand each 64-byte step's four block scales to the dot-product lanes
 * and walk up to 8 rows as separate streams with their scales in other arrays; on AMD Zen 4
 * that per-step work, not memory, sets the pace of a one-token product.  Here 16 rows are
 * interleaved so that one 64-byte line holds 4 inputs of each of the 16 rows: a 4-way byte
 * dot product against the broadcast inputs leaves one row's sum per lane, no reduction, one
 * scale multiply per block of 32 inputs for 16 rows, and a tile is one contiguous stream, its
 * scales included.  Rows are not addressable on their own, so row-sparse products need the
 * row-major q4 (sparseinfer/quant.py `from_tiles`).
 *
 * Layout (sparseinfer/quant.py `to_tiles` is the authority): W has N rows and K columns;
 * G = nb = ceil(K/32) blocks of 32 inputs; ntiles = ceil(N/16).  The values are exactly the
 * row-major q4's: value(r, j) = d[r][b] * q + m[r][b], q in 0..15, b = j / 32, d and m f16.
 * Tile t, block b is TQ4_BLOCK_BYTES = 320 bytes at qs + (t * G + b) * 320: four lines of 64
 * bytes, then the 16 rows' d (32 bytes), then their m (32 bytes).  In line l, byte 4i + c holds
 * row 16t + i, input 32b + 8l + c in its low nibble and input 32b + 8l + 4 + c in its high
 * nibble (i < 16, c < 4).  Padding rows and columns hold q = 0 with d = m = 0.
 *
 * The tokens are quantized as for the q8 kernels (XL_NATURAL: int8 per input, d_x and
 * s = d_x * sum(q_x) per block; in the precise activation mode two terms per token), and a
 * block contributes, per term,
 *   y[r] += d_x d[r][b] sum_j q_x[j] q[r][j]  +  m[r][b] s[b]
 * with the integer sums exact, blocks in order into two alternating float accumulators that
 * are added at the end.  Each (tile, token) is computed by one kernel call in that fixed
 * order for any number of tokens, so the result depends neither on the thread count nor on
 * how many tokens share the call (a prompt row equals the one-token product).
 *
 * tq6 holds q6's values (value = d16 * (q - 32), q in 0..63, an f16 scale per 16 inputs) the
 * same way, TQ6_BLOCK_BYTES = 448 per tile and block: the four lines of low nibbles exactly as
 * tq4's, then two lines of high bits (line h, byte 4i + c: the 2-bit high parts of inputs
 * 16h + c, 16h + 4 + c, 16h + 8 + c, 16h + 12 + c of row i, in bits 0-1, 2-3, 4-5, 6-7), then
 * the 16 rows' f16 d of inputs 0..15 (32 bytes) and of inputs 16..31 (32 bytes).  A block
 * contributes, per term and per half j of 16 inputs,
 *   y[r] += d_x d_j[r] (sum_i q_x[i] q[r][i] - 32 sum_i q_x[i])
 * the per-16 sums of the token's codes computed once per call.
 *
 * tq4k holds q4k's values (GGUF Q4_K: value = d sc_j q - dmin mn_j for sub-block j of 32
 * inputs, 6-bit sc_j and mn_j, f16 d and dmin per 256 inputs) in the same bytes as the file,
 * rearranged: TQ4K_BLOCK_BYTES = 2304 per tile and super-block of 256 inputs at qs + (t * ns
 * + s) * 2304, ns = cols / 256: the 8 sub-blocks' codes as tq4's four lines each (256 bytes
 * per sub-block), then the 16 rows' scales and mins: 64 bytes of the scales' low 4 bits (byte
 * 16p + i: row i, sub-block 2p in the low nibble, 2p + 1 in the high one), 64 of the mins'
 * alike, 32 of the scales' high 2 bits (byte 16h + i, bits 2k: sub-block 4h + k), 32 of the
 * mins' alike, then the 16 rows' f16 d (32 bytes) and dmin (32 bytes).  The tokens are
 * quantized per super-block of 256 (XL_Q8K, llama.cpp's Q8_K, as for q4k: one d_x per 256,
 * block sums s[j] per 32), and a super-block contributes, per term,
 *   y[r] += d_x d[r] (sum_j sc_j[r] sum_i q_x[i] q[r][i])  -  dmin[r] (sum_j mn_j[r] s[j])
 * the first sum exact in integers, the mins' in float in sub-block order. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* the code of row i (< 16), input c (< 32) of a tile's block at bp: tq4's 4 bits (the low
 * nibbles of tq6) */
static int tq4_code(const uint8_t *bp, int i, int c) {
    const int l = c / 8, k = c % 8;
    const uint8_t v = bp[64 * l + 4 * i + k % 4];
    return k < 4 ? v & 15 : v >> 4;
}

/* tq6: the whole 6-bit code */
static int tq6_code(const uint8_t *bp, int i, int c) {
    const int h = c / 16, k = c % 16;
    return tq4_code(bp, i, c) | (((bp[256 + 64 * h + 4 * i + k % 4] >> (2 * (k / 4))) & 3) << 4);
}

/* tq4k: row i's 6-bit scale (k = 0) or min (k = 1) of sub-block j of a super-block at bp */
static int tq4k_scale(const uint8_t *bp, int k, int i, int j) {
    const uint8_t lo = bp[TQ4K_LO + 64 * k + 16 * (j / 2) + i], hi = bp[TQ4K_HI + 32 * k + 16 * (j / 4) + i];
    return ((j & 1) ? lo >> 4 : lo & 15) | (((hi >> (2 * (j % 4))) & 3) << 4);
}

/* bytes per tile and block of 32 inputs (tq4k: an eighth of a super-block's) */
static int64_t block_bytes(const qmat_t *w) {
    return w->fmt == FMT_TQ6 ? TQ6_BLOCK_BYTES : w->fmt == FMT_TQ4K ? TQ4K_BLOCK_BYTES / 8 : TQ4_BLOCK_BYTES;
}

void si_tile_row(const qmat_t *w, int64_t r, float *o) {
    const int64_t t = r / TQ4_ROWS, bb = block_bytes(w);
    const int i = (int)(r % TQ4_ROWS);
    if (w->fmt == FMT_TQ4K) { /* the q4k row's values exactly as dense.c's deq_row forms them */
        const int64_t ns = w->cols / 256;
        for (int64_t s = 0; s < ns; s++) {
            const uint8_t *bp = w->qs + (t * ns + s) * TQ4K_BLOCK_BYTES;
            uint16_t dh, mh;
            memcpy(&dh, bp + TQ4K_D + 2 * i, 2);
            memcpy(&mh, bp + TQ4K_D + 32 + 2 * i, 2);
            for (int j = 0; j < 8; j++) {
                const float d = si_h2f(dh) * (float)tq4k_scale(bp, 0, i, j), m = si_h2f(mh) * (float)tq4k_scale(bp, 1, i, j);
                for (int c = 0; c < 32; c++) o[256 * s + 32 * j + c] = d * (float)tq4_code(bp + 256 * j, i, c) - m;
            }
        }
        return;
    }
    for (int64_t b = 0; b < w->nb; b++) {
        const uint8_t *bp = w->qs + (t * w->nb + b) * bb;
        uint16_t dh, mh;
        if (w->fmt == FMT_TQ6) {
            for (int c = 0; c < 32 && 32 * b + c < w->cols; c++) {
                memcpy(&dh, bp + 384 + 32 * (c / 16) + 2 * i, 2);
                o[32 * b + c] = si_h2f(dh) * (float)(tq6_code(bp, i, c) - 32);
            }
            continue;
        }
        memcpy(&dh, bp + 256 + 2 * i, 2);
        memcpy(&mh, bp + 288 + 2 * i, 2);
        const float d = si_h2f(dh), m = si_h2f(mh);
        for (int c = 0; c < 32 && 32 * b + c < w->cols; c++) o[32 * b + c] = d * (float)tq4_code(bp, i, c) + m;
    }
}

static void tiles_q4_portable(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y,
                              int64_t yst) {
    const int P = xq->pair;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t k = 0; k < T; k++)
            for (int i = 0; i < TQ4_ROWS; i++) {
                float acc[2] = {0.0f, 0.0f};
                for (int64_t b = 0; b < w->nb; b++) {
                    const uint8_t *bp = w->qs + (t * w->nb + b) * TQ4_BLOCK_BYTES;
                    uint16_t dh, mh;
                    memcpy(&dh, bp + 256 + 2 * i, 2);
                    memcpy(&mh, bp + 288 + 2 * i, 2);
                    for (int h = 0; h <= P; h++) {
                        const int64_t v = (k << P) + h;
                        const int8_t *q = xq->q + v * xq->q_stride + 32 * b;
                        int32_t sum = 0;
                        for (int c = 0; c < 32; c++) sum += (int32_t)q[c] * tq4_code(bp, i, c);
                        const float dx = xq->d[v * xq->d_stride + b], sx = xq->s[v * xq->d_stride + b];
                        acc[b & 1] += (float)sum * (si_h2f(dh) * dx) + si_h2f(mh) * sx;
                    }
                }
                y[k * yst + TQ4_ROWS * (t - t0) + i] = acc[0] + acc[1];
            }
}

static void tiles_q6_portable(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, const int32_t *s16, int64_t T,
                              float *y, int64_t yst) {
    const int P = xq->pair;
    const int64_t ns = w->kp / 16;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t k = 0; k < T; k++)
            for (int i = 0; i < TQ4_ROWS; i++) {
                float acc[2] = {0.0f, 0.0f};
                for (int64_t b = 0; b < w->nb; b++) {
                    const uint8_t *bp = w->qs + (t * w->nb + b) * TQ6_BLOCK_BYTES;
                    uint16_t dh[2];
                    memcpy(&dh[0], bp + 384 + 2 * i, 2);
                    memcpy(&dh[1], bp + 416 + 2 * i, 2);
                    for (int h = 0; h <= P; h++) {
                        const int64_t v = (k << P) + h;
                        const int8_t *q = xq->q + v * xq->q_stride + 32 * b;
                        const float dx = xq->d[v * xq->d_stride + b];
                        for (int j = 0; j < 2; j++) {
                            int32_t sum = 0;
                            for (int c = 16 * j; c < 16 * j + 16; c++) sum += (int32_t)q[c] * tq6_code(bp, i, c);
                            sum -= 32 * s16[v * ns + 2 * b + j];
                            acc[b & 1] += (float)sum * (si_h2f(dh[j]) * dx);
                        }
                    }
                }
                y[k * yst + TQ4_ROWS * (t - t0) + i] = acc[0] + acc[1];
            }
}

static void tiles_q4k_portable(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y,
                               int64_t yst) {
    const int P = xq->pair;
    const int64_t ns = w->cols / 256;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t k = 0; k < T; k++)
            for (int i = 0; i < TQ4_ROWS; i++) {
                float acc[2] = {0.0f, 0.0f};
                for (int64_t s = 0; s < ns; s++) {
                    const uint8_t *bp = w->qs + (t * ns + s) * TQ4K_BLOCK_BYTES;
                    uint16_t dh, mh;
                    memcpy(&dh, bp + TQ4K_D + 2 * i, 2);
                    memcpy(&mh, bp + TQ4K_D + 32 + 2 * i, 2);
                    for (int h = 0; h <= P; h++) {
                        const int64_t v = (k << P) + h;
                        const int8_t *q = xq->q + v * xq->q_stride + 256 * s;
                        const float *sx = xq->s + v * xq->d_stride + 8 * s;
                        int32_t isum = 0;
                        float mt = 0.0f;
                        for (int j = 0; j < 8; j++) {
                            int32_t sum = 0;
                            for (int c = 0; c < 32; c++) sum += (int32_t)q[32 * j + c] * tq4_code(bp + 256 * j, i, c);
                            isum += tq4k_scale(bp, 0, i, j) * sum;
                            mt += (float)tq4k_scale(bp, 1, i, j) * sx[j];
                        }
                        acc[s & 1] += (float)isum * (si_h2f(dh) * xq->d[v * xq->d_stride + 8 * s]) - si_h2f(mh) * mt;
                    }
                }
                y[k * yst + TQ4_ROWS * (t - t0) + i] = acc[0] + acc[1];
            }
}

typedef struct {
    const qmat_t *w;
    void (*fn)(const qmat_t *, int64_t, int64_t, const xq_t *, int64_t, float *, int64_t);
    void (*fn4k)(const qmat_t *, int64_t, int64_t, const xq_t *, int64_t, float *, int64_t);
    void (*fn6)(const qmat_t *, int64_t, int64_t, const xq_t *, const int32_t *, int64_t, float *, int64_t);
    const int32_t *s16;
    const xq_t *xq;
    int64_t T, tchunk, chunk, ntiles, ldy;
    float *y;
} tiles_ctx;

/* one call of the format's kernel */
static void tiles_call(const tiles_ctx *a, int64_t t0, int64_t t1, const xq_t *s, int64_t k0, int64_t kn, float *y,
                       int64_t yst) {
    if (a->w->fmt == FMT_TQ6)
        a->fn6(a->w, t0, t1, s, a->s16 + (k0 << a->xq->pair) * (a->w->kp / 16), kn, y, yst);
    else if (a->w->fmt == FMT_TQ4K)
        a->fn4k(a->w, t0, t1, s, kn, y, yst);
    else
        a->fn(a->w, t0, t1, s, kn, y, yst);
}

/* tokens [k0, k0 + kn) of xq (real tokens: 2 virtual ones each in pair mode) */
static xq_t tokens_from(const xq_t *xq, int64_t k0) {
    xq_t s = *xq;
    const int64_t v = k0 << xq->pair;
    s.q += v * s.q_stride;
    s.d += v * s.d_stride;
    s.s += v * s.d_stride;
    return s;
}

enum { TAIL_TOKENS = 64 }; /* tokens per call for the last, partly padding tile */

static void tiles_task(void *p, int64_t c) {
    const tiles_ctx *a = p;
    const qmat_t *w = a->w;
    const int64_t t0 = c * a->chunk, t1 = t0 + a->chunk < a->ntiles ? t0 + a->chunk : a->ntiles;
    const int64_t full = w->rows / TQ4_ROWS; /* tiles whose 16 rows all exist */
    const int64_t tf = t1 < full ? t1 : full > t0 ? full : t0;
    for (int64_t k0 = 0; k0 < a->T; k0 += a->tchunk) {
        const int64_t kn = a->T - k0 < a->tchunk ? a->T - k0 : a->tchunk;
        const xq_t s = tokens_from(a->xq, k0);
        if (tf > t0) tiles_call(a, t0, tf, &s, k0, kn, a->y + k0 * a->ldy + TQ4_ROWS * t0, a->ldy);
        for (int64_t ka = 0; t1 > tf && ka < kn; ka += TAIL_TOKENS) { /* the last tile, partly padding */
            float tmp[TQ4_ROWS * TAIL_TOKENS];
            const int64_t kb = kn - ka < TAIL_TOKENS ? kn - ka : TAIL_TOKENS;
            const xq_t st = tokens_from(&s, ka);
            tiles_call(a, tf, t1, &st, k0 + ka, kb, tmp, TQ4_ROWS);
            for (int64_t k = 0; k < kb; k++)
                memcpy(a->y + (k0 + ka + k) * a->ldy + TQ4_ROWS * tf, tmp + TQ4_ROWS * k,
                       (size_t)(w->rows - TQ4_ROWS * tf) * sizeof(float));
        }
    }
}

void si_tiles_dots(const qmat_t *w, const xq_t *xq, int64_t T, int64_t tchunk, float *y, int64_t ldy) {
    const kernels_t *k = si_kern();
    const int64_t ntiles = (w->rows + TQ4_ROWS - 1) / TQ4_ROWS;
    /* about 4 chunks per thread, >= ~32 KB each (row_chunk's reasoning, in tiles) */
    const int64_t tile_bytes = w->nb * block_bytes(w);
    int64_t chunk = (ntiles + 4 * nthreads() - 1) / (4 * nthreads());
    const int64_t minc = (32768 + tile_bytes - 1) / tile_bytes;
    if (chunk < minc && T <= FEW_TOKENS) chunk = minc;
    if (chunk < 1) chunk = 1;
    int32_t *s16 = NULL;
    if (w->fmt == FMT_TQ6) { /* each (virtual) token's code sums per 16 inputs */
        const int64_t nv = T << xq->pair, ns = w->kp / 16;
        s16 = scratch(11, (size_t)(nv * ns) * sizeof(int32_t) + 64);
        if (!s16) abort();
        for (int64_t v = 0; v < nv; v++)
            for (int64_t j = 0; j < ns; j++) {
                const int8_t *q = xq->q + v * xq->q_stride + 16 * j;
                int32_t sum = 0;
                for (int c = 0; c < 16; c++) sum += q[c];
                s16[v * ns + j] = sum;
            }
    }
    tiles_ctx a = {w, k->tiles_q4 ? k->tiles_q4 : tiles_q4_portable, k->tiles_q4k ? k->tiles_q4k : tiles_q4k_portable,
                   k->tiles_q6 ? k->tiles_q6 : tiles_q6_portable, s16,
                   xq, T, tchunk < 1 ? 1 : tchunk, chunk, ntiles, ldy, y};
    run(tiles_task, &a, (ntiles + chunk - 1) / chunk, ntiles * tile_bytes * (T > FEW_TOKENS ? 64 : T));
}

void si_gemv_tiles_int8(const qmat_t *w, const float *x, float *y) {
    const kernels_t *k = si_kern();
    xq_t xq;
    if (si_xq_alloc(&xq, 0, XL_NATURAL, w->kp, 1) != 0) abort();
    xq.pair = 0; /* one int8 term whatever the activation mode (the buffer holds two) */
    k->quantize(x, w->cols, w->kp, 0, 1, &xq);
    si_tiles_dots(w, &xq, 1, 1, y, 0);
}

/* ---------------------------------------------- row-major q4 / q6 -> row tiles */

typedef struct {
    const qmat_t *w;
    uint8_t *out;
} tile_ctx;

static void tile_task(void *p, int64_t t) {
    const tile_ctx *a = p;
    const qmat_t *w = a->w;
    const int q6 = w->fmt == FMT_Q6;
    const int64_t bb = q6 ? TQ6_BLOCK_BYTES : TQ4_BLOCK_BYTES;
    for (int64_t b = 0; b < w->nb; b++) {
        uint8_t *bp = a->out + (t * w->nb + b) * bb;
        memset(bp, 0, (size_t)bb);
        for (int i = 0; i < TQ4_ROWS; i++) {
            const int64_t r = TQ4_ROWS * t + i;
            if (r >= w->rows) break;
            const uint8_t *row = w->qs + r * w->row_bytes, *qb = row + 16 * b; /* q4: byte j = value j | j + 16 << 4 */
            /* 4 bytes at a time: line l, byte 4i + c = code(8l + c) | code(8l + 4 + c) << 4 (low
             * nibbles of q6's codes), from 16 bytes in q4's block order: a q4 block, or one of a
             * q6 group's 4 blocks (quant.py has the q6 layout) */
            const int64_t g = b / 4, gb = b % 4;
            const int fast6 = q6 && b < w->nb / 4 * 4;
            if (!q6 || fast6) {
                uint32_t v[4], line[4];
                memcpy(v, q6 ? row + 96 * g + 16 * gb : qb, 16);
                const uint32_t lo = 0x0F0F0F0Fu, hi = 0xF0F0F0F0u;
                line[0] = (v[0] & lo) | ((v[1] & lo) << 4);
                line[1] = (v[2] & lo) | ((v[3] & lo) << 4);
                line[2] = ((v[0] >> 4) & lo) | (v[1] & hi);
                line[3] = ((v[2] >> 4) & lo) | (v[3] & hi);
                for (int l = 0; l < 4; l++) memcpy(bp + 64 * l + 4 * i, &line[l], 4);
                if (!q6) {
                    memcpy(bp + 256 + 2 * i, w->d + r * w->ds + b, 2);
                    memcpy(bp + 288 + 2 * i, w->m + r * w->ds + b, 2);
                    continue;
                }
                /* high parts: value j < 16 of group block gb in byte 16 (gb % 2) + j of the group's
                 * 32 high bytes, bits 2 (gb / 2); value 16 + j in the same byte, bits 2 (2 + gb / 2);
                 * high line h, byte 4i + c, bits 2k: input 16h + 4k + c */
                const uint8_t *hb = row + 96 * g + 64 + 16 * (gb % 2);
                for (int h = 0; h < 2; h++) {
                    const int sh = 2 * (2 * h + gb / 2);
                    uint32_t out = 0;
                    for (int k = 0; k < 4; k++) {
                        uint32_t word;
                        memcpy(&word, hb + 4 * k, 4);
                        out |= ((word >> sh) & 0x03030303u) << (2 * k);
                    }
                    memcpy(bp + 256 + 64 * h + 4 * i, &out, 4);
                }
                memcpy(bp + 384 + 2 * i, w->d + r * w->ds + 2 * b, 2);
                memcpy(bp + 416 + 2 * i, w->d + r * w->ds + 2 * b + 1, 2);
                continue;
            }
            for (int c = 0; c < 32; c++) {
                const int code = si_q6_code(row, w->nb, b, c), l = c / 8, k = c % 8;
                bp[64 * l + 4 * i + k % 4] |= (uint8_t)(k < 4 ? code & 15 : (code & 15) << 4);
                bp[256 + 64 * (c / 16) + 4 * i + c % 4] |= (uint8_t)((code >> 4) << (2 * ((c % 16) / 4)));
            }
            memcpy(bp + 384 + 2 * i, w->d + r * w->ds + 2 * b, 2);
            memcpy(bp + 416 + 2 * i, w->d + r * w->ds + 2 * b + 1, 2);
        }
    }
}

/* q4k -> tq4k: each row's super-block (d, dmin, 12 bytes of packed 6-bit scales and mins,
 * 128 bytes of codes: bytes 32c.. hold sub-block 2c in their low nibbles and 2c + 1 in their
 * high ones) spread over its tile's super-block, 4 code bytes at a time */
static void tile_q4k_task(void *p, int64_t t) {
    const tile_ctx *a = p;
    const qmat_t *w = a->w;
    const int64_t ns = w->cols / 256;
    for (int64_t s = 0; s < ns; s++) {
        uint8_t *bp = a->out + (t * ns + s) * TQ4K_BLOCK_BYTES;
        memset(bp, 0, TQ4K_BLOCK_BYTES);
        for (int i = 0; i < TQ4_ROWS; i++) {
            const int64_t r = TQ4_ROWS * t + i;
            if (r >= w->rows) break;
            const uint8_t *blk = w->qs + r * w->row_bytes + s * SI_Q4K_BYTES;
            const uint32_t lo = 0x0F0F0F0Fu, hi = 0xF0F0F0F0u;
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 4; l++) {
                    uint32_t v[2], line[2];
                    memcpy(v, blk + 16 + 32 * c + 8 * l, 8);
                    line[0] = (v[0] & lo) | ((v[1] & lo) << 4);          /* sub-block 2c: low nibbles */
                    line[1] = ((v[0] >> 4) & lo) | (v[1] & hi);           /* sub-block 2c + 1: high ones */
                    memcpy(bp + 256 * (2 * c) + 64 * l + 4 * i, &line[0], 4);
                    memcpy(bp + 256 * (2 * c + 1) + 64 * l + 4 * i, &line[1], 4);
                }
            int sm[2][8];
            for (int j = 0; j < 8; j++) si_q4k_sub(blk + 4, j, &sm[0][j], &sm[1][j]);
            for (int k = 0; k < 2; k++) {
                for (int q = 0; q < 4; q++) bp[TQ4K_LO + 64 * k + 16 * q + i] = (uint8_t)((sm[k][2 * q] & 15) | (sm[k][2 * q + 1] & 15) << 4);
                for (int h = 0; h < 2; h++) {
                    int v = 0;
                    for (int j = 0; j < 4; j++) v |= ((sm[k][4 * h + j] >> 4) & 3) << (2 * j);
                    bp[TQ4K_HI + 32 * k + 16 * h + i] = (uint8_t)v;
                }
            }
            memcpy(bp + TQ4K_D + 2 * i, blk, 2);
            memcpy(bp + TQ4K_D + 32 + 2 * i, blk + 2, 2);
        }
    }
}

void si_tile_rows(const qmat_t *w, uint8_t *out) {
    tile_ctx a = {w, out};
    const int64_t ntiles = (w->rows + TQ4_ROWS - 1) / TQ4_ROWS;
    run(w->fmt == FMT_Q4K ? tile_q4k_task : tile_task, &a, ntiles, ntiles * w->nb * TQ6_BLOCK_BYTES);
}
