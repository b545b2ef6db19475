/* The threads of radixkv.kernels._ckernels: run_parallel (the GIL is released while a kernel
 * runs, the caller is thread 0).
 *
 *   - Built with OpenMP (setup.py tries -fopenmp first): an OpenMP parallel region. torch is
 *     imported first and its wheel ships GNU libgomp under the same soname, so the dynamic
 *     loader hands this module torch's runtime: the kernels run on torch's own worker threads.
 *     Two pools on two cores fight: after every parallel torch op (argmax over the logits,
 *     sampling) libgomp's workers spin for milliseconds (GOMP_SPINCOUNT) on the core a second
 *     pool's worker needs. Sharing one pool took a batch-16 decode step from 84-87 ms to
 *     74-76 ms (docs/model.md).
 *   - Without OpenMP, and in a child forked after the parent used OpenMP (GNU libgomp's threads
 *     do not survive fork(), and its next parallel region would hang): a pthread pool of
 *     nthreads - 1 workers, started on first use and restarted after fork(); workers poll
 *     briefly for the next task, then sleep.
 *   Either way one region runs at a time: other calling threads sleep on a mutex until it ends. */
#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
static int forked_child = 0; /* set in every forked child: OpenMP is not used there */
#endif

#ifndef SPIN_ITERS
#define SPIN_ITERS 30000 /* pause loops (~0.5-1 ms) a worker polls for the next task before sleeping:
                           * longer than the gaps between the kernels of one forward pass */
#endif

/* Every started worker takes part in every task (workers with tid >= nthreads only check in), so
 * each observes each generation exactly once: the caller waits for all of them before the next. */
static struct {
    pthread_mutex_t run_mu; /* one task at a time (kernels run without the GIL) */
    pthread_mutex_t mu;     /* guards sleepers and the start condition */
    pthread_cond_t start_cv;
    pthread_t th[MAX_THREADS];
    unsigned long first_gen[MAX_THREADS + 1]; /* gen when worker i was created */
    int started;       /* workers running */
    int sleepers;      /* workers blocked on start_cv */
    unsigned long gen; /* bumped (release) for every task; read with acquire */
    int pending;       /* workers that have not finished the current task */
    task_fn fn;
    void *arg;
    int nthreads; /* threads working on the current task (caller included) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void *
worker_main(void *p)
{
    int tid = (int)(intptr_t)p;
    unsigned long seen = __atomic_load_n(&pool.first_gen[tid], __ATOMIC_ACQUIRE);
    for (;;) {
        unsigned long g;
        int spins = 0;
        while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) {
            if (++spins < SPIN_ITERS) {
                if (spins % 256 == 0)
                    sched_yield(); /* let another runnable thread have this core */
                else
                    cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            pool.sleepers++;
            while (__atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE) == seen)
                pthread_cond_wait(&pool.start_cv, &pool.mu);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.mu);
            spins = 0;
        }
        seen = g;
        if (tid < pool.nthreads)
            pool.fn(pool.arg, tid, pool.nthreads);
        __atomic_fetch_sub(&pool.pending, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

void
pool_after_fork_child(void)
{
    /* the workers did not survive fork(): start new ones on next use */
#ifdef _OPENMP
    forked_child = 1;
#endif
    pthread_mutex_init(&pool.run_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.start_cv, NULL);
    pool.started = 0;
    pool.sleepers = 0;
    pool.pending = 0;
}

int
usable_cpus(void)
{
    static int n = 0;
    if (n == 0) {
        int c = 0;
#ifdef CPU_COUNT
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof set, &set) == 0)
            c = CPU_COUNT(&set);
#endif
        n = c > 0 ? c : 1;
    }
    return n;
}

void
run_parallel(task_fn fn, void *arg, int n)
{
    if (n > MAX_THREADS)
        n = MAX_THREADS;
    if (n > usable_cpus()) /* spinning workers must never outnumber the cores */
        n = usable_cpus();
    if (n <= 1) {
        fn(arg, 0, 1);
        return;
    }
#ifdef _OPENMP
    if (!forked_child) {
        /* one region at a time, as on the pthread pool: OpenMP gives every calling thread its
         * own team, and two teams' spinning threads on the same cores slowed two concurrent
         * LLM instances 5x; a second caller sleeps on the mutex instead */
        pthread_mutex_lock(&pool.run_mu);
#pragma omp parallel num_threads(n)
        fn(arg, omp_get_thread_num(), omp_get_num_threads());
        pthread_mutex_unlock(&pool.run_mu);
        return;
    }
#endif
    pthread_mutex_lock(&pool.run_mu);
    while (pool.started < n - 1) {
        __atomic_store_n(&pool.first_gen[pool.started + 1], pool.gen, __ATOMIC_RELEASE);
        if (pthread_create(&pool.th[pool.started], NULL, worker_main, (void *)(intptr_t)(pool.started + 1)) != 0)
            break;
        pool.started++;
    }
    if (pool.started < n - 1)
        n = pool.started + 1;
    if (n <= 1) {
        pthread_mutex_unlock(&pool.run_mu);
        fn(arg, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.nthreads = n;
    __atomic_store_n(&pool.pending, pool.started, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool.mu);
    __atomic_store_n(&pool.gen, pool.gen + 1, __ATOMIC_RELEASE);
    if (pool.sleepers)
        pthread_cond_broadcast(&pool.start_cv);
    pthread_mutex_unlock(&pool.mu);
    fn(arg, 0, n);
    for (long spins = 0; __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0; spins++)
        wait_backoff(spins);
    pthread_mutex_unlock(&pool.run_mu);
}

const char *
pool_threading(void)
{
#ifdef _OPENMP
    if (!forked_child)
        return "openmp";
#endif
    return "pthreads";
}
