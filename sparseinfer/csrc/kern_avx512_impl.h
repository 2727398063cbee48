/* AVX-512 kernels, included by kern_avx512.c (SI_VNNI 0) and kern_avx512vnni.c (SI_VNNI 1),
 * each of which sets the target ISA for the whole file with `#pragma GCC target`.
 *
 * Dot products are computed in tiles of R rows x T tokens (R, T in {1, 4}); every (row,
 * token) result goes through the same sequence of operations whatever the tile shape, so a
 * row's result never depends on how rows are split between threads or tiles (gemv ==
 * gemv_rows == one row of matmul, bit for bit). */
#include <immintrin.h>
#include "common.h"

#define AI static inline __attribute__((always_inline))

#if SI_VNNI
#define DP512(acc, a, b) _mm512_dpbusd_epi32((acc), (a), (b))
#define DP256(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#else
/* u8 x s8 pairs summed to i16 never saturate here: |w| <= 128 (q8 as abs) or 15 (q4) and
 * |x| <= 127, so 2 * 128 * 127 < 32767. */
#define DP512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((a), (b)), _mm512_set1_epi16(1)))
#define DP256(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((a), (b)), _mm256_set1_epi16(1)))
#endif

/* ---------------------------------------------------------------- activation quantizer */

/* 32 values (v0, v1) times vid, rounded to nearest even, as int8 at q0 (the first 16) and q1;
 * returns their sum */
AI int32_t quant32(__m512 v0, __m512 v1, __m512 vid, int8_t *q0, int8_t *q1) {
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    _mm_storeu_si128((__m128i *)q0, _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)q1, _mm512_cvtsepi32_epi8(i1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
}

static void quantize(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    const int64_t nb = kp / 32, nfull = nb & ~(int64_t)3;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        float *de = xq->de + t * xq->de_stride;
        for (int64_t b = 0; b < nb; b++) {
            int64_t n = K - b * 32;
            __mmask16 m0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
            __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
            __m512 v0 = _mm512_maskz_loadu_ps(m0, xt + b * 32);
            __m512 v1 = _mm512_maskz_loadu_ps(m1, xt + b * 32 + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
            const int32_t isum = quant32(v0, v1, _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f),
                                         q + si_xpos(xq->layout, nb, b, 0), q + si_xpos(xq->layout, nb, b, 16));
            d[b] = amax / 127.0f;
            s[b] = d[b] * (float)isum; /* d * sum(q), see kern_scalar.c */
        }
        if (xq->layout == XL_Q4) {
            const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            for (int64_t g = 0; g < nfull / 4; g++)
                _mm512_storeu_ps(de + 16 * g, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(d + 4 * g))));
        } else {
            const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            for (int64_t p = 0; p < nb / 2; p++)
                _mm512_storeu_ps(de + 16 * p, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(d + 2 * p))))));
        }
    }
}

/* XL_Q8K (common.h): one scale per super-block of 256 values, block sums per 32; the same
 * values as si_quantize_q8k (kern_scalar.c), the reference: one product and one rounding to
 * nearest even per value; masked loads past K read zeros. */
static void quantize_q8k(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    const int64_t nb = kp / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int64_t k0 = 32 * b0, nbl = nb - b0 < 8 ? nb - b0 : 8;
            __m512 v[16], mx = _mm512_setzero_ps();
            for (int i = 0; i < 2 * nbl; i++) {
                const int64_t n = K - k0 - 16 * i;
                const __mmask16 m = n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                v[i] = _mm512_maskz_loadu_ps(m, xt + k0 + 16 * i);
                mx = _mm512_max_ps(_mm512_and_ps(v[i], absmask), mx); /* a NaN value is passed over, as the reference does */
            }
            const float amax = _mm512_reduce_max_ps(mx);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f, db = amax / 127.0f;
            const __m512 vid = _mm512_set1_ps(id);
            for (int b = 0; b < nbl; b++) {
                const int32_t isum = quant32(v[2 * b], v[2 * b + 1], vid, q + k0 + 32 * b, q + k0 + 32 * b + 16);
                d[b0 + b] = db;
                s[b0 + b] = db * (float)isum;
            }
        }
    }
}

/* ------------------------------------------------------------------ integer dot tiles */

AI __m512 expand4(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}
AI __m512 expand8(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}
AI __m512 zext256(__m256 v) { return _mm512_insertf32x8(_mm512_setzero_ps(), v, 0); }

/* m-term: acc[r * as + t] += sum_b m[r][b] * s_t[b], 16 blocks per step (as: 4 for the
 * [row][token] tiles, 1 for the one-token tiles' rows of up to 8). */
AI void mterm(const qmat_t *w, const uint16_t *const *mp, const xq_t *xq, const int R, const int T, __m512 *acc,
              const int as) {
    const int64_t nb = w->nb;
    for (int64_t k = 0; k < nb; k += 16) {
        __mmask16 mk = nb - k >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - k)) - 1);
        __m512 mv[8];
        for (int r = 0; r < R; r++) mv[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, mp[r] + k));
        for (int t = 0; t < T; t++) {
            __m512 sv = _mm512_maskz_loadu_ps(mk, xq->s + t * xq->d_stride + k);
            for (int r = 0; r < R; r++) acc[r * as + t] = _mm512_fmadd_ps(mv[r], sv, acc[r * as + t]);
        }
    }
}

/* Prefetch hint of the one-token dot tiles (rows and scales) and the axpy: T0 (into L1).  On
 * scattered rows it reads faster than T1 in gemv_rows and axpy_rows, and dense gemv does not
 * care (compare with `python benchmarks/kernels.py`).  The matmul tiles and the neuron-record
 * pass (sparse.c) keep T1: records gain nothing from T0. */
AI void pfx(const char *p) { _mm_prefetch(p, _MM_HINT_T0); }

/* Software prefetch of the next tile's rows (the hardware prefetchers alone leave a core far
 * short of its share of DRAM bandwidth on short row streams): their scales now,
 * their data one cache line per line consumed here.  Without a next tile, rows are
 * "prefetched" again (harmless hits). */
AI void prefetch_next(const qmat_t *w, const int64_t *rn, const int R, const uint8_t **pf) {
    for (int r = 0; r < R; r++) {
        pf[r] = w->qs + rn[r] * w->row_bytes;
        if (w->d) {
            const char *d = (const char *)(w->d + rn[r] * w->ds), *m = w->m ? (const char *)(w->m + rn[r] * w->ds) : NULL;
            for (int64_t o = 0; o < w->nd * 2 + 63; o += 64) {
                pfx(d + o);
                if (m) pfx(m + o);
            }
        }
    }
}

AI void q4_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T, float res[4][4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[4];
    const uint16_t *dp[4], *mp[4];
    __m512 acc[4][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    const uint8_t *pf[4];
    prefetch_next(w, rn, R, pf);
    const __m512i m4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    for (int64_t g = 0; g < ng; g++) {
        __m512i lo[4], hi[4];
        __m512 dw[4];
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(pf[r] + 64 * g), _MM_HINT_T1);
            __m512i v = _mm512_loadu_si512(qp[r] + 64 * g);
            lo[r] = _mm512_and_si512(v, m4);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            dw[r] = expand4(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(dp[r] + 4 * g))));
        }
        for (int t = 0; t < T; t++) {
            const int8_t *xb = xq->q + t * xq->q_stride + 128 * g;
            __m512i xl = _mm512_loadu_si512(xb), xh = _mm512_loadu_si512(xb + 64);
            __m512 de = _mm512_loadu_ps(xq->de + t * xq->de_stride + 16 * g);
            for (int r = 0; r < R; r++) {
                __m512i p = DP512(DP512(z, lo[r], xl), hi[r], xh);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[r], de), acc[r][t]);
            }
        }
    }
    const __m128i m4x = _mm_set1_epi8(0x0F);
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qp[r] + 16 * b));
            __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x), _mm_and_si128(v, m4x));
            float dwr = _cvtsh_ss(dp[r][b]);
            for (int t = 0; t < T; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + t * xq->q_stride + 32 * b));
                __m256i p = DP256(_mm256_setzero_si256(), wv, xv);
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dwr * xq->d[t * xq->d_stride + b]));
                acc[r][t] = _mm512_add_ps(acc[r][t], zext256(f));
            }
        }
    }
    if (w->m) mterm(w, mp, xq, R, T, &acc[0][0], 4);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}

AI void q8_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T, float res[4][4]) {
    const int64_t nb = w->nb, np = nb >> 1;
    const uint8_t *qp[4];
    const uint16_t *dp[4], *mp[4];
    __m512 acc[4][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    const uint8_t *pf[4];
    prefetch_next(w, rn, R, pf);
    const __m512i z = _mm512_setzero_si512();
    for (int64_t p = 0; p < np; p++) {
        __m512i wa[4];
        __mmask64 wn[4];
        __m512 dw[4];
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(pf[r] + 64 * p), _MM_HINT_T1);
            __m512i v = _mm512_loadu_si512(qp[r] + 64 * p);
            wa[r] = _mm512_abs_epi8(v); /* -128 -> 0x80 = 128 as unsigned: still exact */
            wn[r] = _mm512_movepi8_mask(v);
            int32_t d2;
            memcpy(&d2, dp[r] + 2 * p, 4);
            dw[r] = expand8(_mm_cvtph_ps(_mm_cvtsi32_si128(d2)));
        }
        for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_loadu_si512(xq->q + t * xq->q_stride + 64 * p);
            __m512 de = _mm512_loadu_ps(xq->de + t * xq->de_stride + 16 * p);
            for (int r = 0; r < R; r++) {
                __m512i xs = _mm512_mask_sub_epi8(xv, wn[r], z, xv);
                __m512i pr = DP512(z, wa[r], xs);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pr), _mm512_mul_ps(dw[r], de), acc[r][t]);
            }
        }
    }
    if (nb & 1) {
        const int64_t b = nb - 1;
        for (int r = 0; r < R; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qp[r] + 32 * b));
            __m256i wa = _mm256_abs_epi8(v);
            __mmask32 wn = _mm256_movepi8_mask(v);
            float dwr = _cvtsh_ss(dp[r][b]);
            for (int t = 0; t < T; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + t * xq->q_stride + 32 * b));
                __m256i xs = _mm256_mask_sub_epi8(xv, wn, _mm256_setzero_si256(), xv);
                __m256i pr = DP256(_mm256_setzero_si256(), wa, xs);
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(pr), _mm256_set1_ps(dwr * xq->d[t * xq->d_stride + b]));
                acc[r][t] = _mm512_add_ps(acc[r][t], zext256(f));
            }
        }
    }
    if (w->m) mterm(w, mp, xq, R, T, &acc[0][0], 4);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Decode path (one token): the products d_w * d_x of 16 blocks are formed with one multiply
 * per row and expanded to the dot-product lanes with one permute per 64-byte step (the
 * generic tiles above spend four operations per step on it).  Same product, same fma: the
 * results equal the generic tiles' bit for bit. */
AI void q4_tile1(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, float *res) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[8];
    const uint16_t *dp[8], *mp[8];
    __m512 acc[8];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        acc[r] = _mm512_setzero_ps();
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf);
    const __m512i m4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    const __m512i four = _mm512_set1_epi32(4);
    /* The next tile's rows are a whole row ahead of these: for rows of 2 KB and more that is
     * too far for L1 (4-8 rows of it would sit there), so they go to L2 instead; on AMD EPYC
     * (Zen 4) that read 1536x8960 q4 products faster and short rows no slower
     * (`python benchmarks/kernels.py`). */
    const int long_rows = w->row_bytes >= 2048;
    for (int64_t g0 = 0; g0 < ng; g0 += 4) {
        const int nsub = ng - g0 >= 4 ? 4 : (int)(ng - g0);
        const __mmask16 mk = (__mmask16)((1u << (4 * nsub)) - 1);
        __m512 xd = _mm512_maskz_loadu_ps(mk, xq->d + 4 * g0);
        __m512 s16[8];
        for (int r = 0; r < R; r++) s16[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, dp[r] + 4 * g0)), xd);
        __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (int gg = 0; gg < nsub; gg++) {
            const int64_t g = g0 + gg;
            const int8_t *xb = xq->q + 128 * g;
            __m512i xl = _mm512_loadu_si512(xb), xh = _mm512_loadu_si512(xb + 64);
            for (int r = 0; r < R; r++) {
                if (long_rows) _mm_prefetch((const char *)(pf[r] + 64 * g), _MM_HINT_T1);
                else pfx((const char *)(pf[r] + 64 * g));
                __m512i v = _mm512_loadu_si512(qp[r] + 64 * g);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                __m512i p = DP512(DP512(z, lo, xl), hi, xh);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, s16[r]), acc[r]);
            }
            idx = _mm512_add_epi32(idx, four);
        }
    }
    const __m128i m4x = _mm_set1_epi8(0x0F);
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qp[r] + 16 * b));
            __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x), _mm_and_si128(v, m4x));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + 32 * b));
            __m256i p = DP256(_mm256_setzero_si256(), wv, xv);
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(dp[r][b]) * xq->d[b]));
            acc[r] = _mm512_add_ps(acc[r], zext256(f));
        }
    }
    if (w->m) mterm(w, mp, xq, R, 1, acc, 1);
    for (int r = 0; r < R; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

AI void q8_tile1(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, float *res) {
    const int64_t nb = w->nb, np = nb >> 1;
    const uint8_t *qp[8];
    const uint16_t *dp[8], *mp[8];
    __m512 acc[8];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        acc[r] = _mm512_setzero_ps();
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf);
    const __m512i z = _mm512_setzero_si512(), two = _mm512_set1_epi32(2);
    for (int64_t p0 = 0; p0 < np; p0 += 8) {
        const int nsub = np - p0 >= 8 ? 8 : (int)(np - p0);
        const __mmask16 mk = (__mmask16)((1u << (2 * nsub)) - 1);
        __m512 xd = _mm512_maskz_loadu_ps(mk, xq->d + 2 * p0);
        __m512 s16[8];
        for (int r = 0; r < R; r++) s16[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, dp[r] + 2 * p0)), xd);
        __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int pp = 0; pp < nsub; pp++) {
            const int64_t p = p0 + pp;
            __m512i xv = _mm512_loadu_si512(xq->q + 64 * p);
            for (int r = 0; r < R; r++) {
                pfx((const char *)(pf[r] + 64 * p));
                __m512i v = _mm512_loadu_si512(qp[r] + 64 * p);
                __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(v), z, xv);
                __m512i pr = DP512(z, _mm512_abs_epi8(v), xs);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pr), _mm512_permutexvar_ps(idx, s16[r]), acc[r]);
            }
            idx = _mm512_add_epi32(idx, two);
        }
    }
    if (nb & 1) {
        const int64_t b = nb - 1;
        for (int r = 0; r < R; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qp[r] + 32 * b));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + 32 * b));
            __m256i xs = _mm256_mask_sub_epi8(xv, _mm256_movepi8_mask(v), _mm256_setzero_si256(), xv);
            __m256i pr = DP256(_mm256_setzero_si256(), _mm256_abs_epi8(v), xs);
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(pr), _mm256_set1_ps(_cvtsh_ss(dp[r][b]) * xq->d[b]));
            acc[r] = _mm512_add_ps(acc[r], zext256(f));
        }
    }
    if (w->m) mterm(w, mp, xq, R, 1, acc, 1);
    for (int r = 0; r < R; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}


/* q6 (value = d16 * (q - 32), q in 0..63, a scale per 16 values).  A group of 4 blocks is 64
 * nibble bytes (q4 order, so the XL_Q4 activation lines up) and 32 bytes of 2-bit high parts:
 * the high parts of the 64 low-nibble values are fields 0 (positions 0..31) and 1 (32..63) of
 * those 32 bytes, those of the high-nibble values fields 2 and 3.  With the 32 bytes in both
 * halves of a register, one 64-bit rotate per half brings each value's field to bits 4..5.
 * Products: sum (q - 32) x = sum q x - 32 sum x; the second sum is the same for every row, so
 * each token's dot-product accumulator starts at -32 sum x.  Per 64-value half (sub-blocks
 * with their own scales): f = p_lo * d_lo + p_hi * d_hi, then acc += f * d_x. */

/* One q6 group of 4 blocks (96 bytes at gp, its 8 scales at dg) unpacked: codes of the low
 * and high 64-value halves (wl, wh) and their scales spread over the dot-product lanes. */
AI void q6_group(const uint8_t *gp, const uint16_t *dg, __m512i *wl, __m512i *wh, __m512 *dl, __m512 *dh) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i rot_lo = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), rot_hi = _mm512_set_epi64(62, 62, 62, 62, 0, 0, 0, 0);
    const __m512i ilo = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i ihi = _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1);
    __m512i v = _mm512_loadu_si512(gp);
    __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(gp + 64)));
    *wl = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_rolv_epi64(hb, rot_lo), m30));
    *wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(_mm512_rolv_epi64(hb, rot_hi), m30));
    __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dg)));
    *dl = _mm512_permutexvar_ps(ilo, d8);
    *dh = _mm512_permutexvar_ps(ihi, d8);
}

/* A block after the last full group (16 nibble bytes + 8 bytes of high parts at tp: value j in
 * byte j % 8, field j / 8; 64-bit lane c of the 32 values holds values 8c..8c+7, field c): its
 * 32 codes and its two scales (ds: the row's scales, b: the block). */
AI void q6_tail_block(const uint8_t *tp, const uint16_t *ds, int64_t b, __m256i *wv, __m256 *dv) {
    const __m128i m4x = _mm_set1_epi8(0x0F);
    const __m256i m30y = _mm256_set1_epi8(0x30), rot_t = _mm256_set_epi64x(62, 0, 2, 4);
    __m128i v = _mm_loadu_si128((const __m128i *)tp);
    int64_t h8;
    memcpy(&h8, tp + 16, 8);
    *wv = _mm256_or_si256(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x), _mm_and_si128(v, m4x)),
                          _mm256_and_si256(_mm256_rolv_epi64(_mm256_set1_epi64x(h8), rot_t), m30y));
    *dv = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(ds[2 * b + 1])), _mm_set1_ps(_cvtsh_ss(ds[2 * b])));
}

/* A tail block's contribution to one token's accumulator (lower 8 lanes): its codes wv and
 * scales dv (q6_tail_block) against the token's 32 quantized values xb of scale dx. */
AI __m256 q6_tail_term(__m256i wv, __m256 dv, const int8_t *xb, float dx) {
    const __m256i c32y = _mm256_set1_epi8(32), zy = _mm256_setzero_si256();
    __m256i xv = _mm256_loadu_si256((const __m256i *)xb);
    __m256i p = DP256(_mm256_sub_epi32(zy, DP256(zy, c32y, xv)), wv, xv);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p), dv), _mm256_set1_ps(dx));
}

AI void q6_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T, float res[4][4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[4];
    const uint16_t *dp[4];
    __m512 acc[4][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    const uint8_t *pf[4];
    prefetch_next(w, rn, R, pf);
    const __m512i c32 = _mm512_set1_epi8(32), z = _mm512_setzero_si512();
    const int l1 = w->row_bytes < 2048; /* the next tile's rows: into L1 if short, L2 if long (q4_tile1) */
    for (int64_t g = 0; g < ng; g++) {
        __m512i wl[4], wh[4];
        __m512 dl[4], dh[4];
        for (int r = 0; r < R; r++) {
            if (l1) {
                pfx((const char *)(pf[r] + 96 * g));
                pfx((const char *)(pf[r] + 96 * g + 64));
            } else {
                _mm_prefetch((const char *)(pf[r] + 96 * g), _MM_HINT_T1);
                _mm_prefetch((const char *)(pf[r] + 96 * g + 64), _MM_HINT_T1);
            }
            q6_group(qp[r] + 96 * g, dp[r] + 8 * g, &wl[r], &wh[r], &dl[r], &dh[r]);
        }
        for (int t = 0; t < T; t++) {
            const int8_t *xb = xq->q + t * xq->q_stride + 128 * g;
            __m512i xl = _mm512_loadu_si512(xb), xh = _mm512_loadu_si512(xb + 64);
            __m512 de = _mm512_loadu_ps(xq->de + t * xq->de_stride + 16 * g);
            __m512i nl = _mm512_sub_epi32(z, DP512(z, c32, xl)), nh = _mm512_sub_epi32(z, DP512(z, c32, xh));
            for (int r = 0; r < R; r++) {
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(DP512(nl, wl[r], xl)), dl[r]);
                f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DP512(nh, wh[r], xh)), dh[r], f);
                acc[r][t] = _mm512_fmadd_ps(f, de, acc[r][t]);
            }
        }
    }
    /* blocks after the last full group */
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m256i wv;
            __m256 dv;
            q6_tail_block(qp[r] + 96 * ng + 24 * (b - 4 * ng), dp[r], b, &wv, &dv);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_add_ps(acc[r][t], zext256(q6_tail_term(wv, dv, xq->q + t * xq->q_stride + 32 * b,
                                                                          xq->d[t * xq->d_stride + b])));
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* q6_tile for one token and up to 8 rows, each row's work done in turn (8 rows' unpacked
 * values would not fit the registers): the same operations per row, so the same results. */
AI void q6_tile1(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, float *res) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[8];
    const uint16_t *dp[8];
    __m512 acc[8];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        acc[r] = _mm512_setzero_ps();
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf);
    const __m512i c32 = _mm512_set1_epi8(32), z = _mm512_setzero_si512();
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *xb = xq->q + 128 * g;
        __m512i xl = _mm512_loadu_si512(xb), xh = _mm512_loadu_si512(xb + 64);
        __m512 de = _mm512_loadu_ps(xq->de + 16 * g);
        __m512i nl = _mm512_sub_epi32(z, DP512(z, c32, xl)), nh = _mm512_sub_epi32(z, DP512(z, c32, xh));
        for (int r = 0; r < R; r++) {
            pfx((const char *)(pf[r] + 96 * g));
            pfx((const char *)(pf[r] + 96 * g + 64));
            __m512i wl, wh;
            __m512 dl, dh;
            q6_group(qp[r] + 96 * g, dp[r] + 8 * g, &wl, &wh, &dl, &dh);
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(DP512(nl, wl, xl)), dl);
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DP512(nh, wh, xh)), dh, f);
            acc[r] = _mm512_fmadd_ps(f, de, acc[r]);
        }
    }
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m256i wv;
            __m256 dv;
            q6_tail_block(qp[r] + 96 * ng + 24 * (b - 4 * ng), dp[r], b, &wv, &dv);
            acc[r] = _mm512_add_ps(acc[r], zext256(q6_tail_term(wv, dv, xq->q + 32 * b, xq->d[b])));
        }
    }
    for (int r = 0; r < R; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

/* q4k (GGUF Q4_K super-blocks as the file stores them, common.h) against XL_Q8K activations.
 * Code bytes 32c..32c+31 of a super-block hold sub-block 2c in their low nibbles and 2c+1 in
 * their high ones, while activation bytes 64c..64c+63 are those two sub-blocks in natural
 * order: the 32 code bytes are loaded into both halves of a register and shifted by 0 (lower
 * half) or 4 (upper), which lines the codes up with the activations as they are (no shuffle
 * of either; the same lanes for any number of tokens).  Codes times activations are summed in
 * int16 pairs (VPMADDUBSW: at most 2 * 15 * 127), multiplied by their sub-block's 6-bit scale
 * and summed to int32 (VPDPWSSD, or VPMADDWD + add without VNNI): the integer sums are exact,
 * so the float work per (row, token) is one multiply-add per 256 weights plus the mins term
 * (mn[i] times the activation's block sums s[i], lanes 0..7).  The rows of a tile are done one
 * after another (their sums stay in registers); R rows and T tokens only share the loop, so
 * every (row, token) is computed the same way for any R and T (a prompt row equals the
 * one-token result, gathered rows the dense ones). */
#if SI_VNNI
#define DPW512(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
/* VPSHUFB indices that put the int16 scale of sub-block 2c in 128-bit lanes 0-1 and of 2c+1
 * in lanes 2-3 */
AI __m512i q4k_scale_index(int c) {
    const int a = 2 * c, b = 2 * c + 1;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)((2 * a) | ((2 * a + 1) << 8)))),
                              _mm256_set1_epi16((short)((2 * b) | ((2 * b + 1) << 8))), 1);
}
AI void q4k_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T,
                 float (*res)[4]) {
    const int64_t ns = w->kp / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512(), sh = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const int l1 = T == 1 && w->row_bytes < 2048; /* the next tile's rows into L1, as q4_tile1 */
    for (int r = 0; r < R; r++) {
        const uint8_t *qp = w->qs + rr[r] * w->row_bytes, *pf = w->qs + rn[r] * w->row_bytes;
        __m512 acc[4], accm[4]; /* the d * sc * q terms and the mins terms */
        for (int t = 0; t < T; t++) acc[t] = accm[t] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < ns; sb++) {
            const uint8_t *blk = qp + sb * SI_Q4K_BYTES, *nb = pf + sb * SI_Q4K_BYTES;
            for (int o = 0; o <= SI_Q4K_BYTES; o += 48) { /* every line it spans (143 last) */
                const char *pa = (const char *)nb + (o < SI_Q4K_BYTES ? o : SI_Q4K_BYTES - 1);
                if (l1) pfx(pa);
                else _mm_prefetch(pa, _MM_HINT_T1);
            }
            uint32_t scw[2], mnw[2];
            uint16_t hd, hm;
            si_q4k_head(blk, scw, mnw, &hd, &hm);
            const __m512i scv = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)scw[1], (int)scw[0])));
            __m512i wc[4], sc[4];
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c)));
                wc[c] = _mm512_and_si512(_mm512_srlv_epi64(v, sh), m4); /* sub-block 2c | 2c+1 */
                sc[c] = _mm512_shuffle_epi8(scv, q4k_scale_index(c));
            }
            /* lanes 0..7: -dmin * mn[i]; lanes 8..15: 0 */
            const __m512 mneg = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mnw[1], (int)mnw[0]))),
                                              _mm512_set1_ps(-_cvtsh_ss(hm)));
            const float dw = _cvtsh_ss(hd);
            for (int t = 0; t < T; t++) {
                const int8_t *xb = xq->q + t * xq->q_stride + 256 * sb;
                /* two chains of two (latency), added: the same exact sum */
                const __m512i s0 = DPW512(DPW512(z, _mm512_maddubs_epi16(wc[0], _mm512_loadu_si512(xb)), sc[0]),
                                          _mm512_maddubs_epi16(wc[1], _mm512_loadu_si512(xb + 64)), sc[1]);
                const __m512i s1 = DPW512(DPW512(z, _mm512_maddubs_epi16(wc[2], _mm512_loadu_si512(xb + 128)), sc[2]),
                                          _mm512_maddubs_epi16(wc[3], _mm512_loadu_si512(xb + 192)), sc[3]);
                const float *dx = xq->d + t * xq->d_stride + 8 * sb, *sx = xq->s + t * xq->d_stride + 8 * sb;
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(dw * dx[0]), acc[t]);
                accm[t] = _mm512_fmadd_ps(mneg, _mm512_maskz_loadu_ps(0xFF, sx), accm[t]);
            }
        }
        for (int t = 0; t < T; t++) res[r][t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], accm[t]));
    }
}
#undef DPW512

#define TILE_FN(name, tile, R, T) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]) { \
        tile(w, rr, rn, xq, R, T, res); }
TILE_FN(q4_4x4, q4_tile, 4, 4)
/* one-token tiles: 8 rows (dot_q's one-token walk), 4 and 1 (the tile table's shape) */
#define TILE1_FN(name, tile, R) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]) { \
        float o[8]; \
        tile(w, rr, rn, xq, R, o); \
        for (int r = 0; r < R; r++) res[r][0] = o[r]; }
#define TILE8_FN(name, tile) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float *res) { \
        tile(w, rr, rn, xq, 8, res); }
TILE1_FN(q4_4x1, q4_tile1, 4)
TILE_FN(q4_1x4, q4_tile, 1, 4)
TILE1_FN(q4_1x1, q4_tile1, 1)
TILE8_FN(q4_8x1, q4_tile1)
TILE8_FN(q8_8x1, q8_tile1)
TILE8_FN(q6_8x1, q6_tile1)
/* q4k: one tile function for any R, T (q4k_tile's rows are walked one at a time) */
#define Q4K_FN(name, R, T) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]) { \
        q4k_tile(w, rr, rn, xq, R, T, res); }
Q4K_FN(q4k_4x4, 4, 4)
Q4K_FN(q4k_4x2, 4, 2)
Q4K_FN(q4k_4x1, 4, 1)
Q4K_FN(q4k_4x3, 4, 3)
Q4K_FN(q4k_1x4, 1, 4)
Q4K_FN(q4k_1x2, 1, 2)
Q4K_FN(q4k_1x1, 1, 1)
Q4K_FN(q4k_1x3, 1, 3)
static __attribute__((noinline)) void q4k_8x1(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float *res) {
    float o[8][4];
    q4k_tile(w, rr, rn, xq, 8, 1, o);
    for (int r = 0; r < 8; r++) res[r] = o[r][0];
}
TILE_FN(q4_4x2, q4_tile, 4, 2)
TILE_FN(q4_1x2, q4_tile, 1, 2)
TILE_FN(q4_4x3, q4_tile, 4, 3)
TILE_FN(q4_1x3, q4_tile, 1, 3)
TILE_FN(q8_4x4, q8_tile, 4, 4)
TILE1_FN(q8_4x1, q8_tile1, 4)
TILE_FN(q8_1x4, q8_tile, 1, 4)
TILE1_FN(q8_1x1, q8_tile1, 1)
TILE_FN(q8_4x2, q8_tile, 4, 2)
TILE_FN(q8_1x2, q8_tile, 1, 2)
TILE_FN(q8_4x3, q8_tile, 4, 3)
TILE_FN(q8_1x3, q8_tile, 1, 3)
TILE_FN(q6_4x4, q6_tile, 4, 4)
TILE_FN(q6_4x1, q6_tile, 4, 1)
TILE_FN(q6_1x4, q6_tile, 1, 4)
TILE_FN(q6_1x1, q6_tile, 1, 1)
TILE_FN(q6_4x2, q6_tile, 4, 2)
TILE_FN(q6_1x2, q6_tile, 1, 2)
TILE_FN(q6_4x3, q6_tile, 4, 3)
TILE_FN(q6_1x3, q6_tile, 1, 3)

typedef void (*qtile_fn)(const qmat_t *, const int64_t *, const int64_t *, const xq_t *, float[4][4]);
/* the tile for a format (q8, q4, q6, q4k: fmt - FMT_Q8), R (4, 1) and Tn (4, 2, 1, 3: index 3
 * is the three-token tile, for a batch of three rows or the rest of seven) */
static const qtile_fn QTILES[4][2][4] = {
    {{q8_4x4, q8_4x2, q8_4x1, q8_4x3}, {q8_1x4, q8_1x2, q8_1x1, q8_1x3}},
    {{q4_4x4, q4_4x2, q4_4x1, q4_4x3}, {q4_1x4, q4_1x2, q4_1x1, q4_1x3}},
    {{q6_4x4, q6_4x2, q6_4x1, q6_4x3}, {q6_1x4, q6_1x2, q6_1x1, q6_1x3}},
    {{q4k_4x4, q4k_4x2, q4k_4x1, q4k_4x3}, {q4k_1x4, q4k_1x2, q4k_1x1, q4k_1x3}},
};

/* Position of the r-th row of tile j: with one token, a tile takes its 4 rows from 4
 * separate quarters of [i0, i1) (row j of each), so each quarter is read front to back and
 * no two rows of a tile share a 4 KB page; short rows read in interleaved pairs within a
 * page defeat the hardware stream prefetcher (q4 dense gemv ran at half speed). */
typedef struct {
    int64_t i0, i1, q;
} walk_t;

AI walk_t walk_init(int64_t i0, int64_t i1, int64_t T) {
    walk_t wk = {i0, i1, T <= FEW_TOKENS ? (i1 - i0) / 4 : 0};
    return wk;
}
/* number of 4-row tiles; then positions for tile j */
AI int64_t walk_tiles(const walk_t *wk) { return wk->q ? wk->q : (wk->i1 - wk->i0) / 4; }
AI int64_t walk_pos(const walk_t *wk, int64_t j, int r) { return wk->q ? wk->i0 + r * wk->q + j : wk->i0 + 4 * j + r; }

static void dot_q(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const xq_t *xq, int64_t T, const yout_t *out) {
    const qtile_fn(*tiles)[4] = QTILES[w->fmt - FMT_Q8];
    const int P = xq->pair ? 1 : 0;
    if (T == 1 && !P && rows && i1 - i0 >= 16) {
        /* one token over gathered rows: tiles of 8 rows, each from its own eighth of [i0, i1),
         * so that a core reads 8 scattered row streams at once, which reads gathered rows
         * (gemv_rows, the records pass) faster than 4 (the quarters of walk_pos).  Dense rows
         * stay on 4 streams: 8 read tall matrices a little slower and the others no faster
         * (`python benchmarks/kernels.py` compares both). */
        static const si_tile8_fn TILE8[4] = {q8_8x1, q4_8x1, q6_8x1, q4k_8x1};
        si_dot_rows8(w, rows, i0, i1, xq, out, TILE8[w->fmt - FMT_Q8], tiles[1][2]);
        return;
    }
    const walk_t wk = walk_init(i0, i1, T >> P);
    const int64_t ntiles = walk_tiles(&wk), nrest = (i1 - i0) - 4 * ntiles;
    for (int64_t j = 0; j < ntiles + nrest; j++) {
        const int R = j < ntiles ? 4 : 1;
        int64_t pos[4], rr[4], rn[4];
        for (int r = 0; r < R; r++) {
            pos[r] = j < ntiles ? walk_pos(&wk, j, r) : i0 + 4 * ntiles + (j - ntiles);
            rr[r] = si_row(rows, pos[r]);
            rn[r] = j + 1 < ntiles ? si_row(rows, walk_pos(&wk, j + 1, r)) : rr[r];
        }
        for (int64_t t = 0; t < T;) {
            const int Tn = T - t >= 4 ? 4 : (int)(T - t);
            const qtile_fn fn = tiles[R == 4 ? 0 : 1][Tn == 4 ? 0 : Tn == 3 ? 3 : Tn == 2 ? 1 : 2];
            xq_t sub = *xq;
            sub.q += t * xq->q_stride;
            sub.d += t * xq->d_stride;
            sub.s += t * xq->d_stride;
            sub.de += t * xq->de_stride;
            float res[4][4];
            fn(w, rr, t + Tn < T ? rr : rn, &sub, res);
            if (P) {
                for (int r = 0; r < R; r++)
                    for (int u = 0; u < Tn; u += 2) out->y[pos[r] * out->ysr + ((t + u) >> 1) * out->yst] = res[r][u] + res[r][u + 1];
            } else {
                for (int r = 0; r < R; r++)
                    for (int u = 0; u < Tn; u++) out->y[pos[r] * out->ysr + (t + u) * out->yst] = res[r][u];
            }
            t += Tn;
        }
    }
}

/* -------------------------------------------------------------------- float dot tiles */

AI __m512 loadw(const int fmt, const uint8_t *p, int64_t k) {
    if (fmt == FMT_F32) return _mm512_loadu_ps((const float *)p + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (fmt == FMT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AI __m512 loadw_mask(const int fmt, const uint8_t *p, int64_t k, __mmask16 mk) {
    if (fmt == FMT_F32) return _mm512_maskz_loadu_ps(mk, (const float *)p + k);
    __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + k);
    if (fmt == FMT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI void f_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const float *x, int64_t xs, const int fmt,
               const int R, const int T, float res[4][4]) {
    const int64_t K = w->cols;
    const uint8_t *wp[4];
    __m512 acc[4][4];
    for (int r = 0; r < R; r++) {
        wp[r] = w->qs + rr[r] * w->row_bytes;
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    const uint8_t *pf[4];
    prefetch_next(w, rn, R, pf);
    const int esz = fmt == FMT_F32 ? 4 : 2;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        if (esz == 4 || !(k & 16))
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf[r] + k * esz), _MM_HINT_T1);
        for (int r = 0; r < R; r++) wv[r] = loadw(fmt, wp[r], k);
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_loadu_ps(x + t * xs + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (k < K) {
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[4];
        for (int r = 0; r < R; r++) wv[r] = loadw_mask(fmt, wp[r], k, mk);
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + t * xs + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}

#define FTILE_FN(name, fmt, R, T) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const float *x, int64_t xs, float res[4][4]) { \
        f_tile(w, rr, rn, x, xs, fmt, R, T, res); }
#define FTILE_SET(fn, FMT) \
    FTILE_FN(fn##_4x4, FMT, 4, 4) FTILE_FN(fn##_4x1, FMT, 4, 1) FTILE_FN(fn##_1x4, FMT, 1, 4) FTILE_FN(fn##_1x1, FMT, 1, 1)
FTILE_SET(f32, FMT_F32)
FTILE_SET(f16, FMT_F16)
FTILE_SET(bf16, FMT_BF16)

typedef void (*ftile_fn)(const qmat_t *, const int64_t *, const int64_t *, const float *, int64_t, float[4][4]);
static const ftile_fn FTILES[3][4] = {
    {f32_4x4, f32_4x1, f32_1x4, f32_1x1},
    {f16_4x4, f16_4x1, f16_1x4, f16_1x1},
    {bf16_4x4, bf16_4x1, bf16_1x4, bf16_1x1},
};

static void dot_f(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const float *x, int64_t xstride, int64_t T, const yout_t *out) {
    const walk_t wk = walk_init(i0, i1, T);
    const int64_t ntiles = walk_tiles(&wk), nrest = (i1 - i0) - 4 * ntiles;
    for (int64_t j = 0; j < ntiles + nrest; j++) {
        const int R = j < ntiles ? 4 : 1;
        int64_t pos[4], rr[4], rn[4];
        for (int r = 0; r < R; r++) {
            pos[r] = j < ntiles ? walk_pos(&wk, j, r) : i0 + 4 * ntiles + (j - ntiles);
            rr[r] = si_row(rows, pos[r]);
            rn[r] = j + 1 < ntiles ? si_row(rows, walk_pos(&wk, j + 1, r)) : rr[r];
        }
        for (int64_t t = 0; t < T;) {
            const int Tn = T - t >= 4 ? 4 : 1;
            float res[4][4];
            FTILES[w->fmt][(R == 4 ? 0 : 2) + (Tn == 4 ? 0 : 1)](w, rr, t + Tn < T ? rr : rn, x + t * xstride, xstride, res);
            for (int r = 0; r < R; r++)
                for (int u = 0; u < Tn; u++) out->y[pos[r] * out->ysr + (t + u) * out->yst] = res[r][u];
            t += Tn;
        }
    }
}

/* ------------------------------------------------------------------------------ axpy */

#define AXPY_MAXB 128 /* blocks of 32 columns per call: sparse.c keeps chunks <= 4096 columns */
#ifndef AXPY_PF
#define AXPY_PF 8    /* rows prefetched ahead */
#endif

/* Prefetch (into L2) the column segment [c0, c1) of the rows j..j+R-1, scales included. */
AI void axpy_prefetch(const qmat_t *wt, const int32_t *rows, int64_t j, int64_t n, const int R, int64_t c0, int64_t c1) {
    int64_t b0 = 0, b1 = 0, s0, s1;
    if (wt->fmt >= FMT_Q8) {
        b0 = c0 / 32;
        b1 = (c1 + 31) / 32;
        s0 = wt->fmt == FMT_Q8 ? b0 * 32 : b0 * 16;
        s1 = wt->fmt == FMT_Q8 ? b1 * 32 : b1 * 16;
    } else {
        int64_t e = wt->fmt == FMT_F32 ? 4 : 2;
        s0 = c0 * e;
        s1 = c1 * e;
    }
    for (int r = 0; r < R && j + r < n; r++) {
        const int64_t row = rows[j + r];
        const char *p = (const char *)(wt->qs + row * wt->row_bytes);
        for (int64_t o = s0 & ~(int64_t)63; o < s1; o += 64) pfx(p + o);
        if (wt->d) {
            const char *d = (const char *)(wt->d + row * wt->ds);
            for (int64_t o = (2 * b0) & ~(int64_t)63; o < 2 * b1; o += 64) pfx(d + o);
            if (wt->m) {
                const char *m = (const char *)(wt->m + row * wt->ds);
                for (int64_t o = (2 * b0) & ~(int64_t)63; o < 2 * b1; o += 64) pfx(m + o);
            }
        }
    }
}

AI __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* y[c] accumulates h_j * w_j[c] strictly in the order j = 0..n-1 (rows grouped by R only
 * to load y once per R rows), so the result is independent of the column split. */
AI void axpy_f_rows(const qmat_t *wt, const float *h, const int32_t *rows, int64_t j, const int R,
                    const int fmt, int64_t c0, int64_t c1, float *y, const uint8_t *const *pf) {
    const uint8_t *wp[4];
    __m512 hv[4];
    const int esz = fmt == FMT_F32 ? 4 : 2;
    for (int r = 0; r < R; r++) {
        wp[r] = wt->qs + (int64_t)rows[j + r] * wt->row_bytes;
        hv[r] = _mm512_set1_ps(h[j + r]);
    }
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        if (esz == 4 || !(c & 16))
            for (int r = 0; r < R; r++) pfx((const char *)(pf[r] + c * esz));
        __m512 yv = _mm512_loadu_ps(y + c);
        for (int r = 0; r < R; r++) yv = _mm512_fmadd_ps(hv[r], loadw(fmt, wp[r], c), yv);
        _mm512_storeu_ps(y + c, yv);
    }
    if (c < c1) {
        __mmask16 mk = lanes(c1 - c);
        __m512 yv = _mm512_maskz_loadu_ps(mk, y + c);
        for (int r = 0; r < R; r++) yv = _mm512_fmadd_ps(hv[r], loadw_mask(fmt, wp[r], c, mk), yv);
        _mm512_mask_storeu_ps(y + c, mk, yv);
    }
}

AI void axpy_q_rows(const qmat_t *wt, const float *h, const int32_t *rows, int64_t j, const int R,
                    const int fmt, int64_t c0, int64_t c1, float *y, float *ym, const uint8_t *const *pf) {
    const int64_t b0 = c0 / 32, nbc = (c1 - c0 + 31) / 32;
    const uint8_t *qp[8];
    float sc[8][AXPY_MAXB];
    for (int r = 0; r < R; r++) {
        int64_t row = rows[j + r];
        qp[r] = wt->qs + row * wt->row_bytes;
        const uint16_t *dp = wt->d + row * wt->ds + b0;
        __m512 hv = _mm512_set1_ps(h[j + r]);
        for (int64_t k = 0; k < nbc; k += 16) {
            __mmask16 mk = lanes(nbc - k);
            _mm512_storeu_ps(sc[r] + k, _mm512_mul_ps(hv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, dp + k))));
            if (wt->m) {
                const uint16_t *mp = wt->m + row * wt->ds + b0;
                __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, mp + k));
                _mm512_mask_storeu_ps(ym + k, mk, _mm512_fmadd_ps(hv, mv, _mm512_maskz_loadu_ps(mk, ym + k)));
            }
        }
    }
    /* vpermps reads only the low 4 bits of each index: float(low nibble) without a mask */
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int bpl = fmt == FMT_Q4 ? 4 : 2; /* blocks per cache line */
    for (int64_t b = 0; b < nbc; b++) {
        const int64_t c = (b0 + b) * 32;
        if (((b0 + b) % bpl) == 0)
            for (int r = 0; r < R; r++)
                pfx((const char *)(pf[r] + (fmt == FMT_Q4 ? 16 : 32) * (b0 + b)));
        const int full = c + 32 <= c1;
        const __mmask16 k0 = lanes(c1 - c), k1 = lanes(c1 - c - 16);
        __m512 y0 = full ? _mm512_loadu_ps(y + c) : _mm512_maskz_loadu_ps(k0, y + c);
        __m512 y1 = full ? _mm512_loadu_ps(y + c + 16) : _mm512_maskz_loadu_ps(k1, y + c + 16);
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_set1_ps(sc[r][b]);
            __m512 a, bb;
            if (fmt == FMT_Q4) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qp[r] + 16 * (b0 + b))));
                a = _mm512_permutexvar_ps(v, iota);
                bb = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota);
            } else {
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qp[r] + 32 * (b0 + b)))));
                bb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qp[r] + 32 * (b0 + b) + 16))));
            }
            y0 = _mm512_fmadd_ps(s, a, y0);
            y1 = _mm512_fmadd_ps(s, bb, y1);
        }
        if (full) {
            _mm512_storeu_ps(y + c, y0);
            _mm512_storeu_ps(y + c + 16, y1);
        } else {
            _mm512_mask_storeu_ps(y + c, k0, y0);
            _mm512_mask_storeu_ps(y + c + 16, k1, y1);
        }
    }
}

/* pf: rows AXPY_PF positions ahead (or the current ones near the end); their block scales
 * for this column chunk are prefetched here, their data by the kernels line by line. */
AI void axpy_pf_rows(const qmat_t *wt, const int32_t *rows, int64_t j, int64_t n, int64_t c0, int64_t c1,
                     const uint8_t **pf, const int R) {
    for (int r = 0; r < (R > 4 ? R : 4); r++) {
        int64_t k = j + AXPY_PF + r < n ? j + AXPY_PF + r : (j + r < n ? j + r : j);
        pf[r] = wt->qs + (int64_t)rows[k] * wt->row_bytes;
        if (wt->d && j + AXPY_PF + r < n) {
            const int64_t b0 = c0 / 32, b1 = (c1 + 31) / 32;
            const char *d = (const char *)(wt->d + (int64_t)rows[k] * wt->ds);
            for (int64_t o = (2 * b0) & ~(int64_t)63; o < 2 * b1; o += 64) _mm_prefetch(d + o, _MM_HINT_T0);
            if (wt->m) {
                const char *m = (const char *)(wt->m + (int64_t)rows[k] * wt->ds);
                for (int64_t o = (2 * b0) & ~(int64_t)63; o < 2 * b1; o += 64) _mm_prefetch(m + o, _MM_HINT_T0);
            }
        }
    }
}
#define AXPY_FN(name, body, R, FMT, ...) \
    static __attribute__((noinline)) void name(const qmat_t *wt, const float *h, const int32_t *rows, int64_t j, int64_t n, \
                                                int64_t c0, int64_t c1, float *y, float *ym) { \
        const uint8_t *pf[8]; \
        axpy_pf_rows(wt, rows, j, n, c0, c1, pf, R); \
        (void)ym; body(wt, h, rows, j, R, FMT, c0, c1, y __VA_ARGS__, pf); }
AXPY_FN(ax_f32_4, axpy_f_rows, 4, FMT_F32)
AXPY_FN(ax_f32_1, axpy_f_rows, 1, FMT_F32)
AXPY_FN(ax_f16_4, axpy_f_rows, 4, FMT_F16)
AXPY_FN(ax_f16_1, axpy_f_rows, 1, FMT_F16)
AXPY_FN(ax_bf16_4, axpy_f_rows, 4, FMT_BF16)
AXPY_FN(ax_bf16_1, axpy_f_rows, 1, FMT_BF16)
AXPY_FN(ax_q8_8, axpy_q_rows, 8, FMT_Q8, , ym)
AXPY_FN(ax_q4_8, axpy_q_rows, 8, FMT_Q4, , ym)
AXPY_FN(ax_q8_4, axpy_q_rows, 4, FMT_Q8, , ym)
AXPY_FN(ax_q8_1, axpy_q_rows, 1, FMT_Q8, , ym)
AXPY_FN(ax_q4_4, axpy_q_rows, 4, FMT_Q4, , ym)
AXPY_FN(ax_q4_1, axpy_q_rows, 1, FMT_Q4, , ym)

typedef void (*axpy_fn)(const qmat_t *, const float *, const int32_t *, int64_t, int64_t, int64_t, int64_t, float *, float *);
static const axpy_fn AXPY[FMT_COUNT][2] = {
    {ax_f32_4, ax_f32_1}, {ax_f16_4, ax_f16_1}, {ax_bf16_4, ax_bf16_1}, {ax_q8_4, ax_q8_1}, {ax_q4_4, ax_q4_1},
};

static void axpy(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n,
                 int64_t c0, int64_t c1, float *y) {
    float ym[AXPY_MAXB + 16];
    const int64_t nbc = (c1 - c0 + 31) / 32;
    memset(y + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    memset(ym, 0, sizeof ym);
    int64_t j = 0;
    axpy_prefetch(wt, rows, 0, n, AXPY_PF, c0, c1);
    /* integer rows 8 at a time (8 row streams per core, as dot_q's one-token tiles; the sums
     * keep their order, so results equal 4-row tiles') */
    if (wt->fmt == FMT_Q4 || wt->fmt == FMT_Q8)
        for (; j + 8 <= n; j += 8) (wt->fmt == FMT_Q4 ? ax_q4_8 : ax_q8_8)(wt, h, rows, j, n, c0, c1, y, ym);
    for (; j + 4 <= n; j += 4) AXPY[wt->fmt][0](wt, h, rows, j, n, c0, c1, y, ym);
    for (; j < n; j++) AXPY[wt->fmt][1](wt, h, rows, j, n, c0, c1, y, ym);
    if (wt->fmt >= FMT_Q8 && wt->m) {
        for (int64_t b = 0; b < nbc; b++) {
            const int64_t c = c0 + 32 * b, e = c + 32 <= c1 ? c + 32 : c1;
            __m512 mv = _mm512_set1_ps(ym[b]);
            for (int64_t k = c; k < e; k += 16) {
                __mmask16 mk = lanes(e - k);
                _mm512_mask_storeu_ps(y + k, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, y + k), mv));
            }
        }
    }
}

/* -------------------------------------------------------------------- bandwidth probe */

static uint64_t read_sum(const uint8_t *p, int64_t nbytes) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= nbytes; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
    }
    uint64_t acc = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    for (; i < nbytes; i++) acc += p[i];
    return acc;
}

/* ------------------------------------------------------- column-grouped q4 (cols.c) */

/* Four columns' bytes a, b, c, d (low or high nibbles, one per byte) -> dword lanes of four
 * bytes (a, b, c, d) of one row each, multiplied by (qa, qb, qc, qd) and added to s[0..3]: the
 * two unpack steps put 16 consecutive rows in each s[k] given the layout cols.c describes. */
AI void cols_quad512(__m512i a, __m512i b, __m512i c, __m512i d, __m512i xv, __m512i *s) {
    const __m512i abl = _mm512_unpacklo_epi8(a, b), abh = _mm512_unpackhi_epi8(a, b);
    const __m512i cdl = _mm512_unpacklo_epi8(c, d), cdh = _mm512_unpackhi_epi8(c, d);
    s[0] = DP512(s[0], _mm512_unpacklo_epi16(abl, cdl), xv);
    s[1] = DP512(s[1], _mm512_unpackhi_epi16(abl, cdl), xv);
    s[2] = DP512(s[2], _mm512_unpacklo_epi16(abh, cdh), xv);
    s[3] = DP512(s[3], _mm512_unpackhi_epi16(abh, cdh), xv);
}

AI void cols_quad256(__m256i a, __m256i b, __m256i c, __m256i d, __m256i xv, __m256i *s) {
    const __m256i abl = _mm256_unpacklo_epi8(a, b), abh = _mm256_unpackhi_epi8(a, b);
    const __m256i cdl = _mm256_unpacklo_epi8(c, d), cdh = _mm256_unpackhi_epi8(c, d);
    s[0] = DP256(s[0], _mm256_unpacklo_epi16(abl, cdl), xv);
    s[1] = DP256(s[1], _mm256_unpackhi_epi16(abl, cdl), xv);
    s[2] = DP256(s[2], _mm256_unpacklo_epi16(abh, cdh), xv);
    s[3] = DP256(s[3], _mm256_unpackhi_epi16(abh, cdh), xv);
}

/* y[r0 + i] += dx * d * acc + m * sx for 16 rows */
AI void cols_finish16(__m512i acc, const uint16_t *dq, const uint16_t *mq, __m512 vdx, __m512 vsx, float *y) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dq));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mq));
    const __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(vdx, dv), _mm512_cvtepi32_ps(acc), _mm512_loadu_ps(y));
    _mm512_storeu_ps(y, _mm512_fmadd_ps(mv, vsx, t));
}

#ifndef COLS_AHEAD
#define COLS_AHEAD 128 /* bytes of each column prefetched ahead */
#endif

/* A block of rows at a time with its sums in registers, the kept columns four at a time; each
 * column streams in order,
 * prefetched a little ahead (a group's kept columns are up to 32 streams, more than the
 * hardware prefetchers follow).  Sums stay in registers: a version streaming one quad over all
 * rows into sums in memory was slower for every shape measured. */
static void cols_group(const uint8_t *const *p, const uint32_t *xw, int nq, int64_t Np, const uint16_t *dq,
                       const uint16_t *mq, float dx, float sx, float *y) {
    const int64_t full = Np / 128 * 128;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512 vdx = _mm512_set1_ps(dx), vsx = _mm512_set1_ps(sx);
    for (int64_t b = 0; b < full; b += 128) {
        __m512i lo[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        __m512i hi[4] = {lo[0], lo[0], lo[0], lo[0]};
        for (int q = 0; q < nq; q++) {
            const uint8_t *const *pq = p + 4 * q;
            const __m512i xv = _mm512_set1_epi32((int)xw[q]);
            for (int t = 0; t < 4; t++) _mm_prefetch((const char *)(pq[t] + b / 2 + COLS_AHEAD), _MM_HINT_T0);
            const __m512i a = _mm512_loadu_si512(pq[0] + b / 2), bb = _mm512_loadu_si512(pq[1] + b / 2);
            const __m512i c = _mm512_loadu_si512(pq[2] + b / 2), d = _mm512_loadu_si512(pq[3] + b / 2);
            cols_quad512(_mm512_and_si512(a, m15), _mm512_and_si512(bb, m15), _mm512_and_si512(c, m15),
                         _mm512_and_si512(d, m15), xv, lo);
            cols_quad512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m15), _mm512_and_si512(_mm512_srli_epi16(bb, 4), m15),
                         _mm512_and_si512(_mm512_srli_epi16(c, 4), m15), _mm512_and_si512(_mm512_srli_epi16(d, 4), m15),
                         xv, hi);
        }
        for (int k = 0; k < 4; k++) {
            cols_finish16(lo[k], dq + b + 16 * k, mq + b + 16 * k, vdx, vsx, y + b + 16 * k);
            cols_finish16(hi[k], dq + b + 64 + 16 * k, mq + b + 64 + 16 * k, vdx, vsx, y + b + 64 + 16 * k);
        }
    }
    if (full < Np) { /* the last block of 64 rows */
        const __m256i m15h = _mm256_set1_epi8(15);
        __m256i lo[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i hi[4] = {lo[0], lo[0], lo[0], lo[0]};
        for (int q = 0; q < nq; q++) {
            const uint8_t *const *pq = p + 4 * q;
            const __m256i xv = _mm256_set1_epi32((int)xw[q]);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(pq[0] + full / 2));
            const __m256i bb = _mm256_loadu_si256((const __m256i *)(pq[1] + full / 2));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(pq[2] + full / 2));
            const __m256i d = _mm256_loadu_si256((const __m256i *)(pq[3] + full / 2));
            cols_quad256(_mm256_and_si256(a, m15h), _mm256_and_si256(bb, m15h), _mm256_and_si256(c, m15h),
                         _mm256_and_si256(d, m15h), xv, lo);
            cols_quad256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m15h), _mm256_and_si256(_mm256_srli_epi16(bb, 4), m15h),
                         _mm256_and_si256(_mm256_srli_epi16(c, 4), m15h), _mm256_and_si256(_mm256_srli_epi16(d, 4), m15h),
                         xv, hi);
        }
        /* 8 rows per 256-bit sum: rows full + 8k (low nibbles) and full + 32 + 8k (high) */
        int32_t t[64];
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_si256((__m256i *)(t + 8 * k), lo[k]);
            _mm256_storeu_si256((__m256i *)(t + 32 + 8 * k), hi[k]);
        }
        for (int k = 0; k < 4; k++)
            cols_finish16(_mm512_loadu_si512(t + 16 * k), dq + full + 16 * k, mq + full + 16 * k, vdx, vsx, y + full + 16 * k);
    }
}

/* ---------------------------------------------------------- row-tiled q4 (tiles.c) */

/* Per block, four 64-byte lines each give two 4-way byte dot products (low nibbles: inputs
 * 8l..8l+3, high: 8l+4..8l+7, against those inputs broadcast), leaving the block's sum of each
 * of the 16 rows in its lane; then d_x d and m s in float.  Even and odd blocks go to two
 * accumulators (two fma chains), added at the end.  u8 x s8 pairs summed to i16 never
 * saturate (2 * 15 * 127 < 32767).  KN tokens (1..4) of one tile at a time: each block's lines
 * are unpacked once for all of them; P = 1: each token's two activation terms (pair mode) in
 * turn into its sum.  A token's operations are the same for any KN. */
AI void tiles_q4_tok(const uint8_t *tp, int64_t G, const xq_t *xq, int64_t k0, const int KN, const int P, float *y,
                     int64_t yst) {
    const __m512i m15 = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    __m512 acc[4][2];
    for (int k = 0; k < KN; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
        const uint8_t *bp = tp + b * TQ4_BLOCK_BYTES;
        for (int o = 0; o < TQ4_BLOCK_BYTES; o += 64) _mm_prefetch((const char *)(bp + 8 * TQ4_BLOCK_BYTES + o), _MM_HINT_T0);
        __m512i lo[4], hi[4];
        for (int l = 0; l < 4; l++) {
            const __m512i v = _mm512_loadu_si512(bp + 64 * l);
            lo[l] = _mm512_and_si512(v, m15);
            hi[l] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bp + 256)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bp + 288)));
        for (int k = 0; k < KN; k++)
            for (int h = 0; h <= P; h++) {
                const int64_t v = ((k0 + k) << P) + h;
                const int32_t *xw = (const int32_t *)(xq->q + v * xq->q_stride + 32 * b);
                __m512i slo = z, shi = z;
                for (int l = 0; l < 4; l++) {
                    slo = DP512(slo, lo[l], _mm512_set1_epi32(xw[2 * l]));
                    shi = DP512(shi, hi[l], _mm512_set1_epi32(xw[2 * l + 1]));
                }
                const float dx = xq->d[v * xq->d_stride + b], sx = xq->s[v * xq->d_stride + b];
                const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(slo, shi)),
                                                 _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc[k][b & 1]);
                acc[k][b & 1] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx), a);
            }
    }
    for (int k = 0; k < KN; k++) _mm512_storeu_ps(y + (k0 + k) * yst, _mm512_add_ps(acc[k][0], acc[k][1]));
}

/* the T tokens in groups of up to 4, TOK(KN, P) instantiated for each group size and for the
 * pair mode (P = 1) or not; k0 is the group's first token */
#define FOR_TOKEN_GROUPS(T, pair, TOK)                                                                      \
    for (int64_t k0 = 0; k0 < (T); k0 += 4) {                                                               \
        const int64_t kn = (T) - k0 < 4 ? (T) - k0 : 4;                                                      \
        if (pair) {                                                                                          \
            if (kn == 4) TOK(4, 1); else if (kn == 3) TOK(3, 1); else if (kn == 2) TOK(2, 1); else TOK(1, 1); \
        } else {                                                                                             \
            if (kn == 4) TOK(4, 0); else if (kn == 3) TOK(3, 0); else if (kn == 2) TOK(2, 0); else TOK(1, 0); \
        }                                                                                                    \
    }

static void tiles_q4(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y, int64_t yst) {
    const int64_t G = w->nb;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tp = w->qs + t * G * TQ4_BLOCK_BYTES;
        float *yt = y + TQ4_ROWS * (t - t0);
#define TOK(KN, P) tiles_q4_tok(tp, G, xq, k0, KN, P, yt, yst)
        FOR_TOKEN_GROUPS(T, xq->pair, TOK)
#undef TOK
    }
}

/* tq4k (tiles.c) against XL_Q8K activations (one int8 scale per 256 inputs, llama.cpp's Q8_K):
 * each sub-block j of 32 inputs gives its 16 rows' integer sums as tiles_q4_tok's block does,
 * and a super-block's 8 sums take their 6-bit scales in integers (isum = sum_j sc_j dot_j;
 * |isum| < 8 * 63 * 32 * 15 * 127 < 2^31), then y += d_x d isum - dmin sum_j mn_j s_j, the
 * mins in float against the token's block sums.  The 16 rows' scales (mins) of the 8
 * sub-blocks are assembled as bytes, 64 at a time (ev: sub-blocks 2p at bytes 16p + i, od:
 * 2p + 1): the nibble plane's halves, each OR'd with its 2 high bits rotated to bits 4-5 out
 * of the high plane (lanes p = 0..3 of it repeat its 16-byte rows h = p / 2). */
AI void q4k_scale_bytes(const uint8_t *sp, const int k, __m512i *ev, __m512i *od) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i L = _mm512_loadu_si512(sp + TQ4K_LO + 64 * k);
    const __m512i hb = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(sp + TQ4K_HI + 32 * k)));
    const __m512i H = _mm512_shuffle_i64x2(hb, hb, _MM_SHUFFLE(1, 1, 0, 0));
    /* sub-block 2p: bits 4 (p % 2) of H; 2p + 1: bits 4 (p % 2) + 2 */
    const __m512i ra = _mm512_rolv_epi32(H, _mm512_set_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4));
    const __m512i rb = _mm512_rolv_epi32(H, _mm512_set_epi32(30, 30, 30, 30, 2, 2, 2, 2, 30, 30, 30, 30, 2, 2, 2, 2));
    *ev = _mm512_ternarylogic_epi32(_mm512_and_si512(L, m0f), ra, m30, 0xF8); /* A | (B & C) */
    *od = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(L, 4), m0f), rb, m30, 0xF8);
}

/* the 16 rows' bytes of sub-block j (< 8) out of q4k_scale_bytes' pair, as int32 lanes */
#define Q4K_LANES(ev, od, j) _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32((j) & 1 ? (od) : (ev), (j) / 2))

AI void tiles_q4k_tok(const uint8_t *tp, int64_t ns, const xq_t *xq, int64_t k0, const int KN, const int P, float *y,
                      int64_t yst) {
    const __m512i m15 = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    __m512 acc[4][2];
    for (int k = 0; k < KN; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *sp = tp + s * TQ4K_BLOCK_BYTES;
        __m512i sce, sco, mne, mno;
        q4k_scale_bytes(sp, 0, &sce, &sco);
        __m512i isum[4][2];
        for (int k = 0; k < KN; k++) isum[k][0] = isum[k][1] = z;
#define SUBBLOCK(j)                                                                                                  \
        {                                                                                                            \
            const uint8_t *bp = sp + 256 * (j);                                                                      \
            /* the next super-block, an eighth of it per sub-block */                                                \
            for (int o = 0; o < TQ4K_BLOCK_BYTES / 8; o += 64)                                                       \
                _mm_prefetch((const char *)(sp + TQ4K_BLOCK_BYTES + (TQ4K_BLOCK_BYTES / 8) * (j) + o), _MM_HINT_T0); \
            __m512i lo[4], hi[4];                                                                                    \
            for (int l = 0; l < 4; l++) {                                                                            \
                const __m512i v = _mm512_loadu_si512(bp + 64 * l);                                                   \
                lo[l] = _mm512_and_si512(v, m15);                                                                    \
                hi[l] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);                                              \
            }                                                                                                        \
            const __m512i sc = Q4K_LANES(sce, sco, j);                                                               \
            for (int k = 0; k < KN; k++)                                                                             \
                for (int h = 0; h <= P; h++) {                                                                       \
                    const int64_t v = ((k0 + k) << P) + h;                                                           \
                    const int32_t *xw = (const int32_t *)(xq->q + v * xq->q_stride + 256 * s + 32 * (j));            \
                    __m512i slo = z, shi = z;                                                                        \
                    for (int l = 0; l < 4; l++) {                                                                    \
                        slo = DP512(slo, lo[l], _mm512_set1_epi32(xw[2 * l]));                                       \
                        shi = DP512(shi, hi[l], _mm512_set1_epi32(xw[2 * l + 1]));                                   \
                    }                                                                                                \
                    isum[k][h] = _mm512_add_epi32(isum[k][h], _mm512_mullo_epi32(_mm512_add_epi32(slo, shi), sc));   \
                }                                                                                                    \
        }
        SUBBLOCK(0) SUBBLOCK(1) SUBBLOCK(2) SUBBLOCK(3) SUBBLOCK(4) SUBBLOCK(5) SUBBLOCK(6) SUBBLOCK(7)
#undef SUBBLOCK
        /* the mins' term after the codes' (the lines' registers free again) */
        q4k_scale_bytes(sp, 1, &mne, &mno);
        __m512 mt[4][2];
#define MINS(j)                                                                                                      \
        {                                                                                                            \
            const __m512 mnf = _mm512_cvtepi32_ps(Q4K_LANES(mne, mno, j));                                           \
            for (int k = 0; k < KN; k++)                                                                             \
                for (int h = 0; h <= P; h++) {                                                                       \
                    const __m512 sx = _mm512_set1_ps(xq->s[(((k0 + k) << P) + h) * xq->d_stride + 8 * s + (j)]);    \
                    mt[k][h] = (j) ? _mm512_fmadd_ps(mnf, sx, mt[k][h]) : _mm512_mul_ps(mnf, sx);                    \
                }                                                                                                    \
        }
        MINS(0) MINS(1) MINS(2) MINS(3) MINS(4) MINS(5) MINS(6) MINS(7)
#undef MINS
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + TQ4K_D)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + TQ4K_D + 32)));
        for (int k = 0; k < KN; k++)
            for (int h = 0; h <= P; h++) {
                const int64_t v = ((k0 + k) << P) + h;
                const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[k][h]),
                                                 _mm512_mul_ps(dv, _mm512_set1_ps(xq->d[v * xq->d_stride + 8 * s])), acc[k][s & 1]);
                acc[k][s & 1] = _mm512_fnmadd_ps(mv, mt[k][h], a);
            }
    }
    for (int k = 0; k < KN; k++) _mm512_storeu_ps(y + (k0 + k) * yst, _mm512_add_ps(acc[k][0], acc[k][1]));
}
#undef Q4K_LANES

static void tiles_q4k(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, int64_t T, float *y, int64_t yst) {
    const int64_t ns = w->cols / 256;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tp = w->qs + t * ns * TQ4K_BLOCK_BYTES;
        float *yt = y + TQ4_ROWS * (t - t0);
#define TOK(KN, P) tiles_q4k_tok(tp, ns, xq, k0, KN, P, yt, yst)
        FOR_TOKEN_GROUPS(T, xq->pair, TOK)
#undef TOK
    }
}

/* tq6 (tiles.c): as tiles_q4_tok, each line's nibbles completed to 6-bit codes with their two
 * high bits (one ternary-logic operation per 64 codes: nibble | (high bits moved to 4-5)), the
 * sums of inputs 0-15 and 16-31 kept apart for their own scales, and 32 times the token's code
 * sum over those 16 inputs taken off (value = d (q - 32)); u8 (< 64) x s8 pairs summed to i16
 * never saturate (2 * 63 * 127 < 32767). */
AI void tiles_q6_tok(const uint8_t *tp, int64_t G, const xq_t *xq, const int32_t *s16, int64_t ns, int64_t k0,
                     const int KN, const int P, float *y, int64_t yst) {
    const __m512i m15 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), z = _mm512_setzero_si512();
    __m512 acc[4][2];
    for (int k = 0; k < KN; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
        const uint8_t *bp = tp + b * TQ6_BLOCK_BYTES;
        for (int o = 0; o < TQ6_BLOCK_BYTES; o += 64) _mm_prefetch((const char *)(bp + 6 * TQ6_BLOCK_BYTES + o), _MM_HINT_T0);
        __m512i lo[4], hi[4];
        for (int h = 0; h < 2; h++) {
            const __m512i hb = _mm512_loadu_si512(bp + 256 + 64 * h);
            for (int e = 0; e < 2; e++) { /* line l = 2h + e: high parts in bits 4e..4e+3 */
                const int l = 2 * h + e;
                const __m512i v = _mm512_loadu_si512(bp + 64 * l);
                const __m512i hl = e ? hb : _mm512_slli_epi16(hb, 4), hh = e ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
                lo[l] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m15), hl, m30, 0xF8);  /* A | (B & C) */
                hi[l] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), m15), hh, m30, 0xF8);
            }
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bp + 384)));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bp + 416)));
        for (int k = 0; k < KN; k++)
            for (int hv = 0; hv <= P; hv++) {
                const int64_t v = ((k0 + k) << P) + hv;
                const int32_t *xw = (const int32_t *)(xq->q + v * xq->q_stride + 32 * b);
                __m512i s0 = z, s1 = z;
                for (int l = 0; l < 2; l++) {
                    s0 = DP512(s0, lo[l], _mm512_set1_epi32(xw[2 * l]));
                    s0 = DP512(s0, hi[l], _mm512_set1_epi32(xw[2 * l + 1]));
                    s1 = DP512(s1, lo[l + 2], _mm512_set1_epi32(xw[2 * l + 4]));
                    s1 = DP512(s1, hi[l + 2], _mm512_set1_epi32(xw[2 * l + 5]));
                }
                const int32_t *sv = s16 + v * ns + 2 * b;
                s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * sv[0]));
                s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * sv[1]));
                const __m512 dx = _mm512_set1_ps(xq->d[v * xq->d_stride + b]);
                const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), acc[k][b & 1]);
                acc[k][b & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), a);
            }
    }
    for (int k = 0; k < KN; k++) _mm512_storeu_ps(y + (k0 + k) * yst, _mm512_add_ps(acc[k][0], acc[k][1]));
}

static void tiles_q6(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, const int32_t *s16, int64_t T, float *y,
                     int64_t yst) {
    const int64_t G = w->nb, ns = w->kp / 16;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tp = w->qs + t * G * TQ6_BLOCK_BYTES;
        float *yt = y + TQ4_ROWS * (t - t0);
#define TOK(KN, P) tiles_q6_tok(tp, G, xq, s16, ns, k0, KN, P, yt, yst)
        FOR_TOKEN_GROUPS(T, xq->pair, TOK)
#undef TOK
    }
}
#undef FOR_TOKEN_GROUPS
