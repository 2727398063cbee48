/* AVX2 + FMA + F16C kernels (x86-64 CPUs without AVX-512).  Same tile structure and
 * activation layouts as kern_avx512_impl.h, with 256-bit vectors and VPMADDUBSW/VPMADDWD. */
#include "common.h"
#if SI_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include "common.h"

#define AI static inline __attribute__((always_inline))
#ifndef PF_TILES
#define PF_TILES 2
#endif
#ifndef PF_ROWS
#define PF_ROWS 16
#endif

AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AI float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* u8 x s8 -> i32 lanes (sum of 4 products each); no i16 saturation, see avx512 notes */
AI __m256i dot8(__m256i a, __m256i b) { return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)); }

/* ---------------------------------------------------------------- activation quantizer */

/* 32 values v (4 x 8) times vid, rounded to nearest even, as int8 in order; *sum = their sum
 * (|q| <= 127, so the packs do not saturate) */
AI __m256i quant32(const __m256 v[4], __m256 vid, int32_t *sum) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vid)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vid));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vid)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vid));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    const __m256i is = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i is4 = _mm_add_epi32(_mm256_castsi256_si128(is), _mm256_extracti128_si256(is, 1));
    is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
    is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
    *sum = _mm_cvtsi128_si32(is4);
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* undo the packs' in-lane interleave */
}

static void quantize(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    const int64_t nb = kp / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        for (int64_t b = 0; b < nb; b++) {
            float tmp[32];
            const float *src = xt + b * 32;
            if (K - b * 32 < 32) {
                int64_t n = K - b * 32;
                for (int j = 0; j < 32; j++) tmp[j] = j < n ? src[j] : 0.0f;
                src = tmp;
            }
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(src + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
            }
            const float amax = hmax8(mx);
            int32_t isum;
            const __m256i p = quant32(v, _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), &isum);
            _mm_storeu_si128((__m128i *)(q + si_xpos(xq->layout, nb, b, 0)), _mm256_castsi256_si128(p));
            _mm_storeu_si128((__m128i *)(q + si_xpos(xq->layout, nb, b, 16)), _mm256_extracti128_si256(p, 1));
            d[b] = amax / 127.0f;
            s[b] = d[b] * (float)isum; /* s = d * sum(q), see kern_scalar.c */
        }
        si_fill_de(xq->layout, nb, d, xq->de + t * xq->de_stride);
    }
}

/* ------------------------------------------------------------------ integer dot tiles */

AI void mterm(const qmat_t *w, const uint16_t *const *mp, const xq_t *xq, const int R, const int T,
              __m256 (*acc)[4], float (*tail)[4]) {
    const int64_t nb = w->nb;
    int64_t k = 0;
    for (; k + 8 <= nb; k += 8) {
        __m256 mv[8];
        for (int r = 0; r < R; r++) mv[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp[r] + k)));
        for (int t = 0; t < T; t++) {
            __m256 sv = _mm256_loadu_ps(xq->s + t * xq->d_stride + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(mv[r], sv, acc[r][t]);
        }
    }
    for (; k < nb; k++)
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) tail[r][t] += _cvtsh_ss(mp[r][k]) * xq->s[t * xq->d_stride + k];
}

/* Software prefetch of a line: into L2 (T1) for the 4-row tiles, into L1 (T0) for the
 * one-token 8-row tiles (see dot_q) */
AI void pfh(const char *p, const int t0) {
    if (t0) _mm_prefetch(p, _MM_HINT_T0);
    else _mm_prefetch(p, _MM_HINT_T1);
}

/* Prefetch the next tile's rows: scales now, data one line per line consumed. */
AI void prefetch_next(const qmat_t *w, const int64_t *rn, const int R, const uint8_t **pf, const int t0) {
    for (int r = 0; r < R; r++) {
        pf[r] = w->qs + rn[r] * w->row_bytes;
        if (w->d) {
            const char *d = (const char *)(w->d + rn[r] * w->ds), *m = w->m ? (const char *)(w->m + rn[r] * w->ds) : NULL;
            for (int64_t o = 0; o < w->nd * 2 + 63; o += 64) {
                pfh(d + o, t0);
                if (m) pfh(m + o, t0);
            }
        }
    }
}

/* The end of a q4 tile: the blocks after the last whole group of 4, the mins term, and the
 * sums of the lanes, res[r][t] for R rows and T tokens (rows qp/dp/mp, sums so far acc). */
AI void q4_finish(const qmat_t *w, const uint8_t *const *qp, const uint16_t *const *dp, const uint16_t *const *mp,
                  const xq_t *xq, const int R, const int T, __m256 (*acc)[4], float (*res)[4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    float tail[8][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) tail[r][t] = 0.0f;
    const __m128i m4x = _mm_set1_epi8(0x0F);
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qp[r] + 16 * b));
            __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x), _mm_and_si128(v, m4x));
            float dwr = _cvtsh_ss(dp[r][b]);
            for (int t = 0; t < T; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + t * xq->q_stride + 32 * b));
                __m256 f = _mm256_cvtepi32_ps(dot8(wv, xv));
                acc[r][t] = _mm256_fmadd_ps(f, _mm256_set1_ps(dwr * xq->d[t * xq->d_stride + b]), acc[r][t]);
            }
        }
    }
    if (w->m) mterm(w, mp, xq, R, T, acc, tail);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = hsum8(acc[r][t]) + tail[r][t];
}

AI void q4_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T,
             const int t0, float (*res)[4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[8];
    const uint16_t *dp[8], *mp[8];
    __m256 acc[8][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf, t0);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i ia = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), ib = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t g = 0; g < ng; g++) {
        for (int h = 0; h < 2; h++) {
            __m256i lo[8], hi[8];
            __m256 dw[8];
            for (int r = 0; r < R; r++) {
                if (!h) pfh((const char *)(pf[r] + 64 * g), t0);
                __m256i v = _mm256_loadu_si256((const __m256i *)(qp[r] + 64 * g + 32 * h));
                lo[r] = _mm256_and_si256(v, m4);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(dp[r] + 4 * g))));
                dw[r] = _mm256_permutevar8x32_ps(d4, h ? ib : ia);
            }
            for (int t = 0; t < T; t++) {
                const int8_t *xb = xq->q + t * xq->q_stride + 128 * g + 32 * h;
                __m256i xl = _mm256_loadu_si256((const __m256i *)xb), xh = _mm256_loadu_si256((const __m256i *)(xb + 64));
                __m256 de = _mm256_loadu_ps(xq->de + t * xq->de_stride + 16 * g + 8 * h);
                for (int r = 0; r < R; r++) {
                    __m256i p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xl), _mm256_maddubs_epi16(hi[r], xh)),
                                                  _mm256_set1_epi16(1));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[r], de), acc[r][t]);
                }
            }
        }
    }
    q4_finish(w, qp, dp, mp, xq, R, T, acc, res);
}

AI void q8_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T,
             const int t0, float (*res)[4]) {
    const int64_t nb = w->nb;
    const uint8_t *qp[8];
    const uint16_t *dp[8], *mp[8];
    __m256 acc[8][4];
    float tail[8][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        mp[r] = w->m ? w->m + rr[r] * w->ds : NULL;
        for (int t = 0; t < T; t++) {
            acc[r][t] = _mm256_setzero_ps();
            tail[r][t] = 0.0f;
        }
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf, t0);
    for (int64_t b = 0; b < nb; b++) {
        __m256i wa[8], ws[8];
        float dw[8];
        for (int r = 0; r < R; r++) {
            if (!(b & 1)) pfh((const char *)(pf[r] + 32 * b), t0);
            ws[r] = _mm256_loadu_si256((const __m256i *)(qp[r] + 32 * b));
            wa[r] = _mm256_abs_epi8(ws[r]);
            dw[r] = _cvtsh_ss(dp[r][b]);
        }
        for (int t = 0; t < T; t++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + t * xq->q_stride + 32 * b));
            float dx = xq->d[t * xq->d_stride + b];
            for (int r = 0; r < R; r++) {
                __m256 f = _mm256_cvtepi32_ps(dot8(wa[r], _mm256_sign_epi8(xv, ws[r])));
                acc[r][t] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw[r] * dx), acc[r][t]);
            }
        }
    }
    if (w->m) mterm(w, mp, xq, R, T, acc, tail);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = hsum8(acc[r][t]) + tail[r][t];
}

/* q6: see kern_avx512_impl.h.  Half h of a group (32 nibble bytes) takes field h of the 32
 * high-part bytes for its low nibbles and field 2 + h for its high nibbles: one shift each. */
AI void q6_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T,
             const int t0, float (*res)[4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *qp[8];
    const uint16_t *dp[8];
    __m256 acc[8][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        dp[r] = w->d + rr[r] * w->ds;
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    }
    const uint8_t *pf[8];
    prefetch_next(w, rn, R, pf, t0);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    const __m256i z = _mm256_setzero_si256();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *gq[8];
        for (int r = 0; r < R; r++) {
            gq[r] = qp[r] + 96 * g;
            pfh((const char *)(pf[r] + 96 * g), t0);
            pfh((const char *)(pf[r] + 96 * g + 64), t0);
        }
        for (int h = 0; h < 2; h++) {
            __m256i wl[8], wh[8];
            __m256 dl[8], dh[8];
            const __m256i il = h ? _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6) : _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
            const __m256i ih = _mm256_add_epi32(il, _mm256_set1_epi32(1));
            for (int r = 0; r < R; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(gq[r] + 32 * h));
                __m256i hb = _mm256_loadu_si256((const __m256i *)(gq[r] + 64));
                __m256i fl = h ? _mm256_slli_epi16(hb, 2) : _mm256_slli_epi16(hb, 4);
                __m256i fh = h ? _mm256_srli_epi16(hb, 2) : hb;
                wl[r] = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(fl, m30));
                wh[r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(fh, m30));
                __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp[r] + 8 * g)));
                dl[r] = _mm256_permutevar8x32_ps(d8, il);
                dh[r] = _mm256_permutevar8x32_ps(d8, ih);
            }
            for (int t = 0; t < T; t++) {
                const int8_t *xb = xq->q + t * xq->q_stride + 128 * g + 32 * h;
                __m256i xl = _mm256_loadu_si256((const __m256i *)xb), xh = _mm256_loadu_si256((const __m256i *)(xb + 64));
                __m256 de = _mm256_loadu_ps(xq->de + t * xq->de_stride + 16 * g + 8 * h);
                __m256i nl = _mm256_sub_epi32(z, dot8(c32, xl)), nh = _mm256_sub_epi32(z, dot8(c32, xh));
                for (int r = 0; r < R; r++) {
                    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(nl, dot8(wl[r], xl))), dl[r]);
                    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(nh, dot8(wh[r], xh))), dh[r], f);
                    acc[r][t] = _mm256_fmadd_ps(f, de, acc[r][t]);
                }
            }
        }
    }
    /* tail blocks: value j's high part in byte j % 8, field j / 8 (64-bit lane c: field c) */
    const __m128i m4x = _mm_set1_epi8(0x0F);
    for (int64_t b = 4 * ng; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *tp = qp[r] + 96 * ng + 24 * (b - 4 * ng);
            __m128i v = _mm_loadu_si128((const __m128i *)tp);
            int64_t h8;
            memcpy(&h8, tp + 16, 8);
            __m256i hv = _mm256_srlv_epi64(_mm256_sllv_epi64(_mm256_set1_epi64x(h8), _mm256_setr_epi64x(4, 2, 0, 0)),
                                           _mm256_setr_epi64x(0, 0, 0, 2));
            __m256i wv = _mm256_or_si256(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x), _mm_and_si128(v, m4x)),
                                         _mm256_and_si256(hv, m30));
            __m256 dv = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(dp[r][2 * b + 1])), _mm_set1_ps(_cvtsh_ss(dp[r][2 * b])));
            for (int t = 0; t < T; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq->q + t * xq->q_stride + 32 * b));
                __m256i p = _mm256_add_epi32(_mm256_sub_epi32(z, dot8(c32, xv)), dot8(wv, xv));
                __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p), dv), _mm256_set1_ps(xq->d[t * xq->d_stride + b]));
                acc[r][t] = _mm256_add_ps(acc[r][t], f);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = hsum8(acc[r][t]);
}

/* q4k (GGUF Q4_K super-blocks, common.h) against XL_Q8K activations: per super-block and
 * (row, token) the products of a sub-block's nibbles and int8 activations are summed in int16
 * pairs (VPMADDUBSW: at most 2 * 15 * 127), multiplied by the sub-block's 6-bit scale and
 * summed to int32 (VPMADDWD), so the float work is one multiply-add per 256 weights plus the
 * mins term (mn[i] * s[i], s the activation's block sums).  Rows are walked one at a time
 * within a super-block (their sums and unpacked codes fit the 16 registers); R rows and T
 * tokens of a tile only share the loop, so every (row, token) is computed the same way for
 * any R and T (a prompt row equals the one-token result). */
AI void q4k_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, const int R, const int T,
                 const int t0, float (*res)[4]) {
    const int64_t ns = w->kp / 256;
    const uint8_t *qp[8], *pf[8];
    __m256 acc[8][4];
    for (int r = 0; r < R; r++) {
        qp[r] = w->qs + rr[r] * w->row_bytes;
        pf[r] = w->qs + rn[r] * w->row_bytes;
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    /* VPSHUFB indices that broadcast the int16 scale of sub-block i to every lane */
#define SCB(i) _mm256_set1_epi16((short)((2 * (i)) | ((2 * (i) + 1) << 8)))
    for (int64_t sb = 0; sb < ns; sb++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = qp[r] + sb * SI_Q4K_BYTES, *nb = pf[r] + sb * SI_Q4K_BYTES;
            for (int o = 0; o < SI_Q4K_BYTES; o += 48) pfh((const char *)nb + o, t0); /* every line it spans */
            pfh((const char *)nb + SI_Q4K_BYTES - 1, t0);
            uint32_t scw[2], mnw[2];
            uint16_t hd, hm;
            si_q4k_head(blk, scw, mnw, &hd, &hm);
            const __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)scw[1], (int)scw[0])));
            const __m256 mneg = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mnw[1], (int)mnw[0]))),
                                              _mm256_set1_ps(-_cvtsh_ss(hm)));
            const float dw = _cvtsh_ss(hd);
            __m256i sumi[4];
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const __m256i sl = _mm256_shuffle_epi8(scv, SCB(2 * c)), sh = _mm256_shuffle_epi8(scv, SCB(2 * c + 1));
                for (int t = 0; t < T; t++) {
                    const int8_t *xb = xq->q + t * xq->q_stride + 256 * sb + 64 * c;
                    const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)), sl);
                    const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 32))), sh);
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
                }
            }
            for (int t = 0; t < T; t++) {
                const float *dx = xq->d + t * xq->d_stride + 8 * sb, *sx = xq->s + t * xq->d_stride + 8 * sb;
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(dw * dx[0]), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(mneg, _mm256_loadu_ps(sx), acc[r][t]);
            }
        }
    }
#undef SCB
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) res[r][t] = hsum8(acc[r][t]);
}

/* Two rows by four tokens of q4 for many-token products: the per-(row, token) arithmetic and
 * its order are q4_tile's (bit-identical), with the eight sums in registers. */
AI void q4_2x4_rows(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float (*res)[4]) {
    const int64_t nb = w->nb, ng = nb >> 2;
    const uint8_t *q0 = w->qs + rr[0] * w->row_bytes, *q1 = w->qs + rr[1] * w->row_bytes;
    const uint16_t *d0 = w->d + rr[0] * w->ds, *d1 = w->d + rr[1] * w->ds;
    const int8_t *xb0 = xq->q, *xb1 = xq->q + xq->q_stride, *xb2 = xq->q + 2 * xq->q_stride, *xb3 = xq->q + 3 * xq->q_stride;
    const float *e0 = xq->de, *e1 = xq->de + xq->de_stride, *e2 = xq->de + 2 * xq->de_stride, *e3 = xq->de + 3 * xq->de_stride;
    const uint8_t *p0 = w->qs + rn[0] * w->row_bytes, *p1 = w->qs + rn[1] * w->row_bytes;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
    const __m256i ia = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), ib = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
#define Q4D(lo, hi, xl, xh) _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), one))
    for (int64_t g = 0; g < ng; g++) {
        _mm_prefetch((const char *)(p0 + 64 * g), _MM_HINT_T1);
        _mm_prefetch((const char *)(p1 + 64 * g), _MM_HINT_T1);
        const __m256 s0 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d0 + 4 * g))));
        const __m256 s1 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d1 + 4 * g))));
        for (int h = 0; h < 2; h++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(q0 + 64 * g + 32 * h));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(q1 + 64 * g + 32 * h));
            const __m256i l0 = _mm256_and_si256(v0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            const __m256i l1 = _mm256_and_si256(v1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            const __m256 w0 = _mm256_permutevar8x32_ps(s0, h ? ib : ia), w1 = _mm256_permutevar8x32_ps(s1, h ? ib : ia);
            const int64_t xo = 128 * g + 32 * h, eo = 16 * g + 8 * h;
#define TOK(xb, e, A0, A1) { \
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(xb + xo)), xh = _mm256_loadu_si256((const __m256i *)(xb + xo + 64)); \
            const __m256 de = _mm256_loadu_ps(e + eo); \
            A0 = _mm256_fmadd_ps(Q4D(l0, h0, xl, xh), _mm256_mul_ps(w0, de), A0); \
            A1 = _mm256_fmadd_ps(Q4D(l1, h1, xl, xh), _mm256_mul_ps(w1, de), A1); }
            TOK(xb0, e0, a00, a10)
            TOK(xb1, e1, a01, a11)
            TOK(xb2, e2, a02, a12)
            TOK(xb3, e3, a03, a13)
#undef TOK
        }
    }
#undef Q4D
    __m256 acc[8][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};
    const uint8_t *qp[2] = {q0, q1};
    const uint16_t *dp[2] = {d0, d1}, *mp[2] = {w->m ? w->m + rr[0] * w->ds : NULL, w->m ? w->m + rr[1] * w->ds : NULL};
    q4_finish(w, qp, dp, mp, xq, 2, 4, acc, res);
}
/* Many-token products over 4 rows: two passes of 2 rows x 4 tokens, whose eight sums stay in
 * registers (a 4 x 4 tile of q4_tile spills them on AVX2's 16 vector registers). */
static __attribute__((noinline)) void q4_4x4(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]) {
    q4_2x4_rows(w, rr, rn, xq, res);
    q4_2x4_rows(w, rr + 2, rn + 2, xq, res + 2);
}

#define TILE_FN(name, tile, R, T) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float res[4][4]) { \
        tile(w, rr, rn, xq, R, T, 0, res); }
/* one token, 8 rows, prefetch into L1 (dot_q's one-token walk over gathered rows) */
#define TILE8_FN(name, tile) \
    static __attribute__((noinline)) void name(const qmat_t *w, const int64_t *rr, const int64_t *rn, const xq_t *xq, float *res) { \
        float o[8][4]; \
        tile(w, rr, rn, xq, 8, 1, 1, o); \
        for (int r = 0; r < 8; r++) res[r] = o[r][0]; }
TILE8_FN(q4_8x1, q4_tile)
TILE8_FN(q8_8x1, q8_tile)
TILE8_FN(q6_8x1, q6_tile)
TILE8_FN(q4k_8x1, q4k_tile)
TILE_FN(q4k_4x4, q4k_tile, 4, 4)
TILE_FN(q4k_4x1, q4k_tile, 4, 1)
TILE_FN(q4k_1x4, q4k_tile, 1, 4)
TILE_FN(q4k_1x1, q4k_tile, 1, 1)
TILE_FN(q4k_4x2, q4k_tile, 4, 2)
TILE_FN(q4k_1x2, q4k_tile, 1, 2)
TILE_FN(q4_4x1, q4_tile, 4, 1)
TILE_FN(q4_1x4, q4_tile, 1, 4)
TILE_FN(q4_1x1, q4_tile, 1, 1)
TILE_FN(q4_4x2, q4_tile, 4, 2)
TILE_FN(q4_1x2, q4_tile, 1, 2)
TILE_FN(q8_4x4, q8_tile, 4, 4)
TILE_FN(q8_4x1, q8_tile, 4, 1)
TILE_FN(q8_1x4, q8_tile, 1, 4)
TILE_FN(q8_1x1, q8_tile, 1, 1)
TILE_FN(q8_4x2, q8_tile, 4, 2)
TILE_FN(q8_1x2, q8_tile, 1, 2)
TILE_FN(q6_4x4, q6_tile, 4, 4)
TILE_FN(q6_4x1, q6_tile, 4, 1)
TILE_FN(q6_1x4, q6_tile, 1, 4)
TILE_FN(q6_1x1, q6_tile, 1, 1)
TILE_FN(q6_4x2, q6_tile, 4, 2)
TILE_FN(q6_1x2, q6_tile, 1, 2)

typedef void (*qtile_fn)(const qmat_t *, const int64_t *, const int64_t *, const xq_t *, float[4][4]);
/* the tile for a format (q8, q4, q6, q4k: fmt - FMT_Q8), R (4, 1) and Tn (4, 2, 1) */
static const qtile_fn QTILES[4][2][3] = {
    {{q8_4x4, q8_4x2, q8_4x1}, {q8_1x4, q8_1x2, q8_1x1}},
    {{q4_4x4, q4_4x2, q4_4x1}, {q4_1x4, q4_1x2, q4_1x1}},
    {{q6_4x4, q6_4x2, q6_4x1}, {q6_1x4, q6_1x2, q6_1x1}},
    {{q4k_4x4, q4k_4x2, q4k_4x1}, {q4k_1x4, q4k_1x2, q4k_1x1}},
};

/* Tile rows come from 4 separate quarters of [i0, i1) when there is one token, so no two
 * rows of a tile share a 4 KB page (interleaved short rows defeat the hardware prefetcher). */
typedef struct {
    int64_t i0, i1, q;
} walk_t;
AI walk_t walk_init(int64_t i0, int64_t i1, int64_t T) {
    walk_t wk = {i0, i1, T <= FEW_TOKENS ? (i1 - i0) / 4 : 0};
    return wk;
}
AI int64_t walk_tiles(const walk_t *wk) { return wk->q ? wk->q : (wk->i1 - wk->i0) / 4; }
AI int64_t walk_pos(const walk_t *wk, int64_t j, int r) { return wk->q ? wk->i0 + r * wk->q + j : wk->i0 + 4 * j + r; }

static void dot_q(const qmat_t *w, const int32_t *rows, int64_t i0, int64_t i1,
                  const xq_t *xq, int64_t T, const yout_t *out) {
    const qtile_fn(*tiles)[3] = QTILES[w->fmt - FMT_Q8];
    static const si_tile8_fn TILE8[4] = {q8_8x1, q4_8x1, q6_8x1, q4k_8x1};
    const int P = xq->pair ? 1 : 0;
    if (T == 1 && !P && rows && i1 - i0 >= 16) {
        /* one token over gathered rows: tiles of 8 rows, each from its own eighth of [i0, i1),
         * the next tile prefetched into L1 (the 4-row tiles prefetch two tiles ahead into L2),
         * as the AVX-512 kernels do.  Against the 4-row walk it reads gathered rows faster
         * (gemv_rows in both row layouts, and the neuron-record pass; bit-identical), and the
         * L1 hint (T0) gains more than T1 with separate scales.  Compared on an AVX-512 CPU
         * with SPARSEINFER_SIMD=avx2 (`python benchmarks/kernels.py`), not yet on an
         * AVX2-only one. */
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
            rn[r] = j + PF_TILES < ntiles ? si_row(rows, walk_pos(&wk, j + PF_TILES, r)) : rr[r];
        }
        for (int64_t t = 0; t < T;) {
            const int Tn = T - t >= 4 ? 4 : T - t >= 2 ? 2 : 1;
            const qtile_fn fn = tiles[R == 4 ? 0 : 1][Tn == 4 ? 0 : Tn == 2 ? 1 : 2];
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

AI __m256 loadw(const int fmt, const uint8_t *p, int64_t k) {
    if (fmt == FMT_F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (fmt == FMT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AI float loadw1(const int fmt, const uint8_t *p, int64_t k) {
    if (fmt == FMT_F32) return ((const float *)p)[k];
    uint16_t h;
    memcpy(&h, p + 2 * k, 2);
    return fmt == FMT_F16 ? _cvtsh_ss(h) : si_bf2f(h);
}

AI void f_tile(const qmat_t *w, const int64_t *rr, const int64_t *rn, const float *x, int64_t xs, const int fmt,
               const int R, const int T, float res[4][4]) {
    const int64_t K = w->cols;
    const uint8_t *wp[4];
    __m256 acc[4][4];
    for (int r = 0; r < R; r++) {
        wp[r] = w->qs + rr[r] * w->row_bytes;
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    }
    const uint8_t *pf[4];
    prefetch_next(w, rn, R, pf, 0);
    const int esz = fmt == FMT_F32 ? 4 : 2;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        if (!((k * esz) & 63))
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf[r] + k * esz), _MM_HINT_T1);
        for (int r = 0; r < R; r++) wv[r] = loadw(fmt, wp[r], k);
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps(x + t * xs + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = hsum8(acc[r][t]);
            for (int64_t j = k; j < K; j++) s += loadw1(fmt, wp[r], j) * x[t * xs + j];
            res[r][t] = s;
        }
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

/* Prefetch (T1) the block scales, and mins if any, of blocks [b0, b0 + nbc) of one row. */
AI void axpy_prefetch_scales(const qmat_t *wt, int64_t row, int64_t b0, int64_t nbc) {
    const char *d = (const char *)(wt->d + row * wt->ds), *m = wt->m ? (const char *)(wt->m + row * wt->ds) : NULL;
    for (int64_t o = (2 * b0) & ~(int64_t)63; o < 2 * (b0 + nbc); o += 64) {
        _mm_prefetch(d + o, _MM_HINT_T1);
        if (m) _mm_prefetch(m + o, _MM_HINT_T1);
    }
}

/* The 32 codes of one q4 (16 bytes) or q8 (32 bytes) block as 4 x 8 floats, in value order. */
AI void axpy_block_codes(const int fmt, const uint8_t *qb, __m256 v[4]) {
    if (fmt == FMT_Q4) {
        const __m256i m4 = _mm256_set1_epi32(0x0F);
        __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qb));
        __m256i bb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8)));
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, m4));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(bb, m4));
        v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bb, 4));
    } else {
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * i))));
    }
}

/* y[c] += h_j * w_j[c] over the column chunk [c0, c1), strictly in row order per element
 * (the order, not the grouping, fixes the result). */
static void axpy(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n,
                 int64_t c0, int64_t c1, float *y) {
    memset(y + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    const int fmt = wt->fmt;
    float ym[128 + 8];
    const int64_t b0 = c0 / 32, nbc = (c1 - c0 + 31) / 32;
    memset(ym, 0, sizeof ym);
    /* byte range of this column chunk within a row, for prefetching rows ahead */
    const int64_t s0 = fmt == FMT_Q4 ? b0 * 16 : fmt == FMT_Q8 ? b0 * 32 : c0 * (fmt == FMT_F32 ? 4 : 2);
    const int64_t bb = fmt == FMT_Q4 ? 16 : 32; /* bytes per block (q4, q8) */
    int64_t j = 0;
    if ((fmt == FMT_Q8 || fmt == FMT_Q4) && (c1 - c0) % 32 == 0) {
        /* two rows per pass over y: half the loads and stores of y, the same sums in the same
         * order (row j's fma, then row j + 1's, per element; their mins likewise per block),
         * which makes axpy_rows faster at any active fraction */
        for (; j + 2 <= n; j += 2) {
            /* rows PF_ROWS ahead: scales now, data one line per line consumed (a burst of
             * prefetches per row stalls once the miss buffers are full) */
            const char *pa = NULL, *pb = NULL;
            if (j + 1 + PF_ROWS < n) {
                const int64_t ra = rows[j + PF_ROWS], rb = rows[j + 1 + PF_ROWS];
                pa = (const char *)(wt->qs + ra * wt->row_bytes) + (s0 & ~(int64_t)63);
                pb = (const char *)(wt->qs + rb * wt->row_bytes) + (s0 & ~(int64_t)63);
                axpy_prefetch_scales(wt, ra, b0, nbc);
                axpy_prefetch_scales(wt, rb, b0, nbc);
            }
            const uint8_t *w0 = wt->qs + rows[j] * wt->row_bytes + bb * b0;
            const uint8_t *w1 = wt->qs + rows[j + 1] * wt->row_bytes + bb * b0;
            const uint16_t *d0 = wt->d + rows[j] * wt->ds + b0, *d1 = wt->d + rows[j + 1] * wt->ds + b0;
            const float h0 = h[j], h1 = h[j + 1];
            if (wt->m) {
                const uint16_t *m0 = wt->m + rows[j] * wt->ds + b0, *m1 = wt->m + rows[j + 1] * wt->ds + b0;
                for (int64_t b = 0; b < nbc; b++) ym[b] = fmaf(h1, _cvtsh_ss(m1[b]), fmaf(h0, _cvtsh_ss(m0[b]), ym[b]));
            }
            for (int64_t b = 0; b < nbc; b++) {
                const __m256 sa = _mm256_set1_ps(h0 * _cvtsh_ss(d0[b])), sb = _mm256_set1_ps(h1 * _cvtsh_ss(d1[b]));
                float *yb = y + c0 + 32 * b;
                if (pa && !((bb * b) & 63)) {
                    _mm_prefetch(pa + bb * b, _MM_HINT_T1);
                    _mm_prefetch(pb + bb * b, _MM_HINT_T1);
                }
                __m256 va[4], vb[4];
                axpy_block_codes(fmt, w0 + bb * b, va);
                axpy_block_codes(fmt, w1 + bb * b, vb);
                for (int i = 0; i < 4; i++) {
                    __m256 yv = _mm256_fmadd_ps(sa, va[i], _mm256_loadu_ps(yb + 8 * i));
                    _mm256_storeu_ps(yb + 8 * i, _mm256_fmadd_ps(sb, vb[i], yv));
                }
            }
        }
    }
    for (; j < n; j++) {
        const int64_t row = rows[j];
        const uint8_t *wp = wt->qs + row * wt->row_bytes;
        const float hj = h[j];
        /* row PF_ROWS ahead: scales now, data a line at a time as this row's is consumed */
        const char *pf = NULL;
        if (j + PF_ROWS < n) {
            const int64_t rp = rows[j + PF_ROWS];
            pf = (const char *)(wt->qs + rp * wt->row_bytes) + (s0 & ~(int64_t)63);
            if (wt->d) axpy_prefetch_scales(wt, rp, b0, nbc);
        }
        const __m256 hv = _mm256_set1_ps(hj);
        if (fmt <= FMT_BF16) {
            int64_t c = c0;
            const int64_t esz = fmt == FMT_F32 ? 4 : 2;
            for (; c + 8 <= c1; c += 8) {
                if (pf && !(((c - c0) * esz) & 63)) _mm_prefetch(pf + (c - c0) * esz, _MM_HINT_T1);
                __m256 yv = _mm256_loadu_ps(y + c);
                __m256 wv = fmt == FMT_F32 ? loadw(FMT_F32, wp, c) : fmt == FMT_F16 ? loadw(FMT_F16, wp, c) : loadw(FMT_BF16, wp, c);
                _mm256_storeu_ps(y + c, _mm256_fmadd_ps(hv, wv, yv));
            }
            for (; c < c1; c++) y[c] = fmaf(hj, fmt == FMT_F32 ? loadw1(FMT_F32, wp, c) : fmt == FMT_F16 ? loadw1(FMT_F16, wp, c) : loadw1(FMT_BF16, wp, c), y[c]);
            continue;
        }
        const uint16_t *dp = wt->d + row * wt->ds + b0, *mp = wt->m ? wt->m + row * wt->ds + b0 : NULL;
        for (int64_t b = 0; b < nbc; b++) {
            const int64_t c = (b0 + b) * 32;
            const __m256 s = _mm256_set1_ps(hj * _cvtsh_ss(dp[b]));
            if (mp) ym[b] = fmaf(hj, _cvtsh_ss(mp[b]), ym[b]);
            if (pf && !((bb * b) & 63)) _mm_prefetch(pf + bb * b, _MM_HINT_T1);
            __m256 v[4];
            axpy_block_codes(fmt, wp + bb * (b0 + b), v);
            if (c + 32 <= c1) {
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(y + c + 8 * i, _mm256_fmadd_ps(s, v[i], _mm256_loadu_ps(y + c + 8 * i)));
            } else {
                float tmp[32];
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(tmp + 8 * i, v[i]);
                float sc = hj * _cvtsh_ss(dp[b]);
                for (int64_t k = c; k < c1; k++) y[k] = fmaf(sc, tmp[k - c], y[k]);
            }
        }
    }
    if (fmt >= FMT_Q8 && wt->m)
        for (int64_t b = 0; b < nbc; b++) {
            const int64_t c = (b0 + b) * 32, e = c + 32 <= c1 ? c + 32 : c1;
            for (int64_t k = c; k < e; k++) y[k] += ym[b];
        }
}

/* -------------------------------------------------------------------- bandwidth probe */

static uint64_t read_sum(const uint8_t *p, int64_t nbytes) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 128 <= nbytes; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t r[4];
    _mm256_storeu_si256((__m256i *)r, a);
    uint64_t acc = r[0] + r[1] + r[2] + r[3];
    for (; i < nbytes; i++) acc += p[i];
    return acc;
}

/* ------------------------------------------------------------ single-token attention */

/* e^x for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2/2, degree-6 Taylor polynomial of e^r (relative error ~2e-7, below the f32 sums
 * around it); inputs below -87 give 0. */
AI __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Rows j < n of sc (n x L) to their softmax, in place. */
void si_softmax_rows_avx2(float *sc, int n, int64_t L) {
    for (int j = 0; j < n; j++) {
        float *s = sc + j * L, mx = -INFINITY;
        for (int64_t t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= L; t += 8) {
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
            _mm256_storeu_ps(s + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum8(vsum);
        for (; t < L; t++) sum += (s[t] = expf(s[t] - mx));
        const float inv = 1.0f / sum;
        for (t = 0; t < L; t++) s[t] *= inv;
    }
}

/* si_attend_avx2: attend_impl.h with 8-float vectors for each KV cache type (two positions
 * per score step up to 6 heads: 12 accumulators of the 16 registers) */
AI __m256 q8_load8(const uint8_t *blk, int64_t j) {
    uint16_t d;
    memcpy(&d, blk, 2);
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + j)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(_cvtsh_ss(d)));
}
#define AT_V __m256
#define AT_W 8
#define AT_LOAD(p) _mm256_loadu_ps(p)
#define AT_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define AT_LOAD_Q8(blk, j) q8_load8(blk, j)
#define AT_STORE(p, v) _mm256_storeu_ps(p, v)
#define AT_ZERO() _mm256_setzero_ps()
#define AT_SET1(x) _mm256_set1_ps(x)
#define AT_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define AT_SUM(v) hsum8(v)
#define AT_PAIR_MAX 6
#define AT_NAME si_attend_heads_avx2
#define AT_KV 0
#include "attend_impl.h"
#define AT_KV 1
#include "attend_impl.h"
#define AT_KV 2
#include "attend_impl.h"

const struct si_attend_fns si_attend_avx2 = {{si_attend_heads_avx2_f32, si_attend_heads_avx2_f16,
                                              si_attend_heads_avx2_q8_0}};

/* One cache row (common.h, KV_*): halves by F16C (round to nearest even, as si_f2h); Q8_0 blocks
 * 32 values at a time with the portable quantizer's arithmetic (same bytes), a partial last
 * block by the portable one. */
void si_kv_store_avx2(int type, const float *x, void *row, int64_t D) {
    if (type == KV_F32) {
        memcpy(row, x, (size_t)D * sizeof(float));
    } else if (type == KV_F16) {
        uint16_t *h = row;
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
            _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < D; i++) h[i] = si_f2h(x[i]);
    } else {
        uint8_t *out = row;
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        int64_t b = 0;
        for (; b * 32 + 32 <= D; b++) {
            const float *xb = x + b * 32;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm256_loadu_ps(xb + 8 * k);
                m = _mm256_max_ps(m, _mm256_and_ps(v[k], absmask));
            }
            const float amax = hmax8(m), d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            uint8_t *blk = out + b * SI_Q8_0_BLOCK;
            const uint16_t h = si_f2h(d);
            memcpy(blk, &h, 2);
            _mm256_storeu_si256((__m256i *)(blk + 2), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        if (b * 32 < D) si_q8_0_row(x + b * 32, D - b * 32, out + b * SI_Q8_0_BLOCK);
    }
}

/* v[i] = act(v[i]) in place (decode's FFN activations): SiLU and ReLU 8 at a time, the GELUs
 * element by element.  SiLU through exp_neg on -|v| (no overflow): with t = e^-|v|,
 * silu(v) = v / (1 + t) for v >= 0 and v t / (1 + t) below; within ~3e-7 of the scalar
 * v / (1 + expf(-v)). */
AI __m256 act8(int act, __m256 v) {
    if (act == ACT_RELU) return _mm256_max_ps(v, _mm256_setzero_ps());
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 t = exp_neg(_mm256_or_ps(v, sign));
    const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_div_ps(_mm256_mul_ps(v, _mm256_blendv_ps(one, t, neg)), _mm256_add_ps(one, t));
}

void si_act_avx2(int act, float *v, int64_t n) {
    if (act != ACT_SILU && act != ACT_RELU) {
        si_act_each(act, v, n);
        return;
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, act8(act, _mm256_loadu_ps(v + i)));
    if (i < n) { /* the tail through the same arithmetic */
        float t[8] = {0};
        memcpy(t, v + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(t, act8(act, _mm256_loadu_ps(t)));
        memcpy(v + i, t, (size_t)(n - i) * sizeof(float));
    }
}

/* ------------------------------------------------------- column-grouped q4 (cols.c) */

/* 32 bytes at `off` of each kept column, four columns at a time: the low nibbles' rows into
 * lo[0..3], the high nibbles' into hi[0..3] (8 consecutive rows per sum, see cols.c's layout:
 * two unpack steps line four columns' bytes up as dwords of one row; u8 x s8 pairs summed to
 * i16 never saturate, 2 * 15 * 127 < 32767). */
static void cols_half(const uint8_t *const *p, const uint32_t *xw, int nq, int64_t off, __m256i *lo, __m256i *hi) {
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    for (int k = 0; k < 4; k++) lo[k] = hi[k] = _mm256_setzero_si256();
    for (int q = 0; q < nq; q++) {
        const uint8_t *const *pq = p + 4 * q;
        const __m256i xv = _mm256_set1_epi32((int)xw[q]);
        __m256i v[4];
        for (int t = 0; t < 4; t++) v[t] = _mm256_loadu_si256((const __m256i *)(pq[t] + off));
        for (int h = 0; h < 2; h++) {
            __m256i c[4];
            for (int t = 0; t < 4; t++) c[t] = _mm256_and_si256(h ? _mm256_srli_epi16(v[t], 4) : v[t], m15);
            const __m256i abl = _mm256_unpacklo_epi8(c[0], c[1]), abh = _mm256_unpackhi_epi8(c[0], c[1]);
            const __m256i cdl = _mm256_unpacklo_epi8(c[2], c[3]), cdh = _mm256_unpackhi_epi8(c[2], c[3]);
            const __m256i r[4] = {_mm256_unpacklo_epi16(abl, cdl), _mm256_unpackhi_epi16(abl, cdl),
                                  _mm256_unpacklo_epi16(abh, cdh), _mm256_unpackhi_epi16(abh, cdh)};
            __m256i *s = h ? hi : lo;
            for (int k = 0; k < 4; k++) s[k] = _mm256_add_epi32(s[k], _mm256_madd_epi16(_mm256_maddubs_epi16(r[k], xv), one));
        }
    }
}

/* y[rows] += dx * d * acc + m * sx for the 8 rows of each sum: sum k covers rows base + stride*k */
static void cols_finish(const __m256i *acc, int64_t base, int64_t stride, const uint16_t *dq, const uint16_t *mq,
                        float dx, float sx, float *y) {
    const __m256 vdx = _mm256_set1_ps(dx), vsx = _mm256_set1_ps(sx);
    for (int k = 0; k < 4; k++) {
        const int64_t r = base + stride * k;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dq + r)));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mq + r)));
        const __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(vdx, dv), _mm256_cvtepi32_ps(acc[k]), _mm256_loadu_ps(y + r));
        _mm256_storeu_ps(y + r, _mm256_fmadd_ps(mv, vsx, t));
    }
}

/* As the AVX-512 version: a block of rows at a time with its sums in registers (here each
 * 128-row block in two halves of 32 bytes per column), kept columns four at a time. */
static void cols_group(const uint8_t *const *p, const uint32_t *xw, int nq, int64_t Np, const uint16_t *dq,
                       const uint16_t *mq, float dx, float sx, float *y) {
    const int64_t full = Np / 128 * 128;
    __m256i lo[4], hi[4];
    for (int64_t b = 0; b < full; b += 128)
        for (int h = 0; h < 2; h++) {
            for (int q = 0; q < 4 * nq; q++) _mm_prefetch((const char *)(p[q] + b / 2 + 32 * h + 128), _MM_HINT_T0);
            cols_half(p, xw, nq, b / 2 + 32 * h, lo, hi);
            cols_finish(lo, b + 8 * h, 16, dq, mq, dx, sx, y);
            cols_finish(hi, b + 64 + 8 * h, 16, dq, mq, dx, sx, y);
        }
    if (full < Np) { /* the last block of 64 rows */
        cols_half(p, xw, nq, full / 2, lo, hi);
        cols_finish(lo, full, 8, dq, mq, dx, sx, y);
        cols_finish(hi, full + 32, 8, dq, mq, dx, sx, y);
    }
}

/* XL_Q8K (common.h): one scale per super-block of 256 values, block sums per 32; the same
 * values as si_quantize_q8k (kern_scalar.c), the reference (the positions past K read as 0) */
static void quantize_q8k(const float *x, int64_t K, int64_t kp, int64_t t0, int64_t t1, const xq_t *xq) {
    const int64_t nb = kp / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * K;
        int8_t *q = xq->q + t * xq->q_stride;
        float *d = xq->d + t * xq->d_stride, *s = xq->s + t * xq->d_stride;
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int64_t k0 = 32 * b0, nbl = nb - b0 < 8 ? nb - b0 : 8;
            float tmp[256];
            const float *src = xt + k0;
            if (K - k0 < 32 * nbl) {
                const int64_t n = K - k0;
                for (int64_t j = 0; j < 32 * nbl; j++) tmp[j] = j < n ? src[j] : 0.0f;
                src = tmp;
            }
            __m256 mx = _mm256_setzero_ps();
            for (int64_t i = 0; i < 4 * nbl; i++) /* a NaN value is passed over, as the reference does */
                mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + 8 * i), absmask), mx);
            const float amax = hmax8(mx);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f, db = amax / 127.0f;
            const __m256 vid = _mm256_set1_ps(id);
            for (int64_t b = 0; b < nbl; b++) {
                const __m256 v[4] = {_mm256_loadu_ps(src + 32 * b), _mm256_loadu_ps(src + 32 * b + 8),
                                     _mm256_loadu_ps(src + 32 * b + 16), _mm256_loadu_ps(src + 32 * b + 24)};
                int32_t isum;
                _mm256_storeu_si256((__m256i *)(q + k0 + 32 * b), quant32(v, vid, &isum));
                d[b0 + b] = db;
                s[b0 + b] = db * (float)isum;
            }
        }
    }
}

/* ---------------------------------------------------------- row-tiled q4 (tiles.c) */

/* As the AVX-512 version, each 64-byte line in two halves of 8 rows (bytes 0..31: rows 0..7,
 * 32..63: rows 8..15); u8 x s8 pairs summed to i16 never saturate (2 * 15 * 127 < 32767).
 * KN tokens of one tile at a time (up to 4, or 2 pairs in the precise mode), each line
 * unpacked once for all of them, both halves of a block in turn (a tile is read once); one
 * float accumulator per (token, half), registers being fewer than AVX-512's.  A token's
 * operations are the same for any KN. */
AI void tiles_q4_tok(const uint8_t *tp, int64_t G, const xq_t *xq, int64_t k0, const int KN, const int P, float *y,
                     int64_t yst) {
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    __m256 acc[4][2];
    for (int k = 0; k < KN; k++) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
        const uint8_t *bp = tp + b * TQ4_BLOCK_BYTES;
        for (int o = 0; o < TQ4_BLOCK_BYTES; o += 64) _mm_prefetch((const char *)(bp + 8 * TQ4_BLOCK_BYTES + o), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i sum[4][2];
            for (int k = 0; k < KN; k++) sum[k][0] = sum[k][1] = _mm256_setzero_si256();
            for (int l = 0; l < 4; l++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(bp + 64 * l + 32 * h));
                const __m256i lo = _mm256_and_si256(c, m15), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m15);
                for (int k = 0; k < KN; k++)
                    for (int hv = 0; hv <= P; hv++) {
                        const int32_t *xw = (const int32_t *)(xq->q + (((k0 + k) << P) + hv) * xq->q_stride + 32 * b);
                        const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xw[2 * l])),
                                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xw[2 * l + 1])));
                        sum[k][hv] = _mm256_add_epi32(sum[k][hv], _mm256_madd_epi16(p16, one));
                    }
            }
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + 256 + 16 * h)));
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + 288 + 16 * h)));
            for (int k = 0; k < KN; k++)
                for (int hv = 0; hv <= P; hv++) {
                    const int64_t v = ((k0 + k) << P) + hv;
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k][hv]),
                                                     _mm256_mul_ps(dv, _mm256_set1_ps(xq->d[v * xq->d_stride + b])), acc[k][h]);
                    acc[k][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xq->s[v * xq->d_stride + b]), a);
                }
        }
    }
    for (int k = 0; k < KN; k++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (k0 + k) * yst + 8 * h, acc[k][h]);
}

/* the T tokens in groups of up to 4 (2 pairs in the precise mode: registers are fewer than
 * AVX-512's), TOK(KN, P) instantiated for each group size; k0 is the group's first token */
#define FOR_TOKEN_GROUPS(T, pair, TOK)                                                                    \
    for (int64_t k0 = 0, step = (pair) ? 2 : 4; k0 < (T); k0 += step) {                                   \
        const int64_t kn = (T) - k0 < step ? (T) - k0 : step;                                              \
        if (pair) {                                                                                        \
            if (kn == 2) TOK(2, 1); else TOK(1, 1);                                                        \
        } else {                                                                                           \
            if (kn == 4) TOK(4, 0); else if (kn == 3) TOK(3, 0); else if (kn == 2) TOK(2, 0); else TOK(1, 0); \
        }                                                                                                  \
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

/* tq4k (tiles.c) against XL_Q8K activations, as the AVX-512 version in two halves of 8 rows:
 * per super-block and half, each sub-block's 8 row sums (tiles_q4_tok's block) times the
 * rows' 6-bit scales in integers, then d_x d and the mins' term in float.  The 16 rows' scales
 * (mins) of the 8 sub-blocks are first assembled as bytes, 32 at a time (out[16 j + i]: row
 * i, sub-block j): the low plane's nibbles, each OR'd with its 2 high bits shifted to bits 4-5
 * out of the high plane (both 128-bit lanes of it the same 16-byte row); a sub-block's 8 rows
 * are then zero-extended to the lanes from there. */
AI void q4k_scale_bytes(const uint8_t *sp, const int k, uint8_t *out) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int g = 0; g < 2; g++) { /* low-plane rows p = 2g, 2g + 1: sub-blocks 4g .. 4g + 3 */
        const __m256i L = _mm256_loadu_si256((const __m256i *)(sp + TQ4K_LO + 64 * k + 32 * g));
        const __m256i H = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(sp + TQ4K_HI + 32 * k + 16 * g)));
        /* A: sub-blocks 4g (lane 0, high bits 0-1) and 4g + 2 (lane 1, bits 4-5); B: 4g + 1 (bits 2-3), 4g + 3 (bits 6-7) */
        const __m256i ha = _mm256_sllv_epi32(H, _mm256_setr_epi32(4, 4, 4, 4, 0, 0, 0, 0));
        const __m256i hb = _mm256_blend_epi32(_mm256_slli_epi32(H, 2), _mm256_srli_epi32(H, 2), 0xF0);
        const __m256i A = _mm256_or_si256(_mm256_and_si256(L, m0f), _mm256_and_si256(ha, m30));
        const __m256i B = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), m0f), _mm256_and_si256(hb, m30));
        _mm256_storeu_si256((__m256i *)(out + 64 * g), _mm256_permute2x128_si256(A, B, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 64 * g + 32), _mm256_permute2x128_si256(A, B, 0x31));
    }
}
#define Q4K_LANES8(bytes, j, h) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((bytes) + 16 * (j) + 8 * (h))))

AI void tiles_q4k_tok(const uint8_t *tp, int64_t ns, const xq_t *xq, int64_t k0, const int KN, const int P, float *y,
                      int64_t yst) {
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    __m256 acc[4][2];
    for (int k = 0; k < KN; k++) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *sp = tp + s * TQ4K_BLOCK_BYTES;
        uint8_t sm[2][128];
        q4k_scale_bytes(sp, 0, sm[0]);
        q4k_scale_bytes(sp, 1, sm[1]);
        for (int h = 0; h < 2; h++) {
            __m256i isum[4][2];
            for (int k = 0; k < KN; k++) isum[k][0] = isum[k][1] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const uint8_t *bp = sp + 256 * j;
                /* the next super-block, a sixteenth of it per sub-block and half */
                for (int o = 0; o < TQ4K_BLOCK_BYTES / 16; o += 64)
                    _mm_prefetch((const char *)(sp + TQ4K_BLOCK_BYTES + (TQ4K_BLOCK_BYTES / 16) * (8 * h + j) + o), _MM_HINT_T0);
                __m256i sum[4][2];
                for (int k = 0; k < KN; k++) sum[k][0] = sum[k][1] = _mm256_setzero_si256();
                for (int l = 0; l < 4; l++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(bp + 64 * l + 32 * h));
                    const __m256i lo = _mm256_and_si256(c, m15), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m15);
                    for (int k = 0; k < KN; k++)
                        for (int hv = 0; hv <= P; hv++) {
                            const int32_t *xw = (const int32_t *)(xq->q + (((k0 + k) << P) + hv) * xq->q_stride + 256 * s + 32 * j);
                            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xw[2 * l])),
                                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xw[2 * l + 1])));
                            sum[k][hv] = _mm256_add_epi32(sum[k][hv], _mm256_madd_epi16(p16, one));
                        }
                }
                const __m256i sc = Q4K_LANES8(sm[0], j, h);
                for (int k = 0; k < KN; k++)
                    for (int hv = 0; hv <= P; hv++) isum[k][hv] = _mm256_add_epi32(isum[k][hv], _mm256_mullo_epi32(sum[k][hv], sc));
            }
            __m256 mt[4][2];
            for (int j = 0; j < 8; j++) {
                const __m256 mnf = _mm256_cvtepi32_ps(Q4K_LANES8(sm[1], j, h));
                for (int k = 0; k < KN; k++)
                    for (int hv = 0; hv <= P; hv++) {
                        const __m256 sx = _mm256_set1_ps(xq->s[(((k0 + k) << P) + hv) * xq->d_stride + 8 * s + j]);
                        mt[k][hv] = j ? _mm256_fmadd_ps(mnf, sx, mt[k][hv]) : _mm256_mul_ps(mnf, sx);
                    }
            }
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + TQ4K_D + 16 * h)));
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + TQ4K_D + 32 + 16 * h)));
            for (int k = 0; k < KN; k++)
                for (int hv = 0; hv <= P; hv++) {
                    const int64_t v = ((k0 + k) << P) + hv;
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k][hv]),
                                                     _mm256_mul_ps(dv, _mm256_set1_ps(xq->d[v * xq->d_stride + 8 * s])), acc[k][h]);
                    acc[k][h] = _mm256_fnmadd_ps(mv, mt[k][hv], a);
                }
        }
    }
    for (int k = 0; k < KN; k++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (k0 + k) * yst + 8 * h, acc[k][h]);
}

#undef Q4K_LANES8

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
#undef FOR_TOKEN_GROUPS

/* tq6 (tiles.c), as the AVX-512 version in two halves of 8 rows, one token (or pair) at a time
 * per pass over a block: each line's nibbles completed with their high bits to 6-bit codes,
 * sums of inputs 0-15 and 16-31 apart, minus 32 times the token's code sums.  u8 (< 64) x s8
 * pairs summed to i16: at most 2 * 63 * 127, and the two per 4 inputs added: 32004 < 32767. */
static void tiles_q6(const qmat_t *w, int64_t t0, int64_t t1, const xq_t *xq, const int32_t *s16, int64_t T, float *y,
                     int64_t yst) {
    const int64_t G = w->nb, ns = w->kp / 16;
    const int P = xq->pair;
    const __m256i m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), one = _mm256_set1_epi16(1);
    for (int64_t t = t0; t < t1; t++)
        for (int64_t k = 0; k < T; k++) {
            const uint8_t *tp = w->qs + t * G * TQ6_BLOCK_BYTES;
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = 0; b < G; b++) {
                const uint8_t *bp = tp + b * TQ6_BLOCK_BYTES;
                for (int o = 0; o < TQ6_BLOCK_BYTES; o += 64) _mm_prefetch((const char *)(bp + 6 * TQ6_BLOCK_BYTES + o), _MM_HINT_T0);
                for (int h = 0; h < 2; h++) {
                    __m256i lo[4], hi[4];
                    for (int g = 0; g < 2; g++) {
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(bp + 256 + 64 * g + 32 * h));
                        for (int e = 0; e < 2; e++) {
                            const int l = 2 * g + e;
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(bp + 64 * l + 32 * h));
                            const __m256i hl = e ? hb : _mm256_slli_epi16(hb, 4);
                            const __m256i hh = e ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
                            lo[l] = _mm256_or_si256(_mm256_and_si256(v, m15), _mm256_and_si256(hl, m30));
                            hi[l] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15), _mm256_and_si256(hh, m30));
                        }
                    }
                    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + 384 + 16 * h)));
                    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + 416 + 16 * h)));
                    for (int hv = 0; hv <= P; hv++) {
                        const int64_t v = (k << P) + hv;
                        const int32_t *xw = (const int32_t *)(xq->q + v * xq->q_stride + 32 * b);
                        __m256i s[2];
                        for (int j = 0; j < 2; j++) {
                            s[j] = _mm256_setzero_si256();
                            for (int e = 0; e < 2; e++) {
                                const int l = 2 * j + e;
                                const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[l], _mm256_set1_epi32(xw[2 * l])),
                                                                     _mm256_maddubs_epi16(hi[l], _mm256_set1_epi32(xw[2 * l + 1])));
                                s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(p16, one));
                            }
                            s[j] = _mm256_sub_epi32(s[j], _mm256_set1_epi32(32 * s16[v * ns + 2 * b + j]));
                        }
                        const __m256 dx = _mm256_set1_ps(xq->d[v * xq->d_stride + b]);
                        const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(d0, dx), acc[h]);
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(d1, dx), a);
                    }
                }
            }
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + k * yst + TQ4_ROWS * (t - t0) + 8 * h, acc[h]);
        }
}

const kernels_t si_kernels_avx2 = {"avx2", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2, 1, &si_attend_avx2, 8,
                                   si_kv_store_avx2, 0, NULL, NULL, cols_group, tiles_q4, tiles_q6, tiles_q4k, quantize_q8k};
#else
typedef int si_empty_translation_unit;
#endif
