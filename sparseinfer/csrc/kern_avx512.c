/* AVX-512 kernels without VNNI (VPMADDUBSW + VPMADDWD); see kern_avx512_impl.h. */
#include "common.h"
#if SI_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SI_VNNI 0
#include "kern_avx512_impl.h"

const kernels_t si_kernels_avx512 = {"avx512", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2};

/* si_attend_heads_avx2 (kern_avx2.c, which explains the structure) with 16-float vectors:
 * the AVX2 version is bound by FMA throughput (~45 ns per position for 6 heads of 128 on one
 * core), which this halves.  Serves both AVX-512 levels (no integer work here). */
AI void attend512_n(const float *q, const float *K, const float *V, float *sc, float *o, const int N, int64_t D,
                    int64_t L, float scale) {
    int64_t l = 0;
    for (; l + 2 <= L; l += 2) {
        __m512 a0[SI_ATT_MAXG], a1[SI_ATT_MAXG];
        for (int j = 0; j < N; j++) a0[j] = a1[j] = _mm512_setzero_ps();
        const float *k0 = K + l * D, *k1 = k0 + D;
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 x0 = _mm512_loadu_ps(k0 + i), x1 = _mm512_loadu_ps(k1 + i);
            for (int j = 0; j < N; j++) {
                const __m512 qv = _mm512_loadu_ps(q + j * D + i);
                a0[j] = _mm512_fmadd_ps(qv, x0, a0[j]);
                a1[j] = _mm512_fmadd_ps(qv, x1, a1[j]);
            }
        }
        for (int j = 0; j < N; j++) {
            sc[j * L + l] = _mm512_reduce_add_ps(a0[j]) * scale;
            sc[j * L + l + 1] = _mm512_reduce_add_ps(a1[j]) * scale;
        }
    }
    for (; l < L; l++) {
        __m512 acc[SI_ATT_MAXG];
        for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 kv = _mm512_loadu_ps(K + l * D + i);
            for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * D + i), kv, acc[j]);
        }
        for (int j = 0; j < N; j++) sc[j * L + l] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
    si_softmax_rows_avx2(sc, N, L);
    for (int64_t lb = 0; lb < L; lb += ATT_LB) {
        const int64_t le = lb + ATT_LB < L ? lb + ATT_LB : L;
        int64_t i = 0;
        for (; i + 32 <= D; i += 32) {
            __m512 a0[SI_ATT_MAXG], a1[SI_ATT_MAXG];
            for (int j = 0; j < N; j++) {
                a0[j] = lb ? _mm512_loadu_ps(o + j * D + i) : _mm512_setzero_ps();
                a1[j] = lb ? _mm512_loadu_ps(o + j * D + i + 16) : _mm512_setzero_ps();
            }
            for (int64_t t = lb; t < le; t++) {
                const __m512 v0 = _mm512_loadu_ps(V + t * D + i), v1 = _mm512_loadu_ps(V + t * D + i + 16);
                for (int j = 0; j < N; j++) {
                    const __m512 p = _mm512_set1_ps(sc[j * L + t]);
                    a0[j] = _mm512_fmadd_ps(p, v0, a0[j]);
                    a1[j] = _mm512_fmadd_ps(p, v1, a1[j]);
                }
            }
            for (int j = 0; j < N; j++) {
                _mm512_storeu_ps(o + j * D + i, a0[j]);
                _mm512_storeu_ps(o + j * D + i + 16, a1[j]);
            }
        }
        for (; i < D; i += 16) {
            __m512 acc[SI_ATT_MAXG];
            for (int j = 0; j < N; j++) acc[j] = lb ? _mm512_loadu_ps(o + j * D + i) : _mm512_setzero_ps();
            for (int64_t t = lb; t < le; t++) {
                const __m512 vv = _mm512_loadu_ps(V + t * D + i);
                for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(sc[j * L + t]), vv, acc[j]);
            }
            for (int j = 0; j < N; j++) _mm512_storeu_ps(o + j * D + i, acc[j]);
        }
    }
}

void si_attend_heads_avx512(const float *q, const float *K, const float *V, float *sc, float *o, int n, int64_t D,
                            int64_t L, float scale) {
    switch (n) {
    case 1: attend512_n(q, K, V, sc, o, 1, D, L, scale); break;
    case 2: attend512_n(q, K, V, sc, o, 2, D, L, scale); break;
    case 3: attend512_n(q, K, V, sc, o, 3, D, L, scale); break;
    case 4: attend512_n(q, K, V, sc, o, 4, D, L, scale); break;
    case 5: attend512_n(q, K, V, sc, o, 5, D, L, scale); break;
    case 6: attend512_n(q, K, V, sc, o, 6, D, L, scale); break;
    case 7: attend512_n(q, K, V, sc, o, 7, D, L, scale); break;
    default: attend512_n(q, K, V, sc, o, 8, D, L, scale); break;
    }
}
#else
typedef int si_empty_translation_unit;
#endif
