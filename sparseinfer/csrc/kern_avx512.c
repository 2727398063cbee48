/* AVX-512 kernels without VNNI (VPMADDUBSW + VPMADDWD); see kern_avx512_impl.h. */
#include "common.h"
#if SI_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SI_VNNI 0
#include "kern_avx512_impl.h"

const kernels_t si_kernels_avx512 = {"avx512", quantize, dot_q, dot_f, axpy, read_sum, si_act_avx2, 0, &si_attend_avx512, 16,
                                     si_kv_store_avx2, 0, NULL, NULL, cols_group, tiles_q4, tiles_q6, tiles_q4k, quantize_q8k};

/* si_attend_avx512: attend_impl.h with 16-float vectors for each KV cache type.  The AVX2
 * version is bound by FMA throughput, which the doubled vector width halves; serves both
 * AVX-512 levels (no integer work here).  32 registers: positions always paired. */
static inline __attribute__((always_inline)) __m512 q8_load16(const uint8_t *blk, int64_t j) {
    uint16_t d;
    memcpy(&d, blk, 2);
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + j)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(_cvtsh_ss(d)));
}
#define AT_V __m512
#define AT_W 16
#define AT_LOAD(p) _mm512_loadu_ps(p)
#define AT_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define AT_LOAD_Q8(blk, j) q8_load16(blk, j)
#define AT_STORE(p, v) _mm512_storeu_ps(p, v)
#define AT_ZERO() _mm512_setzero_ps()
#define AT_SET1(x) _mm512_set1_ps(x)
#define AT_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define AT_SUM(v) _mm512_reduce_add_ps(v)
#define AT_PAIR_MAX SI_ATT_MAXG
#define AT_NAME si_attend_heads_avx512
#define AT_KV 0
#include "attend_impl.h"
#define AT_KV 1
#include "attend_impl.h"
#define AT_KV 2
#include "attend_impl.h"

const struct si_attend_fns si_attend_avx512 = {{si_attend_heads_avx512_f32, si_attend_heads_avx512_f16,
                                                si_attend_heads_avx512_q8_0}};
#else
typedef int si_empty_translation_unit;
#endif
