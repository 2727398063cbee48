/* Internal to the threaded operations behind ops.h, which live in one file per concern:
 *   runtime.c    kernel-level selection, qmat descriptors, per-thread scratch buffers
 *   quant.c      activation quantization for the integer kernels (one or two int8 terms)
 *   dense.c      products with every row of a weight (gemv, matmul) and dequantized rows
 *   sparse.c     products over a list of rows (gemv_rows, axpy_rows, the sparse FFN paths)
 *   norm_attn.c  RMS norm and single-token attention
 *   probe.c      memory-bandwidth probes (measure the machine, not used by inference)
 * This header holds only what more than one of them needs: the work splitting (small enough
 * to stay inline in every caller) and the few functions one file provides to the others.
 * Not part of the module's interface: decode.c and module.c use ops.h.
 *
 * Determinism: every output element is produced by exactly one kernel call whose sequence of
 * floating-point operations does not depend on the split (gemv/matmul/gemv_rows/sparse_ffn
 * phase 1 split by output rows, axpy and sparse_ffn phase 2 split by output columns), so
 * results are bit-identical across runs and thread counts. */
#ifndef SI_OPS_INTERNAL_H
#define SI_OPS_INTERNAL_H
#include "ops.h"
#include "pool.h"

/* The kernel table in use: $SPARSEINFER_SIMD at first use if supported here, else the best
 * supported level, until si_select() changes it (runtime.c). */
const kernels_t *si_kern(void);

/* The per-core L2 cache in bytes as the C library reports it, or 1 MB when it does not. */
int64_t si_l2_bytes(void);

#define scratch si_scratch

static inline int64_t up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

/* ------------------------------------------------------------------------ splitting */

static inline int64_t nthreads(void) { return si_pool_get_threads(); }

/* Below this many weight bytes a call runs on the calling thread alone. */
#define SERIAL_BYTES (48 * 1024)

static inline void run(si_task_fn fn, void *ctx, int64_t nchunks, int64_t bytes) {
    if (nchunks <= 1 || bytes < SERIAL_BYTES || nthreads() == 1) {
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
    } else {
        si_pool_run(fn, ctx, nchunks);
    }
}

/* Rows per chunk of one-token products: a multiple of 8 (the one-token tiles take 8 rows),
 * about 4 chunks per thread (a thread descheduled by a busy machine holds up little work),
 * >= ~32 KB of weights.  No more chunks than that: each chunk starts with a tile nothing
 * prefetched, whose misses on scattered rows weigh most at low active fractions, and this
 * split beat 8 chunks per thread in multiples of 4 rows for gemv_rows without slowing the
 * dense gemv. */
static inline int64_t row_chunk(int64_t n, int64_t row_bytes) {
    int64_t c = (n + 4 * nthreads() - 1) / (4 * nthreads());
    int64_t minr = (32768 + row_bytes - 1) / (row_bytes ? row_bytes : 1);
    if (c < minr) c = minr;
    return up(c < 8 ? 8 : c, 8);
}

/* ------------------------------------------------------ activation quantization (quant.c) */

/* the activation layout (XL_*) that a weight format's integer kernels read */
static inline int layout_of(int fmt) {
    return fmt == FMT_Q4 || fmt == FMT_Q6 ? XL_Q4 : fmt == FMT_Q4K || fmt == FMT_TQ4K ? XL_Q8K : XL_NATURAL;
}

/* Layout T quantized token vectors of kp values in scratch slot `slot` (2T virtual tokens
 * in precise mode, see xq_t.pair); 0 ok, -1 out of memory. */
int si_xq_alloc(xq_t *xq, int slot, int layout, int64_t kp, int64_t T);
/* Quantize tokens [t0, t1) of x (K values each, padded to kp) into xq with level k's quantizer. */
void si_quant_tokens(const kernels_t *k, const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1,
                     const xq_t *xq);

/* ------------------------------------------------------------------- products (dense.c) */

/* y[i*ysr + t*yst] = W[rows[i]] . x_t for i < n, t < T (rows NULL: row i); quantized weights
 * use activation scratch slot xslot (and 8 + xslot for tile packing). */
void si_dots(const qmat_t *w, const int32_t *rows, int64_t n, const float *x, int64_t T, yout_t out, int xslot);

/* ------------------------------------------------------------- row-tiled q4 (tiles.c) */

/* y[i + t*ldy] = row i of a FMT_TQ4 / FMT_TQ6 weight . token t, for all rows and T tokens
 * quantized in xq (XL_NATURAL; T real tokens, pairs in precise mode); tchunk tokens at a time */
void si_tiles_dots(const qmat_t *w, const xq_t *xq, int64_t T, int64_t tchunk, float *y, int64_t ldy);
/* row r of a FMT_TQ4 / FMT_TQ6 weight in float32 (cols values), the reference's values */
void si_tile_row(const qmat_t *w, int64_t r, float *o);

#endif
