/* The AArch64 kernel levels against the scalar level, on random weights of every format:
 * run under qemu-user by tests/c/run_arm_tests.sh (built for aarch64 with the C core, without
 * the Python module).
 *
 *   arm_kernels EXPECT_DOTPROD     (1: the emulated CPU has SDOT, 0: it has not)
 *
 * For each NEON level the CPU supports, each format (q8 with and without m, q4, q6, f32, f16,
 * bf16), several shapes, both activation modes and 1 and 2 threads, the operations gemv,
 * matmul (5 tokens), gemv_rows and axpy_rows are compared with the scalar level's: integer
 * formats and every axpy bit for bit (the NEON kernels form each block's terms as the scalar
 * ones do), float-format products within the accuracy contract (1e-5 of sum |w x|).  Within a
 * level, each matmul row must equal the gemv of its token bit for bit, and results must not
 * depend on the thread count.  Single-token attention agrees with the portable version on
 * every KV cache type.  Exit status 0 when everything holds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../sparseinfer/csrc/ops.h"
#include "../../sparseinfer/csrc/pool.h"

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float frand(void) { return (float)(rnd() % 2000001) / 1000000.0f - 1.0f; } /* [-1, 1] */

typedef struct {
    int fmt, with_m;
    const char *name;
} fmt_t;
static const fmt_t FORMATS[] = {{FMT_Q8, 0, "q8"}, {FMT_Q8, 1, "q8m"}, {FMT_Q4, 1, "q4"}, {FMT_Q6, 0, "q6"},
                                {FMT_F32, 0, "f32"}, {FMT_F16, 0, "f16"}, {FMT_BF16, 0, "bf16"}};
static const int64_t SHAPES[][2] = {{37, 100}, {64, 256}, {16, 1000}, {9, 33}, {24, 160}};

typedef struct {
    qmat_t w;
    uint8_t *qs;
    uint16_t *d, *m;
} weight_t;

static void make_weight(weight_t *wt, const fmt_t *f, int64_t rows, int64_t cols) {
    const int64_t kp = (cols + 31) / 32 * 32, nb = kp / 32;
    int64_t row_bytes;
    switch (f->fmt) {
    case FMT_F32: row_bytes = 4 * cols; break;
    case FMT_F16: case FMT_BF16: row_bytes = 2 * cols; break;
    case FMT_Q8: row_bytes = kp; break;
    case FMT_Q6: row_bytes = kp / 4 * 3; break;
    default: row_bytes = kp / 2;
    }
    const int64_t nd = f->fmt == FMT_Q6 ? 2 * nb : nb;
    wt->qs = malloc((size_t)(rows * row_bytes));
    wt->d = malloc((size_t)(rows * nd) * 2);
    wt->m = malloc((size_t)(rows * nd) * 2);
    for (int64_t i = 0; i < rows * row_bytes; i++) wt->qs[i] = (uint8_t)rnd();
    if (f->fmt == FMT_F32)
        for (int64_t i = 0; i < rows * cols; i++) ((float *)wt->qs)[i] = frand();
    if (f->fmt == FMT_F16)
        for (int64_t i = 0; i < rows * cols; i++) ((uint16_t *)wt->qs)[i] = si_f2h(frand());
    if (f->fmt == FMT_BF16)
        for (int64_t i = 0; i < rows * cols; i++) {
            float v = frand();
            uint32_t b;
            memcpy(&b, &v, 4);
            ((uint16_t *)wt->qs)[i] = (uint16_t)(b >> 16);
        }
    for (int64_t i = 0; i < rows * nd; i++) {
        wt->d[i] = si_f2h(0.01f + 0.02f * (frand() + 1.0f));
        wt->m[i] = si_f2h(-0.1f * (frand() + 1.0f));
    }
    if (si_qmat_init(&wt->w, f->fmt, rows, cols, wt->qs, wt->d, f->with_m ? wt->m : NULL, 0, 0) != 0) {
        fprintf(stderr, "bad test weight %s\n", f->name);
        exit(2);
    }
}

static void free_weight(weight_t *wt) { free(wt->qs), free(wt->d), free(wt->m); }

/* sum over the row of |w x| in double, for the float formats' tolerance */
static double magnitude(const qmat_t *w, int64_t r, const float *x) {
    float *row = malloc((size_t)w->cols * sizeof(float));
    si_dequantize_rows(w, r, r + 1, row);
    double s = 0;
    for (int64_t k = 0; k < w->cols; k++) s += fabs((double)row[k] * x[k]);
    free(row);
    return s;
}

enum { T = 5, NOUT = 4 };
typedef struct {
    float *gemv, *mm, *rows, *axpy;
} outs_t;

static int64_t failures = 0, checks = 0;

static void run_ops(const weight_t *wt, const float *X, const int32_t *sel, int64_t nsel, const float *h, outs_t *o) {
    const qmat_t *w = &wt->w;
    si_gemv(w, X, o->gemv);
    si_matmul(w, X, T, o->mm);
    si_gemv_rows(w, X, sel, nsel, o->rows);
    if (w->fmt != FMT_Q6) si_axpy_rows(w, h, sel, nsel, o->axpy);
}

static void expect(int ok, const char *what, const char *level, const char *fmt, int64_t rows, int64_t cols,
                   int mode, int threads) {
    checks++;
    if (!ok) {
        failures++;
        fprintf(stderr, "FAIL %s: level %s, format %s, %lldx%lld, mode %d, %d threads\n", what, level, fmt,
                (long long)rows, (long long)cols, mode, threads);
    }
}

static int close_to(const float *a, const float *b, int64_t n, const qmat_t *w, const float *X, const int32_t *rows) {
    for (int64_t i = 0; i < n; i++) {
        const double tol = 1e-5 * magnitude(w, rows ? rows[i] : i, X) + 1e-30;
        if (fabs((double)a[i] - (double)b[i]) > tol) return 0;
    }
    return 1;
}

static void alloc_outs(outs_t *o, int64_t rows, int64_t cols) {
    o->gemv = calloc((size_t)rows, sizeof(float));
    o->mm = calloc((size_t)(rows * T), sizeof(float));
    o->rows = calloc((size_t)rows, sizeof(float));
    o->axpy = calloc((size_t)cols, sizeof(float));
}

static void free_outs(outs_t *o) { free(o->gemv), free(o->mm), free(o->rows), free(o->axpy); }

/* single-token attention of the level against the scalar level's (portable) one, every KV
 * cache type: outputs are weighted means of values in [-1, 1], compared to 1e-5 */
static void check_attention(const char *level) {
    const int64_t H = 6, Hk = 2, L = 37;
    const int64_t Ds[] = {64, 36};
    for (int di = 0; di < 2; di++)
        for (int type = 0; type < KV_COUNT; type++) {
            const int64_t D = Ds[di], rb = si_kv_row_bytes(type, D);
            float *q = malloc((size_t)(H * D) * sizeof(float)), *row = malloc((size_t)D * sizeof(float));
            float *o_ref = malloc((size_t)(H * D) * sizeof(float)), *o = malloc((size_t)(H * D) * sizeof(float));
            char *K = malloc((size_t)(Hk * L * rb)), *V = malloc((size_t)(Hk * L * rb));
            for (int64_t i = 0; i < H * D; i++) q[i] = frand();
            for (int64_t h = 0; h < Hk; h++)
                for (int64_t l = 0; l < L; l++) {
                    for (int64_t i = 0; i < D; i++) row[i] = frand();
                    si_kv_store(type, row, K + h * L * rb + l * rb, D);
                    for (int64_t i = 0; i < D; i++) row[i] = frand();
                    si_kv_store(type, row, V + h * L * rb + l * rb, D);
                }
            si_select("scalar");
            si_attend1(type, q, K, V, o_ref, H, Hk, D, L, L * rb, L * rb, 0.125f);
            si_select(level);
            si_attend1(type, q, K, V, o, H, Hk, D, L, L * rb, L * rb, 0.125f);
            double err = 0;
            for (int64_t i = 0; i < H * D; i++) err = fmax(err, fabs((double)o[i] - (double)o_ref[i]));
            expect(err <= 1e-5, "attention agrees with the portable one", level, type == 0 ? "f32" : type == 1 ? "f16" : "q8_0", H, D, 0, 2);
            free(q), free(row), free(o_ref), free(o), free(K), free(V);
        }
}

int main(int argc, char **argv) {
    const int expect_dotprod = argc > 1 ? atoi(argv[1]) : -1;
    const char *levels[] = {"neon_dotprod", "neon"};
    if (expect_dotprod >= 0 && si_level_supported("neon_dotprod") != expect_dotprod) {
        fprintf(stderr, "FAIL: neon_dotprod supported = %d, expected %d\n", si_level_supported("neon_dotprod"),
                expect_dotprod);
        return 1;
    }
    if (!si_level_supported("neon")) {
        fprintf(stderr, "FAIL: the neon level is not available\n");
        return 1;
    }
    int tested = 0;
    for (int li = 0; li < 2; li++) {
        const char *level = levels[li];
        if (!si_level_supported(level)) continue;
        tested++;
        si_pool_set_threads(2);
        check_attention(level);
        for (size_t fi = 0; fi < sizeof FORMATS / sizeof FORMATS[0]; fi++)
            for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
                const fmt_t *f = &FORMATS[fi];
                const int64_t rows = SHAPES[si][0], cols = SHAPES[si][1];
                weight_t wt;
                make_weight(&wt, f, rows, cols);
                float *X = malloc((size_t)(T * cols) * sizeof(float)), *h = malloc((size_t)rows * sizeof(float));
                for (int64_t i = 0; i < T * cols; i++) X[i] = frand() * (i % 7 == 0 ? 8.0f : 1.0f);
                for (int64_t i = 0; i < rows; i++) h[i] = frand();
                int32_t *sel = malloc((size_t)rows * sizeof(int32_t));
                int64_t nsel = 0;
                for (int64_t i = 0; i < rows; i++)
                    if (rnd() % 3) sel[nsel++] = (int32_t)i;
                const int integer = f->fmt >= FMT_Q8;
                for (int mode = 0; mode < 2; mode++) {
                    si_set_act_mode(mode);
                    outs_t ref, got, got1;
                    alloc_outs(&ref, rows, cols), alloc_outs(&got, rows, cols), alloc_outs(&got1, rows, cols);
                    si_pool_set_threads(2);
                    si_select("scalar");
                    run_ops(&wt, X, sel, nsel, h, &ref);
                    si_select(level);
                    run_ops(&wt, X, sel, nsel, h, &got);
                    si_pool_set_threads(1);
                    run_ops(&wt, X, sel, nsel, h, &got1);
                    const size_t fb = sizeof(float);
                    if (integer) {
                        expect(!memcmp(ref.gemv, got.gemv, rows * fb), "gemv equals scalar", level, f->name, rows, cols, mode, 2);
                        expect(!memcmp(ref.mm, got.mm, rows * T * fb), "matmul equals scalar", level, f->name, rows, cols, mode, 2);
                        expect(!memcmp(ref.rows, got.rows, nsel * fb), "gemv_rows equals scalar", level, f->name, rows, cols, mode, 2);
                    } else {
                        expect(close_to(ref.gemv, got.gemv, rows, &wt.w, X, NULL), "gemv within the contract", level, f->name, rows, cols, mode, 2);
                        expect(close_to(ref.rows, got.rows, nsel, &wt.w, X, sel), "gemv_rows within the contract", level, f->name, rows, cols, mode, 2);
                        for (int t = 0; t < T; t++) {
                            float *a = malloc(rows * fb), *b = malloc(rows * fb);
                            for (int64_t i = 0; i < rows; i++) a[i] = ref.mm[t * rows + i], b[i] = got.mm[t * rows + i];
                            expect(close_to(a, b, rows, &wt.w, X + t * cols, NULL), "matmul within the contract", level, f->name, rows, cols, mode, 2);
                            free(a), free(b);
                        }
                    }
                    if (f->fmt != FMT_Q6)
                        expect(!memcmp(ref.axpy, got.axpy, cols * fb), "axpy_rows equals scalar", level, f->name, rows, cols, mode, 2);
                    /* within the level: a matmul row is the gemv of its token; threads do not matter */
                    float *g = malloc(rows * fb);
                    for (int t = 0; t < T; t++) {
                        si_gemv(&wt.w, X + t * cols, g);
                        expect(!memcmp(g, got1.mm + t * rows, rows * fb), "matmul row equals gemv", level, f->name, rows, cols, mode, 1);
                    }
                    free(g);
                    expect(!memcmp(got.gemv, got1.gemv, rows * fb) && !memcmp(got.mm, got1.mm, rows * T * fb) &&
                               !memcmp(got.rows, got1.rows, nsel * fb) &&
                               (f->fmt == FMT_Q6 || !memcmp(got.axpy, got1.axpy, cols * fb)),
                           "1 and 2 threads agree", level, f->name, rows, cols, mode, 1);
                    free_outs(&ref), free_outs(&got), free_outs(&got1);
                }
                free(X), free(h), free(sel);
                free_weight(&wt);
            }
    }
    printf("%d NEON level(s) tested (neon_dotprod %s), %lld checks, %lld failures\n", tested,
           si_level_supported("neon_dotprod") ? "supported" : "not supported", (long long)checks, (long long)failures);
    return failures ? 1 : 0;
}
