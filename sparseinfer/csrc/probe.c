/* Memory-bandwidth probes: seconds for parallel passes that read a buffer or a list of rows
 * the way the kernels do, without their arithmetic (si_read_seconds, si_read_rows_seconds).
 * They measure the machine for the benchmarks and the tests and take no part in inference,
 * hence a file of their own. */
#define _GNU_SOURCE
#include "ops_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------- bandwidth probe */

typedef struct {
    const kernels_t *k;
    const uint8_t *p;
    int64_t nbytes, chunk;
    uint64_t sink[256];
} read_ctx;

static void read_task(void *p, int64_t c) {
    read_ctx *a = p;
    int64_t i0 = c * a->chunk, i1 = i0 + a->chunk < a->nbytes ? i0 + a->chunk : a->nbytes;
    __atomic_fetch_add(&a->sink[c & 255], a->k->read_sum(a->p + i0, i1 - i0), __ATOMIC_RELAXED);
}

typedef struct {
    const kernels_t *k;
    const uint8_t *p;
    int64_t row_bytes, n, chunk;
    int prefetch;
    const int32_t *rows;
    uint64_t sink[256];
} rows_ctx;

static void read_rows_task(void *p, int64_t c) {
    rows_ctx *a = p;
    int64_t j0 = c * a->chunk, j1 = j0 + a->chunk < a->n ? j0 + a->chunk : a->n;
    uint64_t acc = 0;
    if (a->prefetch == 2) {
        /* 8 rows at a time, line by line across them (8 streams for the hardware prefetchers,
         * as the one-token dot tiles read): one word per 64-byte line fetches the line */
        for (int64_t j = j0; j < j1; j += 8) {
            const int nr = j1 - j < 8 ? (int)(j1 - j) : 8;
            const uint8_t *r[8];
            for (int l = 0; l < nr; l++) r[l] = a->p + (int64_t)a->rows[j + l] * a->row_bytes;
            for (int64_t o = 0; o < a->row_bytes; o += 64)
                for (int l = 0; l < nr; l++) {
                    uint64_t v;
                    memcpy(&v, r[l] + o, 8);
                    acc += v;
                }
        }
        __atomic_fetch_add(&a->sink[c & 255], acc, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t j = j0; j < j1; j++) {
        if (a->prefetch && j + 8 < j1) {
            const uint8_t *q = a->p + (int64_t)a->rows[j + 8] * a->row_bytes;
            for (int64_t o = 0; o < a->row_bytes; o += 64) __builtin_prefetch(q + o, 0, 2);
        }
        acc += a->k->read_sum(a->p + (int64_t)a->rows[j] * a->row_bytes, a->row_bytes);
    }
    __atomic_fetch_add(&a->sink[c & 255], acc, __ATOMIC_RELAXED);
}

/* Seconds for `reps` parallel passes reading whole rows rows[0..n) of row_bytes each: the
 * memory system's speed for the access pattern of the sparse kernels, without their work.
 * prefetch: 0 rows one after another (hardware prefetchers only), 1 the same with each row
 * prefetched 8 rows ahead, 2 eight rows at a time, line by line across them. */
double si_read_rows_seconds(const uint8_t *p, int64_t row_bytes, const int32_t *rows, int64_t n, int reps, int prefetch) {
    static volatile uint64_t keep;
    rows_ctx *a = calloc(1, sizeof *a);
    if (!a) abort();
    a->k = si_kern();
    a->p = p;
    a->row_bytes = row_bytes;
    a->rows = rows;
    a->n = n;
    a->prefetch = prefetch;
    a->chunk = (n + 8 * nthreads() - 1) / (8 * nthreads());
    if (a->chunk < 1) a->chunk = 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < reps; r++) si_pool_run(read_rows_task, a, (n + a->chunk - 1) / a->chunk);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 256; i++) keep += a->sink[i];
    free(a);
    return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
}

double si_read_seconds(const uint8_t *p, int64_t nbytes, int reps) {
    static volatile uint64_t keep;
    read_ctx *a = calloc(1, sizeof *a);
    if (!a) abort();
    a->k = si_kern();
    a->p = p;
    a->nbytes = nbytes;
    a->chunk = up((nbytes + 16 * nthreads() - 1) / (16 * nthreads()), 4096);
    int64_t nchunks = (nbytes + a->chunk - 1) / a->chunk;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < reps; r++) si_pool_run(read_task, a, nchunks);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 256; i++) keep += a->sink[i];
    free(a);
    return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
}
