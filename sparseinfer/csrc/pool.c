/* Persistent thread pool; see pool.h.
 *
 * Protocol: `ticket` packs (generation << 32 | next chunk).  The caller first closes the
 * ticket under a new generation (chunk index CLOSED: nothing to claim), then writes
 * fn/ctx/n, then opens the ticket (chunk 0).  Every participant claims chunks by CAS on a
 * ticket of the generation whose fn/ctx/n it read, which fails once the generation moved on.
 * So a worker that saw an old generation and then read fn/ctx/n while the caller was
 * rewriting them for the next job (a mix of two jobs) cannot claim anything: the new values
 * were written after the close, so its CAS sees the new generation.  Without the close, such
 * a worker could claim chunk n_old of the next job with the next job's fn/ctx/n before that
 * job was published, and the chunk then ran twice (a stress test of 2-3 threads and jobs of
 * 2-61 chunks hit it about once per 2 million jobs).  The caller waits until
 * `completed == n` before returning; the job's data stays valid until then.  A second caller
 * that finds the pool busy (another Python thread with the GIL released) runs its job
 * alone. */
#define _GNU_SOURCE
#include "pool.h"
#include "common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if SI_X86
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() do { } while (0)
#endif

#define MAX_THREADS 256
#define CLOSED 0xffffffffu /* chunk index of a ticket whose job is being set up */

static struct {
    _Atomic uint64_t ticket;
    _Atomic int64_t completed;
    _Atomic(si_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int stop;
    _Atomic int sleepers;
    _Atomic int spin_us;
    int nthreads;   /* participants including the caller; 0 = not initialised */
    int nworkers;   /* started workers */
    pthread_t threads[MAX_THREADS];
    pthread_mutex_t mu;       /* guards sleeping */
    pthread_cond_t cv;
    pthread_mutex_t busy;     /* one job at a time */
    pthread_mutex_t config;   /* set_threads */
} P = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv = PTHREAD_COND_INITIALIZER,
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .config = PTHREAD_MUTEX_INITIALIZER,
    .spin_us = 100,
};

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

/* Claim and run chunks of generation `gen` until none is left. */
static void work(uint32_t gen, si_task_fn fn, void *ctx, int64_t n) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
        if ((uint32_t)(t >> 32) != gen || (int64_t)(t & 0xffffffffu) >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        fn(ctx, (int64_t)(t & 0xffffffffu));
        atomic_fetch_add_explicit(&P.completed, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&P.ticket) >> 32);
    for (;;) {
        uint64_t t;
        double t0 = now_us();
        int spins = 0;
        /* spin for a while, then sleep (a closed ticket of a new generation is about to open) */
        while ((uint32_t)((t = atomic_load_explicit(&P.ticket, memory_order_acquire)) >> 32) == seen ||
               (uint32_t)t == CLOSED) {
            if (atomic_load_explicit(&P.stop, memory_order_relaxed)) return NULL;
            CPU_RELAX();
            if (++spins == 256) {
                spins = 0;
                sched_yield(); /* let torch's (or anyone's) runnable threads have the core */
                if (now_us() - t0 > atomic_load_explicit(&P.spin_us, memory_order_relaxed)) {
                    pthread_mutex_lock(&P.mu);
                    atomic_fetch_add(&P.sleepers, 1);
                    while ((uint32_t)(atomic_load(&P.ticket) >> 32) == seen && !atomic_load(&P.stop))
                        pthread_cond_wait(&P.cv, &P.mu);
                    atomic_fetch_sub(&P.sleepers, 1);
                    pthread_mutex_unlock(&P.mu);
                    t0 = now_us();
                }
            }
        }
        seen = (uint32_t)(t >> 32);
#ifdef SI_POOL_STRESS
        SI_POOL_STRESS(); /* tests/test_pool.py: a random delay here, where the race was */
#endif
        /* acquire: if any of these is a later job's, written after that job closed the
         * ticket, the claims in work() see the later generation and fail */
        si_task_fn fn = atomic_load_explicit(&P.fn, memory_order_acquire);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_acquire);
        int64_t n = atomic_load_explicit(&P.n, memory_order_acquire);
        work(seen, fn, ctx, n);
    }
}

static void stop_workers(void) {
    atomic_store(&P.stop, 1);
    pthread_mutex_lock(&P.mu);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.nworkers; i++) pthread_join(P.threads[i], NULL);
    P.nworkers = 0;
    atomic_store(&P.stop, 0);
}

static int start_workers(int nthreads) {
    for (int i = 0; i < nthreads - 1; i++) {
        if (pthread_create(&P.threads[i], NULL, worker_main, NULL) != 0) {
            P.nthreads = P.nworkers + 1;
            return -1;
        }
        P.nworkers++;
    }
    P.nthreads = nthreads;
    return 0;
}

int si_pool_default_threads(void) {
    const char *env = getenv("SPARSEINFER_NUM_THREADS");
    if (env && atoi(env) > 0) return atoi(env) > MAX_THREADS ? MAX_THREADS : atoi(env);
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set) > MAX_THREADS ? MAX_THREADS : CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

static void child_after_fork(void) {
    /* threads do not survive fork: forget them, restart lazily */
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cinit = PTHREAD_COND_INITIALIZER;
    P.mu = init;
    P.busy = init;
    P.config = init;
    P.cv = cinit;
    P.nworkers = 0;
    P.nthreads = 0;
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.stop, 0);
}

static void ensure_started(void) {
    if (P.nthreads) return;
    pthread_mutex_lock(&P.config);
    if (!P.nthreads) {
        static int atfork_done = 0;
        if (!atfork_done) {
            pthread_atfork(NULL, NULL, child_after_fork);
            atfork_done = 1;
        }
        const char *spin = getenv("SPARSEINFER_SPIN_US");
        if (spin) atomic_store(&P.spin_us, atoi(spin));
        start_workers(si_pool_default_threads());
    }
    pthread_mutex_unlock(&P.config);
}

int si_pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    ensure_started();
    pthread_mutex_lock(&P.config);
    pthread_mutex_lock(&P.busy);
    stop_workers();
    int rc = start_workers(n);
    pthread_mutex_unlock(&P.busy);
    pthread_mutex_unlock(&P.config);
    return rc;
}

int si_pool_get_threads(void) {
    ensure_started();
    return P.nthreads;
}

void si_pool_set_spin_us(int us) { atomic_store(&P.spin_us, us < 0 ? 0 : us); }

void si_pool_run(si_task_fn fn, void *ctx, int64_t n) {
    if (n <= 0) return;
    ensure_started();
    if (n == 1 || pthread_mutex_trylock(&P.busy) != 0) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        return;
    }
    if (P.nworkers == 0) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        pthread_mutex_unlock(&P.busy);
        return;
    }
    const uint32_t gen = (uint32_t)(atomic_load(&P.ticket) >> 32) + 1;
    atomic_store(&P.ticket, (uint64_t)gen << 32 | CLOSED); /* before fn/ctx/n change (see top) */
    atomic_store_explicit(&P.fn, fn, memory_order_release);
    atomic_store_explicit(&P.ctx, ctx, memory_order_release);
    atomic_store_explicit(&P.n, n, memory_order_release);
    atomic_store_explicit(&P.completed, 0, memory_order_relaxed);
    atomic_store(&P.ticket, (uint64_t)gen << 32); /* seq_cst: publishes the job */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    work(gen, fn, ctx, n);
    /* wait for chunks still running elsewhere; yield so that a worker waiting for this core
     * (the machine may be oversubscribed) can finish them */
    for (int spins = 0; atomic_load_explicit(&P.completed, memory_order_acquire) < n;) {
        CPU_RELAX();
        if (++spins == 64) {
            spins = 0;
            sched_yield();
        }
    }
    pthread_mutex_unlock(&P.busy);
}
