/* sparseinfer CPU kernel core: shared types.
 *
 * Weight layout (see sparseinfer/quant.py, which is the authority):
 *   f32/f16/bf16: qs = rows x cols plain values, row-major.
 *   q8: qs int8 rows x kp; d (and optional m) f16 rows x nb.  value = d*q (+ m)
 *   q4: qs uint8 rows x kp/2 (GGUF nibble order: byte j = value j | value j+16 << 4 within
 *       each 32-block); d, m f16 rows x nb.  value = d*q + m
 *   q6: qs uint8 rows x 3kp/4 (see quant.py: groups of 4 blocks = 64 nibble bytes in q4 order +
 *       32 bytes of 2-bit high parts, then 24-byte tail blocks); d f16 rows x 2nb, one scale
 *       per 16 values; no m.  value = d*(q - 32), q in 0..63.  Uses the XL_Q4 activation layout.
 *   q4k: GGUF Q4_K super-blocks as the file stores them, 144 bytes per 256 values (row r at
 *       qs + r*row_bytes, cols/256 blocks; cols a multiple of 256): f16 d, f16 dmin, 12 bytes
 *       of 6-bit sub-block scales sc[8] and mins mn[8] (si_q4k_scale_min), then 128 bytes of
 *       nibbles: bytes 32c..32c+31 hold values 64c..64c+31 in their low nibbles and values
 *       64c+32..64c+63 in their high nibbles.  d, m are NULL.
 *       value j of sub-block i (32 values) = d*sc[i]*q - dmin*mn[i].  Uses XL_Q8K activations.
 *   tq4: q4's values in row tiles of 16 rows (tiles.c has the layout): tile t is nb blocks of
 *       TQ4_BLOCK_BYTES, codes and the 16 rows' f16 d and m together, at qs + t*nb*320.
 *       row_bytes = 20*nb is a row's share (tiles are not row-addressable: only whole-matrix
 *       products, si_gemv / si_matmul, take it); d, m are NULL.  Uses XL_NATURAL activations.
 *   tq6: q6's values in row tiles of 16 rows, TQ6_BLOCK_BYTES per tile and block (tiles.c),
 *       row_bytes = 28*nb; otherwise as tq4.
 *   tq4k: q4k's values in row tiles of 16 rows, TQ4K_BLOCK_BYTES per tile and super-block of
 *       256 inputs (tiles.c), row_bytes = 144 * cols/256; cols a multiple of 256; otherwise
 *       as tq4 (XL_NATURAL activations, per 32).
 *   kp = cols rounded up to 32, nb = kp / 32; padding values are zero.
 *   Rows may be strided (`row_bytes`, `ds` above the natural widths): the neuron records of
 *   a SparseFFN keep one neuron's gate, up and down_t rows and scales in one contiguous block,
 *   and its weights are row views into them.
 *
 * Activations for the integer formats are quantized once per call to int8 blocks of 32
 * (`xq_t`): q = round(x * 127/amax), d = amax/127, s = d * sum(q)
 * (the block's sum as the products see it, for the m term; see kern_scalar.c).
 * Two byte layouts of q, matching how each weight format unpacks without shuffles:
 *   XL_NATURAL (q8): block b at bytes 32b..32b+31.
 *   XL_Q4 (q4): blocks in groups of 4 (g = 128 bytes): bytes 0..63 hold values 0..15 of the
 *       4 blocks (16 each), bytes 64..127 values 16..31; blocks after the last full group
 *       are stored naturally.  This is exactly the order a 64-byte q4 load yields after
 *       `& 0x0F` (low nibbles) and `>> 4` (high nibbles).
 *   XL_Q8K (q4k): natural byte order, every block of a 256-value super-block quantized with
 *       the super-block's one scale (llama.cpp's Q8_K): d and s are still stored per block of
 *       32 (the 8 d's of a super-block equal), `de` is not filled.
 * `de` holds each block scale repeated once per int32 lane of a 512-bit dot product:
 *   XL_Q4: 16 floats per full group (d of block i at lanes 4i..4i+3);
 *   XL_NATURAL: 16 floats per pair of blocks (d of block i at lanes 8i..8i+7).
 */
#ifndef SI_COMMON_H
#define SI_COMMON_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>

/* x86 SIMD kernels and run-time dispatch; on AArch64 the NEON ones; elsewhere (or with
 * -DSI_FORCE_SCALAR, used to test that build) only the scalar kernels exist. */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(SI_FORCE_SCALAR)
#define SI_X86 1
#else
#define SI_X86 0
#endif
/* AArch64 (NEON, and SDOT where the CPU has the dotprod feature); the same switch */
#if defined(__aarch64__) && !defined(SI_FORCE_SCALAR)
#define SI_ARM 1
#else
#define SI_ARM 0
#endif

enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_Q8 = 3, FMT_Q4 = 4, FMT_Q6 = 5, FMT_Q4K = 6, FMT_TQ4 = 7,
       FMT_TQ6 = 8, FMT_TQ4K = 9, FMT_COUNT = 10 };
enum { XL_NATURAL = 0, XL_Q4 = 1, XL_Q8K = 2 };
#define SI_Q4K_BYTES 144 /* one q4k super-block */
/* KV cache element types (si_attn_plan_t.kv_type; sparseinfer/kv_cache.py is the authority).
 * One cached position of one KV head is a row of D values:
 *   KV_F32: D floats;  KV_F16: D IEEE halves;
 *   KV_Q8_0: ceil(D/32) blocks of 34 bytes, GGUF Q8_0's: an f16 scale d, then 32 int8 q;
 *       value = d*q; the values of the last block past D are 0.  A row is quantized once,
 *       when its token is written: amax = max|x|, d = amax/127, q = round_even(x * (1/d)). */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2, KV_COUNT = 3 };
#define SI_Q8_0_BLOCK 34

static inline int64_t si_kv_row_bytes(int type, int64_t D) {
    return type == KV_F32 ? 4 * D : type == KV_F16 ? 2 * D : SI_Q8_0_BLOCK * ((D + 31) / 32);
}
enum { ACT_SILU = 0, ACT_RELU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_COUNT = 4 };
/* Activation precision of the integer formats: one int8 term per block of 32 (llama.cpp's Q8
 * activations; default) or two (about f32 accuracy). */
enum { ACT_INT8 = 0, ACT_PRECISE = 1 };

typedef struct {
    int fmt;
    int64_t rows, cols, kp, nb;
    int64_t row_bytes;          /* row stride of qs in bytes (>= the bytes of one row's values) */
    int64_t nd;                 /* scales (and mins) per row: nb, or 2nb for q6 (one per 16) */
    int64_t ds;                 /* row stride of d and m in f16 elements (>= nd) */
    const uint8_t *qs;
    const uint16_t *d;          /* f16 rows x nb (quantized formats), row r at d + r*ds */
    const uint16_t *m;          /* f16 rows x nb or NULL, row r at m + r*ds */
} qmat_t;

/* A column-grouped q4 weight (cols.c has the layout): rows x cols, np = rows rounded up to 64;
 * qs: ceil(cols/32) groups x 32 columns x np/2 bytes; d, m: f16, ceil(cols/32) x np. */
typedef struct {
    int64_t rows, cols, np;
    const uint8_t *qs;
    const uint16_t *d, *m;
} cmat_t;

/* Row-tiled q4 (FMT_TQ4, tiles.c has the layout): 16 rows per tile, TQ4_BLOCK_BYTES per tile
 * and block of 32 inputs (codes, then the 16 rows' f16 d and m). */
#define TQ4_ROWS 16
#define TQ4_BLOCK_BYTES 320
#define TQ6_BLOCK_BYTES 448 /* tq6: 256 bytes of low nibbles as tq4's, 128 of high bits, d of inputs 0-15, 16-31 */
/* tq4k: per tile and super-block of 256 inputs, 8 x 256 bytes of codes as tq4's, 192 of 6-bit
 * scales and mins, the 16 rows' f16 d and dmin */
#define TQ4K_BLOCK_BYTES 2304
/* offsets in a tq4k tile's super-block: the scales' (k = 0) or mins' (k = 1) plane of low
 * nibbles at TQ4K_LO + 64k and of high 2-bit parts at TQ4K_HI + 32k; the rows' f16 d at
 * TQ4K_D, dmin at TQ4K_D + 32 */
#define TQ4K_LO 2048
#define TQ4K_HI 2176
#define TQ4K_D 2240

/* the row-tiled formats (tiles.c): whole-matrix products only */
static inline int si_fmt_tiled(int fmt) { return fmt == FMT_TQ4 || fmt == FMT_TQ6 || fmt == FMT_TQ4K; }

/* T quantized activation vectors, token t at q + t*q_stride etc. */
typedef struct {
    int8_t *q;
    float *d, *s, *de;
    int64_t q_stride, d_stride, de_stride;
    int layout;
    /* pair = 1 (precise mode, opt-in): two-term activations x ~ d_hi*q_hi + d_lo*q_lo.
     * Virtual token 2t holds q_hi (d_hi, s = d_hi*sum(q_hi)), 2t+1 the quantized residual
     * q_lo of x - d_hi*q_hi (d_lo = max|residual|/127, s = d_lo*sum(q_lo)).  dot_q then takes T virtual
     * tokens (even), tiles never split a pair, and writes y[t] = y(2t) + y(2t+1). */
    int pair;
    /* avx512amx only: the same activations packed for the tile unit, 16 tokens at a time (see
     * kern_amx.c), or NULL; token t's group is t / 16 */
    uint8_t *tiles;
} xq_t;

/* Output addressing of a dot-product tile: element (row i, token t) -> y[i*ysr + t*yst]. */
typedef struct {
    float *y;
    int64_t ysr, yst;
} yout_t;

/* One instruction-set level's kernels.  All of them are single-threaded; the operations
 * (dense.c, sparse.c, norm_attn.c) split the work.  Row indices: `rows == NULL` means rows
 * i0..i1-1 themselves, else rows[i0..i1-1]. */
typedef struct {
    const char *name;
    /* quantize token vectors x[t*K ...] for t in [t0, t1) into xq */
    void (*quantize)(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq);
    /* integer formats: y[i, t] = W[row(i)] . x_t for i in [i0,i1), t in [0,T) */
    void (*dot_q)(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const xq_t *xq, int64_t T, const yout_t *out);
    /* float formats: x_t = x + t*xstride (f32) */
    void (*dot_f)(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const float *x, int64_t xstride, int64_t T, const yout_t *out);
    /* y[c0:c1] = sum_j h[j] * Wt[rows[j], c0:c1]; c0 is a multiple of 32 */
    void (*axpy)(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n,
                 int64_t c0, int64_t c1, float *y);
    /* read nbytes from p, return a value that depends on every byte (defeats dead-code) */
    uint64_t (*read_sum)(const uint8_t *p, int64_t nbytes);
    /* v[i] = act(v[i]) in place (ACT_* code) */
    void (*act)(int act, float *v, int64_t n);
    /* the neuron-record pass (sparse.c) prefetches whole records a block ahead (1) or leaves
     * the reads to the dot tiles' and the axpy's own prefetches (0); chosen per level by
     * benchmark, see rec_prefetch */
    int rec_prefetch_whole;
    /* single-token attention of up to SI_ATT_MAXG query heads over one KV head (see
     * si_attend_fn below), one per KV cache type (KV_*), for head sizes D that are multiples
     * of attend_w; NULL: the portable version in norm_attn.c */
    const struct si_attend_fns *attend;
    int attend_w;
    /* write one cache row (KV_* layout above) of D values x */
    void (*kv_store)(int type, const float *x, void *row, int64_t D);
    /* many-token products (T > 1) give each task a multiple of this many rows (0: 4), so that
     * a level whose tiles span more rows (avx512amx: 16) splits the same way for any thread
     * count */
    int matmul_row_align;
    /* NULL, or: pack token groups [g0, g1) of 16 tokens of xq (nb blocks) into xq->tiles, whose
     * size is tiles_bytes(nb) per group */
    void (*pack_tokens)(const xq_t *xq, int64_t nb, int64_t g0, int64_t g1);
    size_t (*tiles_bytes)(int64_t nb);
    /* column-grouped q4 (cols.c), one group's kept columns in nq quads: p[4q + t] the column's
     * address, byte t of xw[q] its int8 value (columns repeated with value 0 fill the last quad);
     * y[r] += dx * d[r] * sum_j q_j * code(r, j) + m[r] * sx for r < Np; NULL: the portable version */
    void (*cols_group)(const uint8_t *const *p, const uint32_t *xw, int nq, int64_t Np, const uint16_t *d,
                       const uint16_t *m, float dx, float sx, float *y);
    /* row-tiled q4 (tiles.c): tiles [t0, t1) of w (FMT_TQ4) against T tokens quantized in
     * XL_NATURAL (with xq->pair, token t's two terms are virtual tokens 2t and 2t+1 and both go
     * into its sum); row 16 * tile + i of token t goes to y[t * yst + 16 (tile - t0) + i];
     * every (row, token) is computed the same way for any T.  NULL: the portable version */
    void (*tiles_q4)(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y, int64_t yst);
    /* row-tiled q6 (tiles.c): as tiles_q4, with s16[v * (kp / 16) + j] the sum of virtual token
     * v's int8 codes over inputs 16j..16j+15 (for the codes' offset of 32) */
    void (*tiles_q6)(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, const int32_t *s16, int64_t T, float *y,
                     int64_t yst);
    /* row-tiled q4k (tiles.c): as tiles_q4 (FMT_TQ4K, XL_Q8K activations); NULL: the portable version */
    void (*tiles_q4k)(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y, int64_t yst);
    /* the XL_Q8K quantizer (as `quantize`), equal to si_quantize_q8k's values; NULL: that one */
    void (*quantize_q8k)(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq);
} kernels_t;

/* Products of up to this many tokens (batched decode: one token of each of a few sequences)
 * are memory-bound like one token's: the dot kernels walk their rows as for one token (4
 * row streams per core, see walk_init) and the weights are read once for all the tokens. */
#define FEW_TOKENS 8

/* de of one token from its block scales d (layout as described above) */
void si_fill_de(int layout, int64_t nb, const float *d, float *de);

/* Single-token attention of n query heads (rows of q, D floats) over one KV head's L cached
 * rows of K and V (si_kv_row_bytes(type, D) bytes each, layout KV_*): scores in sc (n x L),
 * output rows in o; D a multiple of the level's vector width, n <= SI_ATT_MAXG.
 * norm_attn.c's si_attend1 splits the heads and has the portable version. */
#define SI_ATT_MAXG 8
typedef void (*si_attend_fn)(const float *q, const void *K, const void *V, float *sc, float *o, int n, int64_t D,
                             int64_t L, float scale);
struct si_attend_fns {
    si_attend_fn by_type[KV_COUNT];
};
#if SI_X86
void si_act_avx2(int act, float *v, int64_t n); /* also the AVX-512 levels' */
extern const struct si_attend_fns si_attend_avx2;   /* 8-float vectors (kern_avx2.c); D a multiple of 8 */
extern const struct si_attend_fns si_attend_avx512; /* 16-float vectors (kern_avx512.c); D a multiple of 16 */
void si_softmax_rows_avx2(float *sc, int n, int64_t L);
void si_kv_store_avx2(int type, const float *x, void *row, int64_t D); /* F16C; also the AVX-512 levels' */
#endif
#ifndef ATT_LB
#define ATT_LB 64 /* positions per block of the P V product (their V rows stay in L1/L2) */
#endif

extern const kernels_t si_kernels_scalar;
/* the scalar level's activation quantizer and KV cache writer (kern_scalar.c), which levels
 * without their own use as they are */
void si_quantize_portable(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq);
void si_kv_store_portable(int type, const float *x, void *row, int64_t D);
/* the XL_Q8K quantizer of every level (kern_scalar.c): per super-block of 256 values
 * amax, d = amax/127, q = round(x * 127/amax) (ties to even), s = d*sum(q) per block of 32 */
void si_quantize_q8k(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq);
#if SI_ARM
extern const kernels_t si_kernels_neon;
extern const kernels_t si_kernels_neon_dotprod;
int si_arm_dotprod(void); /* the CPU has SDOT (runtime.c) */
extern const struct si_attend_fns si_attend_neon; /* 4-float vectors (kern_neon.c); D a multiple of 4 */
#endif
#if SI_X86
extern const kernels_t si_kernels_avx2;
extern const kernels_t si_kernels_avx512;
extern const kernels_t si_kernels_avx512vnni;
extern const kernels_t si_kernels_avx512amx;
int si_amx_supported(void);
#endif

static inline float si_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = (float)mant * 5.9604644775390625e-8f; /* 2^-24 */
        return sign ? -f : f;
    }
    if (e == 31) bits = sign | 0x7f800000u | (mant << 13);
    else bits = sign | ((e + 112u) << 23) | (mant << 13);
    memcpy(&f, &bits, 4);
    return f;
}

static inline float si_bf2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* f32 -> f16 rounded to nearest, ties to even (as F16C and torch round); NaN stays NaN,
 * magnitudes from 65520 up become infinity */
static inline uint16_t si_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;
    if (ax >= 0x477ff000u) return sign | 0x7c00u;
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, a multiple of 2^-24 (exact product) */
        float a;
        memcpy(&a, &ax, 4);
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    }
    /* drop 13 mantissa bits, rounding to nearest even; a carry into the exponent is correct */
    const uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u);
    return sign | (uint16_t)((r >> 13) - ((127u - 15u) << 10));
}

/* one KV_Q8_0 row of D values (layout above), portable; the SIMD levels produce the same bytes */
static inline void si_q8_0_row(const float *x, int64_t D, uint8_t *row) {
    for (int64_t b = 0; b * 32 < D; b++) {
        const float *xb = x + b * 32;
        const int64_t n = D - b * 32 < 32 ? D - b * 32 : 32;
        float amax = 0.0f;
        for (int64_t j = 0; j < n; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        uint8_t *blk = row + b * SI_Q8_0_BLOCK;
        const uint16_t h = si_f2h(d);
        memcpy(blk, &h, 2);
        for (int64_t j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(j < n ? lrintf(xb[j] * id) : 0);
    }
}

/* value i of a cache row of type KV_* (the portable kernels' reading) */
static inline float si_kv_value(int type, const void *row, int64_t i) {
    if (type == KV_F32) return ((const float *)row)[i];
    if (type == KV_F16) return si_h2f(((const uint16_t *)row)[i]);
    const uint8_t *blk = (const uint8_t *)row + (i >> 5) * SI_Q8_0_BLOCK;
    uint16_t d;
    memcpy(&d, blk, 2);
    return si_h2f(d) * (float)(int8_t)blk[2 + (i & 31)];
}

static inline int64_t si_row(const int32_t *rows, int64_t i) { return rows ? (int64_t)rows[i] : i; }

/* Tiles of a level's dot_q: 8 rows for one token (res[r] = W[rr[r]] . x, rows rn[] prefetched
 * meanwhile), and the [row][token] tile of one row and one token. */
typedef void (*si_tile8_fn)(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float *res);
typedef void (*si_tile1_fn)(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]);

/* dot_q's walk for one token over gathered rows (i1 - i0 >= 16): tiles of 8 rows, each from
 * its own eighth of [i0, i1), each tile prefetching the next, so that a core reads 8
 * scattered row streams at once; the rows after the last full tile one at a time.  Both
 * tiles compute a row the same way, so the results do not depend on the split. */
static inline void si_dot_rows8(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1, const xq_t *xq,
                                const yout_t *out, si_tile8_fn fn8, si_tile1_fn fn1) {
    const int64_t q = (i1 - i0) / 8;
    for (int64_t j = 0; j < q; j++) {
        int64_t rr[8], rn[8];
        for (int r = 0; r < 8; r++) {
            rr[r] = rows[i0 + r * q + j];
            rn[r] = j + 1 < q ? rows[i0 + r * q + j + 1] : rr[r];
        }
        float res[8];
        fn8(w, rr, rn, xq, res);
        for (int r = 0; r < 8; r++) out->y[(i0 + r * q + j) * out->ysr] = res[r];
    }
    for (int64_t i = i0 + 8 * q; i < i1; i++) {
        int64_t rr[4] = {rows[i]};
        float res[4][4];
        fn1(w, rr, rr, xq, res);
        out->y[i * out->ysr] = res[0][0];
    }
}

/* Byte offset of value j (0..31) of block b in a quantized activation of nb blocks. */
static inline int64_t si_xpos(int layout, int64_t nb, int64_t b, int j) {
    if (layout == XL_Q4 && b < (nb & ~(int64_t)3)) {
        int64_t g = b >> 2, i = b & 3;
        return g * 128 + (j < 16 ? i * 16 + j : 64 + i * 16 + (j - 16));
    }
    return b * 32 + j;
}

/* The FFN activations by code (ACT_*), one float at a time. */
static inline float si_act_apply(int act, float v) {
    switch (act) {
    case ACT_SILU: return v / (1.0f + expf(-v));
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    default: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    }
}

/* v[i] = act(v[i]) in place, one float at a time (the scalar level's `act`, and the SIMD
 * levels' for the activations they do not vectorize) */
static inline void si_act_each(int act, float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = si_act_apply(act, v[i]);
}

/* q6: code (0..63) of value j (0..31) of block b of a row of nb blocks (layout: quant.py) */
static inline int si_q6_code(const uint8_t *row, int64_t nb, int64_t b, int j) {
    const int64_t ng = nb / 4;
    const int lo = j < 16;
    if (b < 4 * ng) {
        const uint8_t *g = row + 96 * (b / 4);
        const int p = (int)(b % 4) * 16 + (j & 15);
        return ((g[p] >> (lo ? 0 : 4)) & 15) | (((g[64 + p % 32] >> (2 * (p / 32 + (lo ? 0 : 2)))) & 3) << 4);
    }
    const uint8_t *t = row + 96 * ng + 24 * (b - 4 * ng);
    return ((t[j & 15] >> (lo ? 0 : 4)) & 15) | (((t[16 + j % 8] >> (2 * (j / 8))) & 3) << 4);
}

/* q4k: the 6-bit scales (sc[i]) and mins (mn[i]) of the 8 sub-blocks from a super-block's
 * 12 scale bytes (GGUF's packing: sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7,
 * 4..7 in the nibbles of bytes 8..11 with their top 2 bits in the top bits of bytes 0..7).
 * Four at a time in 32-bit words: sc = bytes 0..3 of s0 | s1 << 32 etc. */
static inline void si_q4k_scale_min(const uint8_t *s12, uint32_t *sc_lo, uint32_t *sc_hi, uint32_t *mn_lo,
                                    uint32_t *mn_hi) {
    uint32_t a, b, c;
    memcpy(&a, s12, 4);
    memcpy(&b, s12 + 4, 4);
    memcpy(&c, s12 + 8, 4);
    *sc_lo = a & 0x3f3f3f3fu;
    *mn_lo = b & 0x3f3f3f3fu;
    *sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    *mn_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
}

/* A q4k super-block's header: its f16 d and dmin, and the 6-bit scales and mins of its 8
 * sub-blocks, 4 bytes each of sub-blocks 0-3 (sc[0], mn[0]) and 4-7 (sc[1], mn[1]). */
static inline void si_q4k_head(const uint8_t *blk, uint32_t sc[2], uint32_t mn[2], uint16_t *d, uint16_t *dmin) {
    memcpy(d, blk, 2);
    memcpy(dmin, blk + 2, 2);
    si_q4k_scale_min(blk + 4, &sc[0], &sc[1], &mn[0], &mn[1]);
}

/* q4k: the scale and min of sub-block i (0..7) of a super-block's 12 scale bytes (the
 * portable kernels' reading of si_q4k_scale_min) */
static inline void si_q4k_sub(const uint8_t *s12, int i, int *sc, int *mn) {
    uint32_t s[2], m[2];
    si_q4k_scale_min(s12, &s[0], &s[1], &m[0], &m[1]);
    *sc = (int)((s[i / 4] >> (8 * (i % 4))) & 63);
    *mn = (int)((m[i / 4] >> (8 * (i % 4))) & 63);
}

/* Number of lanes of `de` per token for a given kp (both layouts fit in 8 per block). */
static inline int64_t si_de_len(int64_t nb) { return 8 * nb + 16; }

#endif
