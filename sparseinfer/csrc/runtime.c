/* Run-time setup shared by every operation: which kernel level runs (si_level_names,
 * si_level_supported, si_select, si_kern, and si_act, the level's activation function called
 * directly), the qmat descriptor of a weight (si_qmat_init) and the grow-only per-thread
 * scratch buffers (si_scratch).  Separate from the operations because all of them, and
 * decode.c, depend on it while it depends on none of them. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if SI_ARM && defined(__linux__)
#include <sys/auxv.h>
#elif SI_ARM && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

/* ------------------------------------------------------------------ kernel selection */

const char *const si_level_names[] = {
#if SI_X86
    "avx512amx", "avx512vnni", "avx512", "avx2",
#endif
#if SI_ARM
    "neon_dotprod", "neon",
#endif
    "scalar", NULL};

#if SI_ARM
int si_arm_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & (1UL << 20)) != 0; /* HWCAP_ASIMDDP */
#elif defined(__APPLE__)
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, NULL, 0) == 0 && v;
#else
    return 0;
#endif
}
#endif

static const kernels_t *table_of(const char *name) {
#if SI_X86
    if (!strcmp(name, "avx512amx")) return &si_kernels_avx512amx;
    if (!strcmp(name, "avx512vnni")) return &si_kernels_avx512vnni;
    if (!strcmp(name, "avx512")) return &si_kernels_avx512;
    if (!strcmp(name, "avx2")) return &si_kernels_avx2;
#endif
#if SI_ARM
    if (!strcmp(name, "neon_dotprod")) return &si_kernels_neon_dotprod;
    if (!strcmp(name, "neon")) return &si_kernels_neon;
#endif
    if (!strcmp(name, "scalar")) return &si_kernels_scalar;
    return NULL;
}

int si_level_supported(const char *name) {
#if SI_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (!strcmp(name, "avx512amx")) return avx512 && __builtin_cpu_supports("avx512vnni") && si_amx_supported();
    if (!strcmp(name, "avx512vnni")) return avx512 && __builtin_cpu_supports("avx512vnni");
    if (!strcmp(name, "avx512")) return avx512;
    if (!strcmp(name, "avx2")) return avx2;
#endif
#if SI_ARM
    if (!strcmp(name, "neon_dotprod")) return si_arm_dotprod();
    if (!strcmp(name, "neon")) return 1; /* NEON (Advanced SIMD) is part of every AArch64 CPU */
#endif
    return !strcmp(name, "scalar");
}

/* The CPU multiplies bfloat16 in hardware (AVX512_BF16, or AMX-BF16) with AVX-512 usable: where
 * torch's bfloat16 GEMM runs at hardware speed (sparseinfer/kernels/__init__.py's prompt route). */
int si_cpu_bf16(void) {
#if SI_X86
    if (!si_level_supported("avx512")) return 0; /* leaf 7 exists and the OS saves the zmm state */
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int amx_bf16 = (d >> 22) & 1;
    if (a < 1) return amx_bf16; /* no sub-leaf 1 */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
    return ((a >> 5) & 1) || amx_bf16;
#else
    return 0;
#endif
}

static const kernels_t *KERN;

const kernels_t *si_kern(void) {
    if (!KERN) {
        const char *env = getenv("SPARSEINFER_SIMD");
        if (env && table_of(env) && si_level_supported(env)) {
            KERN = table_of(env);
        } else {
            for (int i = 0; si_level_names[i]; i++)
                if (si_level_supported(si_level_names[i])) {
                    KERN = table_of(si_level_names[i]);
                    break;
                }
        }
    }
    return KERN;
}

const char *si_level(void) { return si_kern()->name; }

/* ------------------------------------------------------------------------- the cache */

int64_t si_l2_bytes(void) {
    static int64_t l2;
    if (!l2) {
        long v = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
        v = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        l2 = v >= 65536 ? (int64_t)v : 1 << 20;
    }
    return l2;
}

int si_select(const char *name) {
    const kernels_t *k = table_of(name);
    if (!k) return -1;
    if (!si_level_supported(name)) return -2;
    KERN = k;
    return 0;
}

int si_qmat_init(qmat_t *w, int fmt, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m,
                 int64_t qs_stride, int64_t d_stride) {
    if (fmt < 0 || fmt >= FMT_COUNT || rows < 0 || cols <= 0 || (!qs && rows > 0)) return -1;
    w->fmt = fmt;
    w->rows = rows;
    w->cols = cols;
    w->kp = (cols + 31) / 32 * 32;
    w->nb = w->kp / 32;
    w->qs = (const uint8_t *)qs;
    w->d = (const uint16_t *)d;
    w->m = (const uint16_t *)m;
    switch (fmt) {
    case FMT_F32: w->row_bytes = 4 * cols; break;
    case FMT_F16: case FMT_BF16: w->row_bytes = 2 * cols; break;
    case FMT_Q8: w->row_bytes = w->kp; break;
    case FMT_Q6: w->row_bytes = w->kp / 4 * 3; break;
    case FMT_Q4K:
        if (cols % 256) return -1;
        w->row_bytes = cols / 256 * SI_Q4K_BYTES;
        break;
    case FMT_TQ4: case FMT_TQ6: case FMT_TQ4K: /* a row's share of its tiles; no strides (tiles are not rows) */
        if (fmt == FMT_TQ4K && cols % 256) return -1;
        w->row_bytes = fmt == FMT_TQ4K ? cols / 256 * (TQ4K_BLOCK_BYTES / TQ4_ROWS)
                                       : w->nb * ((fmt == FMT_TQ4 ? TQ4_BLOCK_BYTES : TQ6_BLOCK_BYTES) / TQ4_ROWS);
        if ((qs_stride && qs_stride != w->row_bytes) || d_stride > 0) return -1;
        break;
    default: w->row_bytes = w->kp / 2; break;
    }
    w->nd = fmt == FMT_Q6 ? 2 * w->nb : fmt == FMT_Q4K || fmt >= FMT_TQ4 ? 0 : w->nb;
    w->ds = w->nd;
    /* strides: 0 = natural; never below the natural widths */
    if (qs_stride) {
        if (qs_stride < w->row_bytes) return -1;
        w->row_bytes = qs_stride;
    }
    if (d_stride) {
        if (d_stride < w->nd) return -1;
        w->ds = d_stride;
    }
    if (fmt >= FMT_Q8 && fmt != FMT_Q4K && fmt < FMT_TQ4 && !d && rows > 0) return -1;
    if (fmt == FMT_Q4 && !m && rows > 0) return -1;
    if (fmt < FMT_Q8 || fmt == FMT_Q4K || fmt >= FMT_TQ4) w->d = w->m = NULL, w->ds = 0;
    if (fmt == FMT_Q6) w->m = NULL;
    return 0;
}

/* -------------------------------------------------------------------- scratch memory */

/* Grow-only per-thread buffers (the calling thread's; workers only read/write them during
 * the call).  Slots: 0,1 = quantized activations, 2 = ffn temporaries, 3 = compaction,
 * 4 = axpy partial sums, 5 = attention scores, 6 = fused decode steps (decode.c),
 * 7 = a worker's temporaries in the neuron-record FFN pass, 8,9 = activations of slot 0,1
 * packed for AMX tiles, 10 = axpy rows in tile order, 11 = the per-16 activation sums of
 * row-tiled q6 products (tiles.c). */
static _Thread_local struct { void *p; size_t n; } TLS[12];

void *si_scratch(int slot, size_t n) {
    if (TLS[slot].n < n) {
        free(TLS[slot].p);
        n = (n + 4095) & ~(size_t)4095;
        if (posix_memalign(&TLS[slot].p, 64, n) != 0) {
            TLS[slot].p = NULL;
            TLS[slot].n = 0;
            return NULL;
        }
        TLS[slot].n = n;
    }
    return TLS[slot].p;
}

void si_act(int act, float *v, int64_t n) { si_kern()->act(act, v, n); }
