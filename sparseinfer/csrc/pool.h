/* A small persistent pthread pool.  `si_pool_run(fn, ctx, n)` runs fn(ctx, c) for every
 * chunk c in [0, n) on the calling thread plus the workers; chunks are claimed dynamically,
 * so callers must make each chunk's result independent of which thread runs it (they do:
 * chunks are disjoint output rows or output columns).  Workers spin for a while after a job
 * (decode issues hundreds of back-to-back calls per token; $SPARSEINFER_SPIN_US, in
 * microseconds, default 100), yielding the core while they spin, then sleep on a condition
 * variable. */
#ifndef SI_POOL_H
#define SI_POOL_H
#include <stdint.h>

typedef void (*si_task_fn)(void *ctx, int64_t chunk);

void si_pool_run(si_task_fn fn, void *ctx, int64_t nchunks);
int si_pool_set_threads(int n);   /* 0 on success */
int si_pool_get_threads(void);
void si_pool_set_spin_us(int us);
int si_pool_default_threads(void);

#endif
