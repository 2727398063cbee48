/* Level "avx512amx": the AVX-512 VNNI kernels, with the many-token products of the integer
 * formats q8, q4 and q6 (prefill) on the AMX tile unit (TDPBSSD / TDPBUSD).
 *
 * One AMX step multiplies a 16 x 32 tile of weights (16 rows, one block of 32 values) by an
 * 8 x 64 tile of activations (16 tokens x one block, 4 consecutive values per token per tile
 * row: AMX's "VNNI" layout) into 16 x 16 int32 sums, one per (row, token) for that block.
 * The block sums are exact integers; each is then scaled like the VNNI tiles scale theirs:
 *     acc[r][t] += float(sum) * (d_w[r,b] * d_x[t,b])      (+ m_w[r,b] * s_x[t,b] with mins)
 * with the blocks in order.  q6 (a scale per 16 values) takes two steps of K = 16 per block
 * on its codes minus 32 (TDPBSSD), each scaled by its own d_w.  The float rounding differs
 * from the VNNI tiles (they sum 8 products per lane and reduce the 16 lanes at the end), so
 * on this level a matmul row
 * equals the gemv of that token within the kernels' error contract, not bit for bit; every
 * result is still independent of runs and thread counts (dense.c splits rows in multiples of
 * 16, see kernels_t.matmul_row_align, and tokens by a count that depends on K only).
 *
 * Rows and tokens that do not fill a 16 x 16 tile, the two-term activation mode
 * and single tokens (decode) take the VNNI kernels.  Why by hand: no maintained library
 * multiplies llama.cpp-style block-quantized weights on AMX from C (oneDNN's int8 GEMM wants
 * one scale per row, torch's CPU int8 paths want their own packed formats). */
#include "common.h"
/* AMX intrinsics need GCC >= 11 or clang >= 12; the tile state needs Linux's permission call */
#if SI_X86 && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SI_HAVE_AMX 1
#endif
#if SI_X86 && !SI_HAVE_AMX
/* without them the level exists but is never supported */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define SI_VNNI 1
#include "kern_avx512_impl.h"
int si_amx_supported(void) { return 0; }
const kernels_t si_kernels_avx512amx = {"avx512amx", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2, 0,
                                        &si_attend_avx512, 16, si_kv_store_avx2, 0, NULL, NULL, cols_group, tiles_q4, tiles_q6, tiles_q4k, quantize_q8k};
#elif SI_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
#define SI_VNNI 1
#include "kern_avx512_impl.h"

#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* CPU has AMX-TILE and AMX-INT8, and the kernel let this process use the tile data (Linux
 * >= 5.16 asks each process to request it).  Asked once. */
int si_amx_supported(void) {
    static int state = -1;
    if (state < 0) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int cpu = ((d >> 24) & 1) && ((d >> 25) & 1);
#ifdef SYS_arch_prctl
        state = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        state = 0;
#endif
    }
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* tiles: 0, 1 weights (16 rows x kb bytes); 2, 3 activations (kb/4 x 64); 4-7 sums (16 x 64).
 * kb = 32 (q8, q4: one block per step) or 16 (q6: one scale per 16 values). */
static void amx_config(int kb) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t == 2 || t == 3 ? kb / 4 : 16;
        cfg.colsb[t] = t < 2 ? kb : 64;
    }
    _tile_loadconfig(&cfg);
}

/* Per-thread scratch, grown on demand (the pool's threads live as long as the process). */
static __thread uint8_t *tl_buf;
static __thread size_t tl_cap;

static uint8_t *amx_scratch(size_t bytes) {
    if (bytes > tl_cap) {
        free(tl_buf);
        tl_cap = (bytes + 65535) & ~(size_t)65535;
        tl_buf = aligned_alloc(64, tl_cap);
        if (!tl_buf) abort();
    }
    return tl_buf;
}

/* q6 weights of 16 rows, blocks [b0, b0 + kb): wb[b][r][32] = q - 32 (int8, value order), and
 * the two scales of each block dw[2b + h][r].  Full groups of 4 blocks unpack 64 values per
 * 512-bit step (codes: see si_q6_code); tail blocks take the scalar path. */
static void pack_q6(const qmat_t *w, const int64_t *rr, int64_t b0, int64_t kb, int8_t *wb, float *dw) {
    const int64_t nb = w->nb, nfull = nb & ~(int64_t)3;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3), c32 = _mm512_set1_epi8(32);
    for (int r = 0; r < 16; r++) {
        const uint8_t *q = w->qs + rr[r] * w->row_bytes;
        const uint16_t *d = w->d + rr[r] * w->ds;
        int64_t b = b0;
        for (; b < b0 + kb && (b & 3); b++)
            for (int j = 0; j < 32; j++) wb[((b - b0) * 16 + r) * 32 + j] = (int8_t)(si_q6_code(q, nb, b, j) - 32);
        for (; b + 4 <= b0 + kb && b + 4 <= nfull; b += 4) {
            const uint8_t *g = q + 96 * (b / 4);
            const __m512i v = _mm512_loadu_si512(g);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(g + 64));
            const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            const __m512i lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi16(_mm512_and_si512(hh, m3), 4)), c32);
            const __m512i hi = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), m3), 4)), c32);
            int8_t lo_b[64], hi_b[64];
            _mm512_storeu_si512(lo_b, lo);
            _mm512_storeu_si512(hi_b, hi);
            for (int k = 0; k < 4; k++) {
                int8_t *dst = wb + ((b - b0 + k) * 16 + r) * 32;
                memcpy(dst, lo_b + 16 * k, 16);
                memcpy(dst + 16, hi_b + 16 * k, 16);
            }
        }
        for (; b < b0 + kb; b++)
            for (int j = 0; j < 32; j++) wb[((b - b0) * 16 + r) * 32 + j] = (int8_t)(si_q6_code(q, nb, b, j) - 32);
        for (int64_t s = 0; s < 2 * kb; s++) dw[s * 16 + r] = _cvtsh_ss(d[2 * b0 + s]);
    }
}

/* Weights of 16 rows, blocks [b0, b0 + kb): wb[b][r][32] as int8 (q8) or uint8 values 0..15
 * (q4, in value order: byte j's low nibble is value j, its high nibble value 16 + j); their
 * scales dw[b][r] and mins mw[b][r] as floats. */
static void pack_weights(const qmat_t *w, const int64_t *rr, int64_t b0, int64_t kb, int8_t *wb, float *dw, float *mw) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    if (w->fmt == FMT_Q6) {
        pack_q6(w, rr, b0, kb, wb, dw);
        return;
    }
    for (int r = 0; r < 16; r++) {
        const uint8_t *q = w->qs + rr[r] * w->row_bytes;
        const uint16_t *d = w->d + rr[r] * w->ds + b0, *m = w->m ? w->m + rr[r] * w->ds + b0 : NULL;
        for (int64_t b = 0; b < kb; b++) {
            int8_t *dst = wb + (b * 16 + r) * 32;
            if (w->fmt == FMT_Q8) {
                _mm256_store_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)(q + 32 * (b0 + b))));
            } else {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * (b0 + b)));
                _mm_store_si128((__m128i *)dst, _mm_and_si128(v, m4));
                _mm_store_si128((__m128i *)(dst + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            }
        }
        for (int64_t b = 0; b < kb; b += 16) {
            const __mmask16 mk = (__mmask16)(kb - b >= 16 ? 0xFFFF : (1u << (kb - b)) - 1);
            _mm512_mask_i32scatter_ps(dw + b * 16 + r, mk, idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, d + b)), 4);
            if (mw) /* only with mins */
                _mm512_mask_i32scatter_ps(mw + b * 16 + r, mk, idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, m + b)), 4);
        }
    }
}

/* Bytes of one packed group of 16 tokens: per block 8 x 64 activation bytes (row k holding
 * values 4k..4k+3 of every token), then d_x[b][16] and s_x[b][16]. */
static size_t tiles_bytes(int64_t nb) { return (size_t)nb * 640; }

static void pack_tokens(const xq_t *xq, int64_t nb, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        int8_t *xb = (int8_t *)xq->tiles + g * tiles_bytes(nb);
        float *xd = (float *)(xb + nb * 512), *xs = xd + nb * 16;
        for (int t = 0; t < 16; t++) {
            const int64_t tok = 16 * g + t;
            const int8_t *q = xq->q + tok * xq->q_stride;
            const float *d = xq->d + tok * xq->d_stride, *s = xq->s + tok * xq->d_stride;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *v0 = q + si_xpos(xq->layout, nb, b, 0), *v1 = q + si_xpos(xq->layout, nb, b, 16);
                int32_t *dst = (int32_t *)(xb + b * 512) + t;
                for (int k = 0; k < 4; k++) memcpy(dst + 16 * k, v0 + 4 * k, 4);
                for (int k = 0; k < 4; k++) memcpy(dst + 16 * (4 + k), v1 + 4 * k, 4);
                xd[b * 16 + t] = d[b];
                xs[b * 16 + t] = s[b];
            }
        }
    }
}

/* acc (16 rows x 16 tokens, in/out) over blocks [0, kb) of packed weights and one packed
 * token group (xb, xd, xs already offset to the first block).
 *
 * Work comes in units: a block (q8, q4: K = 32) or half a block (q6: K = 16, its own scale).
 * Pairs of units alternate between two sets of result tiles, so the tile unit computes pair
 * p + 1 while the vector unit scales pair p (a result read right after its product waits
 * for the whole product).  Tiles: 0, 1 weights; 2, 3 activations; 4-7 results. */
#define UA(u) (q6 ? wb + ((u) >> 1) * 512 + ((u) & 1) * 16 : wb + (u) * 512)
#define UB(u) (q6 ? xb + ((u) >> 1) * 512 + ((u) & 1) * 256 : xb + (u) * 512)
#define DP(c, a, b) do { if (sgn) _tile_dpbssd(c, a, b); else _tile_dpbusd(c, a, b); } while (0)
#define PAIR(u, n, c0, c1) do {                                   \
        _tile_loadd(0, UA(u), 32);                                \
        _tile_loadd(2, UB(u), 64);                                \
        _tile_zero(c0);                                           \
        DP(c0, 0, 2);                                             \
        if ((n) > 1) {                                            \
            _tile_loadd(1, UA((u) + 1), 32);                      \
            _tile_loadd(3, UB((u) + 1), 64);                      \
            _tile_zero(c1);                                       \
            DP(c1, 1, 3);                                         \
        }                                                         \
    } while (0)
/* The 16 accumulators are named variables (a0..a15), not an array: with an array GCC kept
 * them in memory around the tile instructions, which made the scaling much slower. */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define SCALE_R(r) a##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r)), \
                                          _mm512_mul_ps(_mm512_set1_ps(dwp[r]), xdv), a##r);
#define MTERM_R(r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(mwp[r]), xsv, a##r);
/* acc += float(sums of unit u, in cb) * (dw * d_x) (+ mw * s_x) */
#define SCALE(u, cb_) do {                                        \
        const int32_t *cb = (cb_);                                \
        const float *dwp = dw + (u) * 16;                         \
        const __m512 xdv = _mm512_loadu_ps(xd + ((u) >> q6) * 16); \
        ROWS(SCALE_R)                                             \
        if (mw) {                                                 \
            const float *mwp = mw + (u) * 16;                     \
            const __m512 xsv = _mm512_loadu_ps(xs + ((u) >> q6) * 16); \
            ROWS(MTERM_R)                                         \
        }                                                         \
    } while (0)
#define FINISH(u, n, c0, c1) do {                                 \
        _tile_stored(c0, c[0], 64);                               \
        SCALE(u, c[0]);                                           \
        if ((n) > 1) {                                            \
            _tile_stored(c1, c[1], 64);                           \
            SCALE((u) + 1, c[1]);                                 \
        }                                                         \
    } while (0)

static void tile16(const int8_t *wb, const float *dw, const float *mw, const int8_t *xb, const float *xd,
                   const float *xs, int64_t kb, int sgn, int q6, float *accp) {
#define LOAD_R(r) __m512 a##r = _mm512_load_ps(accp + 16 * r);
#define STORE_R(r) _mm512_store_ps(accp + 16 * r, a##r);
    ROWS(LOAD_R)
    int32_t c[2][256] __attribute__((aligned(64)));
    const int64_t nu = q6 ? 2 * kb : kb;
#define NP(u) (nu - (u) >= 2 ? 2 : 1)
    /* pairs at units 0, 2, 4, ...: even pairs in tiles 4, 5, odd pairs in 6, 7 */
    PAIR(0, NP(0), 4, 5);
    int64_t u = 0;
    for (;;) {
        if (u + 2 < nu) PAIR(u + 2, NP(u + 2), 6, 7);
        FINISH(u, NP(u), 4, 5);
        u += 2;
        if (u >= nu) break;
        if (u + 2 < nu) PAIR(u + 2, NP(u + 2), 4, 5);
        FINISH(u, NP(u), 6, 7);
        u += 2;
        if (u >= nu) break;
    }
#undef NP
    ROWS(STORE_R)
#undef LOAD_R
#undef STORE_R
}
#undef UA
#undef UB
#undef DP
#undef PAIR
#undef FINISH
#undef SCALE
#undef SCALE_R
#undef MTERM_R
#undef ROWS

#define AMX_KB 64 /* blocks per K step: 16 rows of weights = 32 KB, a token group's = 40 KB */

static void amx_dot_q(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                      const xq_t *xq, int64_t T, const yout_t *out) {
    const int64_t nr = (i1 - i0) & ~(int64_t)15, nt = T & ~(int64_t)15, nb = w->nb;
    if (!xq->tiles || xq->pair || nr == 0 || nt == 0) {
        dot_q(w, rows, i0, i1, xq, T, out);
        return;
    }
    const int q6 = w->fmt == FMT_Q6, sgn = w->fmt != FMT_Q4, has_m = w->m != NULL;
    const int64_t ng = nt / 16, nrg = nr / 16;
    /* scratch: weights of 16 rows for one K step, their scales, and the accumulators */
    const size_t wbytes = (size_t)AMX_KB * 512, fbytes = (size_t)AMX_KB * 128, abytes = (size_t)nrg * ng * 1024;
    uint8_t *s = amx_scratch(wbytes + 2 * fbytes + abytes);
    int8_t *wb = (int8_t *)s;
    float *dw = (float *)(s + wbytes), *mw = has_m ? (float *)(s + wbytes + fbytes) : NULL;
    float *acc = (float *)(s + wbytes + 2 * fbytes);
    memset(acc, 0, abytes);
    const size_t gbytes = tiles_bytes(nb);
    amx_config(q6 ? 16 : 32);
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_KB) {
        const int64_t kb = nb - b0 < AMX_KB ? nb - b0 : AMX_KB;
        for (int64_t ig = 0; ig < nrg; ig++) {
            int64_t rr[16];
            for (int r = 0; r < 16; r++) rr[r] = si_row(rows, i0 + 16 * ig + r);
            pack_weights(w, rr, b0, kb, wb, dw, mw);
            for (int64_t g = 0; g < ng; g++) {
                const int8_t *xb = (const int8_t *)xq->tiles + g * gbytes;
                const float *xd = (const float *)(xb + nb * 512) + b0 * 16, *xs = xd + nb * 16;
                tile16(wb, dw, mw, xb + b0 * 512, xd, xs, kb, sgn, q6, acc + (ig * ng + g) * 256);
            }
        }
    }
    _tile_release();
    /* write back: with ysr == 1 (matmul: y[t][row]) a token's 16 rows are one vector */
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    float *y = out->y;
    const int64_t ysr = out->ysr, yst = out->yst;
    for (int64_t ig = 0; ig < nrg; ig++)
        for (int64_t g = 0; g < ng; g++) {
            const float *res = acc + (ig * ng + g) * 256;
            if (ysr == 1) {
                for (int t = 0; t < 16; t++)
                    _mm512_storeu_ps(y + i0 + 16 * ig + (16 * g + t) * yst, _mm512_i32gather_ps(col, res + t, 4));
            } else {
                for (int r = 0; r < 16; r++)
                    for (int t = 0; t < 16; t++) y[(i0 + 16 * ig + r) * ysr + (16 * g + t) * yst] = res[16 * r + t];
            }
        }
    /* the rest on the VNNI tiles: leftover rows with every token, leftover tokens of the tiled rows */
    if (i0 + nr < i1) dot_q(w, rows, i0 + nr, i1, xq, T, out);
    if (nt < T) {
        xq_t sub = *xq;
        sub.q += nt * xq->q_stride;
        sub.d += nt * xq->d_stride;
        sub.s += nt * xq->d_stride;
        sub.de += nt * xq->de_stride;
        sub.tiles = NULL;
        yout_t o = {out->y + nt * out->yst, out->ysr, out->yst};
        dot_q(w, rows, i0, i0 + nr, &sub, T - nt, &o);
    }
}

const kernels_t si_kernels_avx512amx = {"avx512amx", quantize, amx_dot_q, dot_f, axpy, read_sum, si_act_avx2, 0,
                                        &si_attend_avx512, 16, si_kv_store_avx2, 16, pack_tokens, tiles_bytes, cols_group, tiles_q4, tiles_q6, tiles_q4k, quantize_q8k};
#else
typedef int si_empty_translation_unit;
#endif
