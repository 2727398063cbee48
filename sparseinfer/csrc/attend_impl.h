/* Single-token attention of N (<= SI_ATT_MAXG) query heads sharing one KV head, written once
 * for a vector width and a KV cache type; included by kern_avx2.c (8 floats), kern_avx512.c
 * (16 floats) and kern_neon.c (4 floats) once per type, with AT_KV set to 0 (KV_F32), 1 (KV_F16) or 2 (KV_Q8_0); they
 * define before including it:
 *   AT_V, AT_W              vector type and floats per vector
 *   AT_LOAD(p), AT_STORE(p, v), AT_ZERO(), AT_SET1(x), AT_FMA(a, b, c), AT_SUM(v)
 *   AT_LOAD_F16(p)          AT_W halves at p as floats (F16C / AVX-512 conversion)
 *   AT_LOAD_Q8(blk, j)      values j..j+AT_W-1 of the Q8_0 block at blk, dequantized
 *   AT_PAIR_MAX             largest N whose paired accumulators (2N) fit in the registers
 *   AT_NAME                 the exported functions' prefix (AT_NAME_f32, _f16, _q8_0)
 *   AT_SOFTMAX(sc, n, L)    optional: the rows' softmax in place (default si_softmax_rows_avx2)
 * N is a compile-time constant per dispatch case, so the per-head accumulators live in
 * registers: with a run-time N they lived on the stack and every FMA waited on a
 * store-to-load round trip, several times slower than this.
 * Scores take two positions per step (each q load serves both, twice the independent FMA
 * chains) where the registers allow; o = P V runs over blocks of ATT_LB positions (their V
 * rows stay in L1/L2 while column strips of two vectors pass over them, one broadcast of a
 * score serving both; the strips' partial sums go through o between blocks).  Summation
 * order depends on N, D and L only.  D is a multiple of AT_W (which divides 32: a vector
 * never straddles two Q8_0 blocks).  K and V rows are converted to floats as they are
 * loaded: the arithmetic is the f32 kernel's on the dequantized values. */

#ifndef AT_SOFTMAX
#define AT_SOFTMAX si_softmax_rows_avx2
#endif
#define AT_CAT2(a, b) a##_##b
#define AT_CAT(a, b) AT_CAT2(a, b)
#if AT_KV == 0
#define AT_SFX f32
#define AT_KLD(row, i) AT_LOAD((const float *)(row) + (i))
#elif AT_KV == 1
#define AT_SFX f16
#define AT_KLD(row, i) AT_LOAD_F16((const uint16_t *)(row) + (i))
#else
#define AT_SFX q8_0
#define AT_KLD(row, i) AT_LOAD_Q8((const uint8_t *)(row) + ((i) >> 5) * SI_Q8_0_BLOCK, (i) & 31)
#endif

static inline __attribute__((always_inline)) void
AT_CAT(attend_n, AT_SFX)(const float *q, const char *K, const char *V, float *sc, float *o, const int N, int64_t D,
                         int64_t L, float scale) {
    const int64_t rb = si_kv_row_bytes(AT_KV, D);
    int64_t l = 0;
    if (N <= AT_PAIR_MAX) {
        for (; l + 2 <= L; l += 2) {
            AT_V a0[SI_ATT_MAXG], a1[SI_ATT_MAXG];
            for (int j = 0; j < N; j++) a0[j] = a1[j] = AT_ZERO();
            const char *k0 = K + l * rb, *k1 = k0 + rb;
            for (int64_t i = 0; i < D; i += AT_W) {
                const AT_V x0 = AT_KLD(k0, i), x1 = AT_KLD(k1, i);
                for (int j = 0; j < N; j++) {
                    const AT_V qv = AT_LOAD(q + j * D + i);
                    a0[j] = AT_FMA(qv, x0, a0[j]);
                    a1[j] = AT_FMA(qv, x1, a1[j]);
                }
            }
            for (int j = 0; j < N; j++) {
                sc[j * L + l] = AT_SUM(a0[j]) * scale;
                sc[j * L + l + 1] = AT_SUM(a1[j]) * scale;
            }
        }
    }
    for (; l < L; l++) {
        AT_V acc[SI_ATT_MAXG];
        for (int j = 0; j < N; j++) acc[j] = AT_ZERO();
        for (int64_t i = 0; i < D; i += AT_W) {
            const AT_V kv = AT_KLD(K + l * rb, i);
            for (int j = 0; j < N; j++) acc[j] = AT_FMA(AT_LOAD(q + j * D + i), kv, acc[j]);
        }
        for (int j = 0; j < N; j++) sc[j * L + l] = AT_SUM(acc[j]) * scale;
    }
    AT_SOFTMAX(sc, N, L);
    for (int64_t lb = 0; lb < L; lb += ATT_LB) {
        const int64_t le = lb + ATT_LB < L ? lb + ATT_LB : L;
        int64_t i = 0;
        if (N <= AT_PAIR_MAX) {
            for (; i + 2 * AT_W <= D; i += 2 * AT_W) {
                AT_V a0[SI_ATT_MAXG], a1[SI_ATT_MAXG];
                for (int j = 0; j < N; j++) {
                    a0[j] = lb ? AT_LOAD(o + j * D + i) : AT_ZERO();
                    a1[j] = lb ? AT_LOAD(o + j * D + i + AT_W) : AT_ZERO();
                }
                for (int64_t t = lb; t < le; t++) {
                    const AT_V v0 = AT_KLD(V + t * rb, i), v1 = AT_KLD(V + t * rb, i + AT_W);
                    for (int j = 0; j < N; j++) {
                        const AT_V p = AT_SET1(sc[j * L + t]);
                        a0[j] = AT_FMA(p, v0, a0[j]);
                        a1[j] = AT_FMA(p, v1, a1[j]);
                    }
                }
                for (int j = 0; j < N; j++) {
                    AT_STORE(o + j * D + i, a0[j]);
                    AT_STORE(o + j * D + i + AT_W, a1[j]);
                }
            }
        }
        for (; i < D; i += AT_W) {
            AT_V acc[SI_ATT_MAXG];
            for (int j = 0; j < N; j++) acc[j] = lb ? AT_LOAD(o + j * D + i) : AT_ZERO();
            for (int64_t t = lb; t < le; t++) {
                const AT_V vv = AT_KLD(V + t * rb, i);
                for (int j = 0; j < N; j++) acc[j] = AT_FMA(AT_SET1(sc[j * L + t]), vv, acc[j]);
            }
            for (int j = 0; j < N; j++) AT_STORE(o + j * D + i, acc[j]);
        }
    }
}

void AT_CAT(AT_NAME, AT_SFX)(const float *q, const void *Kv, const void *Vv, float *sc, float *o, int n, int64_t D,
                            int64_t L, float scale) {
    const char *K = Kv, *V = Vv;
    switch (n) {
    case 1: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 1, D, L, scale); break;
    case 2: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 2, D, L, scale); break;
    case 3: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 3, D, L, scale); break;
    case 4: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 4, D, L, scale); break;
    case 5: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 5, D, L, scale); break;
    case 6: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 6, D, L, scale); break;
    case 7: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 7, D, L, scale); break;
    default: AT_CAT(attend_n, AT_SFX)(q, K, V, sc, o, 8, D, L, scale); break;
    }
}

#undef AT_SFX
#undef AT_KLD
#undef AT_KV
