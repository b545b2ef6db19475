/* radixkv._ckernels: float32 CPU kernels for the decode step (AVX2 + FMA, a small thread pool).
 *
 * The Python wrappers and the checks on every argument live in radixkv/kernels/cpu.py (and
 * radixkv/executor/cpu_decode.py for decode_step); the functions here trust their arguments:
 * raw addresses of contiguous float32 / int32 / int64 buffers, passed as integers.
 *
 * available() -> bool
 *   True when this CPU has AVX2, FMA and F16C (checked at run time; the module is built for any
 *   x86-64, only the kernels are compiled for AVX2). Every other function needs it.
 *
 * packed_bytes(fmt, N, K) -> int, pack_weight(w, N, K, ldw, fmt, out, out_bytes) -> bool
 *   Pack W [N, K] (rows ldw floats apart) for sgemm_packed: a 64-byte header (magic, format, N,
 *   K), then panels of 16 output columns in format fmt: 0 float32, 1 Q4_1-style 4-bit affine
 *   blocks, 2 Q8_0-style int8 blocks (32 k per block, fp16 scales; layouts at pack_weight). The
 *   block formats are lossless or refused: pack_weight returns False unless every weight decodes
 *   to exactly its float32 value, as it does for weights that GGUF Q4_1 / Q8_0 tensors were
 *   dequantized to. packed_bytes is 0 when K does not suit fmt (not a multiple of 32).
 *
 * sgemm_packed(x, M, K, ldx, wp, N, bias, c, ldc, nthreads)
 *   C[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]). x: X, rows ldx floats apart. wp: W as written by
 *   pack_weight (its header is checked against N and K). bias: bias[N] or 0. c: C, rows ldc
 *   floats apart. Method: the register-blocked micro-kernel of Goto & van de Geijn (2008) / BLIS
 *   (Van Zee & van de Geijn 2015): a 6 x 16 block of C lives in 12 AVX registers; each k step
 *   loads one packed W row (16 floats, one cache line) and broadcasts 6 X values; a block-format
 *   panel is first decoded 128 k at a time into float32 in L1. See gemm_task for the blocking
 *   and the prefetching. Each C element is one float32 FMA chain over k (a summation order other
 *   than MKL's: equal up to float32 rounding), the same bits in every format.
 *
 * paged_attention(q, req_meta, n_req, kv_indices, page_size, k_cache, v_cache, num_q_heads,
 *                 num_kv_heads, head_dim, sm_scale, out, nthreads)
 *   FlashInfer-paged-prefill semantics (causal, bottom-right aligned) for the requests given.
 *   req_meta: int32 [4, n_req]: first query row, query count q_len, offset into kv_indices
 *   (kv_indptr) and KV length kv_len of each request. q / out: [T, Hq, D]. Position p of a
 *   request lives in slot page * page_size + p % page_size of k_cache / v_cache ([num_slots,
 *   Hkv, D]), page = kv_indices[kv_indptr + p / page_size]. Query row j attends to positions
 *   0 .. kv_len - q_len + j. GQA: query head h reads KV head h / (Hq / Hkv). Softmax in float32,
 *   max subtracted (two passes, not online). head_dim must be a multiple of 8.
 *
 * add_rms_norm(delta, residual, out, M, K, w, eps), rope_inplace(x, T, nh, d, ldx, cos, sin),
 * silu_mul(gate_up, out, M, I): RMSNorm with the residual add fused, rotate-half RoPE in place,
 *   SwiGLU's silu(gate) * up (one thread each; see the functions).
 *
 * apply_token_bitmask(logits, ldl, bitmask, ldb, rows, n_rows, vocab): grammar masks (xgrammar's
 *   int32 token bitmask, bit j of a row allows token j): logits[r, j] = -inf for every row r in
 *   rows[n_rows] (int64) and token j < vocab whose bit is 0. Rows ldl floats / ldb words apart.
 *
 * step_plan(...), step_set_rope(...), decode_step(...): one whole forward pass of a decode batch
 *   (every layer, the final norm and the LM head) in one call, for radixkv/executor/cpu_decode.py;
 *   see py_step_plan and py_decode_step.
 *
 * advise_hugepages(addr, nbytes) -> bool: madvise(MADV_HUGEPAGE) on the 2 MiB pages inside.
 *
 * threading() -> str: "openmp" or "pthreads", what run_parallel uses in this process now.
 *
 * Threads (run_parallel; the GIL is released while a kernel runs, the caller is thread 0):
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
 *   Either way one region runs at a time: other calling threads sleep on a mutex until it ends.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define RK_X86 1
#include <immintrin.h>
#else
#define RK_X86 0
#endif

#define MAX_THREADS 64

#ifdef _OPENMP
#include <omp.h>
static int forked_child = 0; /* set in every forked child: OpenMP is not used there */
#endif

/* ------------------------------------------------------------------ thread pool */

typedef void (*task_fn)(void *arg, int tid, int nthreads);

#ifndef SPIN_ITERS
#define SPIN_ITERS 30000 /* pause loops (~0.5-1 ms) a worker polls for the next task before sleeping:
                           * longer than the gaps between the kernels of one forward pass */
#endif

static inline void
cpu_relax(void)
{
#if RK_X86
    _mm_pause();
#endif
}

/* One poll of a wait for another thread: pause for the first 2,000 polls, then yield the core
 * (the thread waited for is late, probably descheduled: give it the core). */
static inline void
wait_backoff(long spins)
{
    if (spins < 2000)
        cpu_relax();
    else
        sched_yield();
}

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

static void
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

/* CPUs this process may run on (its affinity mask), counted once. */
static int
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

/* Runs fn(arg, tid, n) for tid in [0, n) on n threads (the caller is tid 0); n is capped at the
 * usable CPUs (OpenMP may give fewer threads: fn gets the count that runs). */
static void
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

/* ------------------------------------------------------------------ exp */

#if RK_X86
/* exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), exp(r) by
 * its degree-6 Taylor/minimax polynomial (Cephes expf coefficients, S. Moshier), times 2^n built
 * in the exponent bits. Relative error ~2 ulp; x is clamped to [-87.3, 88.7] (no inf/denormals:
 * exp(-87.3) ~ 1e-38 stands in for 0, which only the softmax of -inf-free scores sees). */
__attribute__((target("avx2,fma"))) static inline __m256
exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* ------------------------------------------------------------------ GEMM */

#define NR 16
#define MR 6
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef KC
#define KC 128 /* rows of a weight panel per block (8 KiB) */
#endif
#ifndef PF_BLOCKS
#define PF_BLOCKS 2 /* blocks ahead that are prefetched */
#endif

/* A packed weight: a 64-byte header, then the panels of its format (see pack_weight). */
#define PW_MAGIC 0x31574b52u /* "RKW1" */
enum { PW_F32 = 0, PW_Q4_1 = 1, PW_Q8_0 = 2 };
typedef struct {
    uint32_t magic, fmt;
    int64_t n, k;
    char pad[40];
} pw_header;
#define QB 32                               /* weights per quantization block (along k) */
#define Q4_GROUP (NR * 2 * 2 + QB * NR / 2) /* 16 fp16 d, 16 fp16 m, 32 k x 8 bytes of nibbles */
#define Q8_GROUP (NR * 2 + QB * NR)         /* 16 fp16 d, 32 k x 16 int8 */

typedef struct {
    const float *x;
    const float *xs; /* x's block sums (block formats), M * K / QB */
    Py_ssize_t M, K, ldx;
    const pw_header *w;
    Py_ssize_t N;
    const float *bias;
    float *c;
    Py_ssize_t ldc;
    Py_ssize_t next; /* next untaken panel (atomic): threads that start late take less */
} gemm_args;

#if RK_X86
/* C[0:mr, 0:nv] (+)= X[0:mr, k0 : k0 + kc] @ panel block (+ bias): the block's kc rows of the
 * panel (64 bytes each) stay in L1 while every row block of X uses them. first: start from 0
 * (else from C); bias: added (last block only, else NULL); pf: a line to prefetch per k step
 * (NULL: none). Inlined with constant mr. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
ukernel(const int mr, Py_ssize_t kc, const float *x, Py_ssize_t ldx, const float *wp, const float *pf, float *c,
        Py_ssize_t ldc, const float *bias, int nv, int first)
{
    __m256 acc[MR][2];
    float tmp[NR];
    for (int i = 0; i < mr; i++) {
        if (first) {
            acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        } else if (nv == NR) {
            acc[i][0] = _mm256_loadu_ps(c + i * ldc);
            acc[i][1] = _mm256_loadu_ps(c + i * ldc + 8);
        } else {
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, c + i * ldc, (size_t)nv * sizeof(float));
            acc[i][0] = _mm256_loadu_ps(tmp);
            acc[i][1] = _mm256_loadu_ps(tmp + 8);
        }
    }
    for (Py_ssize_t k = 0; k < kc; k++) {
        if (pf)
            _mm_prefetch((const char *)(pf + k * NR), PF_HINT);
        __m256 w0 = _mm256_loadu_ps(wp + k * NR);
        __m256 w1 = _mm256_loadu_ps(wp + k * NR + 8);
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(a, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, w1, acc[i][1]);
        }
    }
    if (bias) {
        float bb[NR] = {0};
        memcpy(bb, bias, (size_t)nv * sizeof(float));
        __m256 b0 = _mm256_loadu_ps(bb), b1 = _mm256_loadu_ps(bb + 8);
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm256_add_ps(acc[i][0], b0);
            acc[i][1] = _mm256_add_ps(acc[i][1], b1);
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nv == NR) {
            _mm256_storeu_ps(c + i * ldc, acc[i][0]);
            _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
        } else {
            _mm256_storeu_ps(tmp, acc[i][0]);
            _mm256_storeu_ps(tmp + 8, acc[i][1]);
            memcpy(c + i * ldc, tmp, (size_t)nv * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------ block formats: the factored sum
 *
 * A block-format weight is w[k, n] = q[k, n] * d[b, n] (+ m[b, n] for Q4_1) in each block b of QB = 32
 * k (fp16 d, m; q 0..15 or int8). Every kernel (the micro-kernel, the one-row GEMV on AVX2 and on
 * AVX-512) computes an output as the same sequence of float32 operations:
 *
 *     y = 0;  for each block b in order:  t = 0;  for k in the block in order:  t = fma(x[k], q[k], t);
 *                                          y = fma(t, d[b], y);  y = fma(S[b], m[b], y)  (Q4_1 only)
 *     y = y + bias
 *
 * with S[b] = the sum of x over block b (block_sums: one fixed order). That is the value of
 * sum_k x[k] * w[k] with the block scale factored out: one FMA per weight (and 1-2 per 32) instead
 * of a decode and an FMA, and q (exact in float32) is decoded without the scale. The result is not
 * the bits of the float32 panels' chain over the decoded weights (the rounding differs by ulps), but
 * it is the same in every kernel, for any row count, thread count and ISA. The weights themselves are
 * still exact: a one-hot x gives back w bit for bit (t = q, fma(q, d, 0) = q * d exactly,
 * fma(1, m, q * d) rounds once as gguf-py's d * q + m). */

/* s[b] = x[32 b] + ... + x[32 b + 31] for b < K / QB, in one fixed order (every path uses this). */
__attribute__((target("avx2,fma"))) static void
block_sums(const float *x, Py_ssize_t K, float *s)
{
    for (Py_ssize_t b = 0; b < K / QB; b++) {
        const float *p = x + b * QB;
        __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        s[b] = _mm_cvtss_f32(h);
    }
}

/* Block sums of M rows of x (ldx apart) into xs (K / QB per row); nothing when K % QB (no block
 * format fits such a weight). */
static void
block_sums_rows(const float *x, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, float *xs)
{
    if (K % QB)
        return;
    for (Py_ssize_t i = 0; i < M; i++)
        block_sums(x + i * ldx, K, xs + i * (K / QB));
}

/* One k-block (kc rows, a multiple of QB) of a quantized panel: its q as float32 rows of 16 (the
 * f32 panel layout) in buf, without the scale (exact: q is a small integer). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
dequant_block(int fmt, const uint8_t *g, Py_ssize_t kc, float *buf)
{
    for (Py_ssize_t k0 = 0; k0 < kc; k0 += QB, buf += QB * NR) {
        if (fmt == PW_Q4_1) {
            const uint8_t *qs = g + 64;
            const __m256i lo4 = _mm256_set1_epi32(15);
            for (int k = 0; k < QB; k++) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * k)));
                _mm256_storeu_ps(buf + k * NR, _mm256_cvtepi32_ps(_mm256_and_si256(b, lo4)));
                _mm256_storeu_ps(buf + k * NR + 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
            }
            g += Q4_GROUP;
        } else {
            const uint8_t *qs = g + 32;
            for (int k = 0; k < QB; k++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(qs + 16 * k));
                _mm256_storeu_ps(buf + k * NR, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
                _mm256_storeu_ps(buf + k * NR + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
            }
            g += Q8_GROUP;
        }
    }
}

/* 16 floats of c (nv of them real) as two vectors, and back. */
__attribute__((target("avx2"), always_inline)) static inline void
load16(const float *c, int nv, __m256 *a0, __m256 *a1)
{
    if (nv == NR) {
        *a0 = _mm256_loadu_ps(c), *a1 = _mm256_loadu_ps(c + 8);
    } else {
        float tmp[NR] = {0};
        memcpy(tmp, c, (size_t)nv * sizeof(float));
        *a0 = _mm256_loadu_ps(tmp), *a1 = _mm256_loadu_ps(tmp + 8);
    }
}

__attribute__((target("avx2"), always_inline)) static inline void
store16(float *c, int nv, __m256 a0, __m256 a1)
{
    if (nv == NR) {
        _mm256_storeu_ps(c, a0), _mm256_storeu_ps(c + 8, a1);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, a0), _mm256_storeu_ps(tmp + 8, a1);
        memcpy(c, tmp, (size_t)nv * sizeof(float));
    }
}

/* The micro-kernel of the block formats, one block of QB k for mr rows: t = x . q (the block's q in
 * qb, 16 columns a k), then y = fma(t, d, y) (+ fma(S, m, y) for Q4_1) with y from c (0 if first),
 * + bias (last block only, else NULL), back into c. xs: the rows' sums of this block (ldxs apart). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
ukernel_q(const int mr, const int fmt, const float *x, Py_ssize_t ldx, const float *qb, const float *xs,
          Py_ssize_t ldxs, __m256 d0, __m256 d1, __m256 m0, __m256 m1, float *c, Py_ssize_t ldc, const float *bias,
          int nv, int first)
{
    __m256 t[MR][2];
    for (int i = 0; i < mr; i++)
        t[i][0] = t[i][1] = _mm256_setzero_ps();
    for (int k = 0; k < QB; k++) {
        __m256 w0 = _mm256_loadu_ps(qb + k * NR);
        __m256 w1 = _mm256_loadu_ps(qb + k * NR + 8);
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            t[i][0] = _mm256_fmadd_ps(a, w0, t[i][0]);
            t[i][1] = _mm256_fmadd_ps(a, w1, t[i][1]);
        }
    }
    __m256 b0 = _mm256_setzero_ps(), b1 = b0;
    if (bias)
        load16(bias, nv, &b0, &b1);
    for (int i = 0; i < mr; i++) {
        __m256 y0 = _mm256_setzero_ps(), y1 = y0;
        if (!first)
            load16(c + i * ldc, nv, &y0, &y1);
        y0 = _mm256_fmadd_ps(t[i][0], d0, y0);
        y1 = _mm256_fmadd_ps(t[i][1], d1, y1);
        if (fmt == PW_Q4_1) {
            __m256 s = _mm256_broadcast_ss(xs + i * ldxs);
            y0 = _mm256_fmadd_ps(s, m0, y0);
            y1 = _mm256_fmadd_ps(s, m1, y1);
        }
        if (bias) {
            y0 = _mm256_add_ps(y0, b0);
            y1 = _mm256_add_ps(y1, b1);
        }
        store16(c + i * ldc, nv, y0, y1);
    }
}

/* ------------------------------------------------------------------ GEMV (M = 1)
 *
 * One row of X against P (up to 4) panels at a time: every output is the same sequence of
 * operations as in the micro-kernel (float32 panels: one FMA chain over k in order, bias added at
 * the end; block formats: the factored sum above), so the bits are the same; only the chains of P
 * panels are interleaved, so that the FMA latency (4 cycles) is hidden behind 2P independent
 * chains instead of the micro-kernel's 2 at M = 1. The block formats' q are decoded in registers
 * instead of through an L1 buffer. */

/* Which vector kernels run (set once by cpu_ok, changed by set_isa): ISA_AVX512 when the CPU has
 * AVX-512 F/BW/VL and RADIXKV_KERNELS_ISA is not "avx2", else ISA_AVX2. Only the one-row GEMV has
 * an AVX-512 form; every other kernel is AVX2 on both. */
enum { ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int rk_isa = ISA_AVX2;
static int rk_has_avx512 = 0;

#ifndef GEMV_PF512
#define GEMV_PF512 8 /* groups ahead that the AVX-512 GEMV prefetches in each panel */
#endif
#ifndef GEMV_PF
#define GEMV_PF 4 /* groups (32 k) ahead that the GEMV prefetches in each panel */
#endif

/* The 16 outputs of a panel (nv of them real) from two accumulators, plus bias. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
gemv_store(__m256 a0, __m256 a1, const float *bias, float *c, int nv)
{
    if (bias) {
        float bb[NR] = {0};
        memcpy(bb, bias, (size_t)nv * sizeof(float));
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bb));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bb + 8));
    }
    if (nv == NR) {
        _mm256_storeu_ps(c, a0);
        _mm256_storeu_ps(c + 8, a1);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        memcpy(c, tmp, (size_t)nv * sizeof(float));
    }
}

/* The accumulators are named variables, not an array: GCC keeps an array of vectors in
 * registers but also stores it to the stack on every k, which cost ~1/3 of the loop. */

/* t_j += x_k * q of panel j's step k (Q4_1: nibbles; Q8_0: int8), columns 0-7 and 8-15. */
#define Q4_T(j, k)                                                                                          \
    do {                                                                                                    \
        __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs##j + 8 * (k))));            \
        t##j##0 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_and_si256(b_, lo4)), t##j##0);             \
        t##j##1 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_srli_epi32(b_, 4)), t##j##1);              \
    } while (0)
#define Q8_T(j, k)                                                                                          \
    do {                                                                                                    \
        __m128i b_ = _mm_loadu_si128((const __m128i *)(qs##j + 16 * (k)));                                  \
        t##j##0 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b_)), t##j##0);             \
        t##j##1 = _mm256_fmadd_ps(xb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b_, 8))), t##j##1); \
    } while (0)
/* y_j = fma(t_j, d, y_j) (+ fma(S, m, y_j)) at the end of a block (group header at gp_j). */
#define Q_FOLD(j)                                                                                           \
    do {                                                                                                    \
        y[j][0] = _mm256_fmadd_ps(t##j##0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gp[j])), y[j][0]); \
        y[j][1] = _mm256_fmadd_ps(t##j##1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gp[j] + 16))), y[j][1]); \
        if (fmt == PW_Q4_1) {                                                                               \
            y[j][0] = _mm256_fmadd_ps(s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gp[j] + 32))), y[j][0]); \
            y[j][1] = _mm256_fmadd_ps(s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gp[j] + 48))), y[j][1]); \
        }                                                                                                   \
    } while (0)

/* c[16 j ...] = x . panel j (+ bias) for P = 1 .. 4 panels of a block format fmt (xs: x's block
 * sums), in the factored order above: 2P chains of t, one FMA per 8 weights. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
gemv_q(const int P, const int fmt, const float *x, const float *xs, Py_ssize_t K, const uint8_t *const *pan,
       const float *const *bias, float *const *c, const int *nv)
{
    const Py_ssize_t group = fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP, qoff = fmt == PW_Q4_1 ? 64 : 32;
    const __m256i lo4 = _mm256_set1_epi32(15);
    __m256 y[4][2];
    for (int j = 0; j < 4; j++)
        y[j][0] = y[j][1] = _mm256_setzero_ps();
    (void)lo4;
    for (Py_ssize_t g0 = 0, b = 0; g0 < K; g0 += QB, b++) {
        const float *xk = x + g0;
        const uint8_t *gp[4];
        for (int j = 0; j < P; j++) {
            gp[j] = pan[j] + b * group;
            for (int off = 0; off < group; off += 64)
                _mm_prefetch((const char *)(gp[j] + GEMV_PF * group + off), _MM_HINT_T0);
        }
        const uint8_t *qs0 = gp[0] + qoff, *qs1 = gp[P > 1 ? 1 : 0] + qoff;
        const uint8_t *qs2 = gp[P > 2 ? 2 : 0] + qoff, *qs3 = gp[P > 3 ? 3 : 0] + qoff;
        __m256 t00 = _mm256_setzero_ps(), t01 = t00, t10 = t00, t11 = t00, t20 = t00, t21 = t00, t30 = t00, t31 = t00;
        for (int k = 0; k < QB; k++) {
            __m256 xb = _mm256_broadcast_ss(xk + k);
            if (fmt == PW_Q4_1) {
                Q4_T(0, k);
                if (P > 1)
                    Q4_T(1, k);
                if (P > 2)
                    Q4_T(2, k);
                if (P > 3)
                    Q4_T(3, k);
            } else {
                Q8_T(0, k);
                if (P > 1)
                    Q8_T(1, k);
                if (P > 2)
                    Q8_T(2, k);
                if (P > 3)
                    Q8_T(3, k);
            }
        }
        const __m256 s = _mm256_broadcast_ss(xs + b);
        (void)s;
        Q_FOLD(0);
        if (P > 1)
            Q_FOLD(1);
        if (P > 2)
            Q_FOLD(2);
        if (P > 3)
            Q_FOLD(3);
    }
    for (int j = 0; j < P; j++)
        gemv_store(y[j][0], y[j][1], bias[j], c[j], nv[j]);
}
#undef Q4_T
#undef Q8_T
#undef Q_FOLD

/* The same for float32 panels, P = 1 .. 4. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
gemv_f32(const int P, const float *x, Py_ssize_t K, const uint8_t *const *pan, const float *const *bias,
         float *const *c, const int *nv)
{
    const float *w0 = (const float *)pan[0], *w1 = (const float *)pan[P > 1 ? 1 : 0];
    const float *w2 = (const float *)pan[P > 2 ? 2 : 0], *w3 = (const float *)pan[P > 3 ? 3 : 0];
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (Py_ssize_t k = 0; k < K; k++) {
        if ((k & 3) == 0) {
            _mm_prefetch((const char *)(w0 + (k + 64) * NR), _MM_HINT_T0);
            if (P > 1)
                _mm_prefetch((const char *)(w1 + (k + 64) * NR), _MM_HINT_T0);
            if (P > 2)
                _mm_prefetch((const char *)(w2 + (k + 64) * NR), _MM_HINT_T0);
            if (P > 3)
                _mm_prefetch((const char *)(w3 + (k + 64) * NR), _MM_HINT_T0);
        }
        __m256 xb = _mm256_broadcast_ss(x + k);
        a00 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w0 + k * NR), a00);
        a01 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w0 + k * NR + 8), a01);
        if (P > 1) {
            a10 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w1 + k * NR), a10);
            a11 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w1 + k * NR + 8), a11);
        }
        if (P > 2) {
            a20 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w2 + k * NR), a20);
            a21 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w2 + k * NR + 8), a21);
        }
        if (P > 3) {
            a30 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w3 + k * NR), a30);
            a31 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w3 + k * NR + 8), a31);
        }
    }
    gemv_store(a00, a01, bias[0], c[0], nv[0]);
    if (P > 1)
        gemv_store(a10, a11, bias[1], c[1], nv[1]);
    if (P > 2)
        gemv_store(a20, a21, bias[2], c[2], nv[2]);
    if (P > 3)
        gemv_store(a30, a31, bias[3], c[3], nv[3]);
}

/* Bytes of one packed panel of a K-deep weight in format fmt. */
static inline Py_ssize_t
panel_bytes(int fmt, Py_ssize_t K)
{
    return fmt == PW_F32 ? K * NR * (Py_ssize_t)sizeof(float) : K / QB * (fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP);
}

/* One panel's address, output columns and bias. */
typedef struct {
    const uint8_t *pan;
    const float *bias;
    float *c;
    int nv;
} panel_ref;

static inline panel_ref
panel_at(const pw_header *w, Py_ssize_t pi, const float *bias, float *c)
{
    const int fmt = (int)w->fmt;
    panel_ref r;
    Py_ssize_t n0 = pi * NR;
    r.pan = (const uint8_t *)(w + 1) + pi * panel_bytes(fmt, w->k);
    r.bias = bias ? bias + n0 : NULL;
    r.c = c + n0;
    r.nv = (int)(w->n - n0 < NR ? w->n - n0 : NR);
    return r;
}

/* ------------------------------------------------------------------ AVX-512 GEMV
 *
 * The same GEMV on CPUs with AVX-512 (F, BW, VL; chosen at run time, see rk_isa): one 16-float
 * register holds a panel's 16 outputs, so each k step of a panel is one decode (a Q4_1 byte row
 * is broadcast, zero-extended to 16 lanes, shifted by 0 / 4 per half and looked up as float32 q;
 * Q8_0 sign-extended and converted) and one FMA instead of two of each. The arithmetic is op for
 * op that of gemv_q / gemv_f32 (the factored sum; float32: one FMA chain over k), so the bits are
 * the AVX2 path's (and the micro-kernel's). On Zen 4 (512-bit operations as two 256-bit halves)
 * it is no faster than the AVX2 form: docs/model.md, "AVX-512 GEMV". */

#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

__attribute__((target(AVX512_TARGET), always_inline)) static inline void
gemv_store512(__m512 a, const float *bias, float *c, int nv)
{
    const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
    if (bias)
        a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mk, bias));
    _mm512_mask_storeu_ps(c, mk, a);
}

__attribute__((target(AVX512_TARGET), always_inline)) static inline void
gemv_q512(const int P, const int fmt, const float *x, const float *xs, Py_ssize_t K, const uint8_t *const *pan,
          const float *const *bias, float *const *c, const int *nv)
{
    const Py_ssize_t group = fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP, qoff = fmt == PW_Q4_1 ? 64 : 32;
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    /* q as float32 by a table look-up (vpermps reads the low 4 bits of each index): no mask, no convert */
    const __m512 qtab = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 y0 = _mm512_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (Py_ssize_t g0 = 0, b = 0; g0 < K; g0 += QB, b++) {
        const float *xk = x + g0;
        const uint8_t *gp0 = pan[0] + b * group, *gp1 = pan[P > 1 ? 1 : 0] + b * group;
        const uint8_t *gp2 = pan[P > 2 ? 2 : 0] + b * group, *gp3 = pan[P > 3 ? 3 : 0] + b * group;
        for (int off = 0; off < group; off += 64) {
            _mm_prefetch((const char *)(gp0 + GEMV_PF512 * group + off), _MM_HINT_T0);
            if (P > 1)
                _mm_prefetch((const char *)(gp1 + GEMV_PF512 * group + off), _MM_HINT_T0);
            if (P > 2)
                _mm_prefetch((const char *)(gp2 + GEMV_PF512 * group + off), _MM_HINT_T0);
            if (P > 3)
                _mm_prefetch((const char *)(gp3 + GEMV_PF512 * group + off), _MM_HINT_T0);
        }
        const uint8_t *qs0 = gp0 + qoff, *qs1 = gp1 + qoff, *qs2 = gp2 + qoff, *qs3 = gp3 + qoff;
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        if (fmt == PW_Q4_1) {
#define Q4_T512(j)                                                                                          \
    do {                                                                                                    \
        int64_t b_;                                                                                         \
        memcpy(&b_, qs##j + 8 * k, 8);                                                                      \
        __m512i q_ = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(b_)), sh);                      \
        t##j = _mm512_fmadd_ps(xb, _mm512_permutexvar_ps(q_, qtab), t##j);                                  \
    } while (0)
            for (int k = 0; k < QB; k++) {
                __m512 xb = _mm512_set1_ps(xk[k]);
                Q4_T512(0);
                if (P > 1)
                    Q4_T512(1);
                if (P > 2)
                    Q4_T512(2);
                if (P > 3)
                    Q4_T512(3);
            }
#undef Q4_T512
        } else {
#define Q8_T512(j)                                                                                          \
    t##j = _mm512_fmadd_ps(xb, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs##j + 16 * k)))), t##j)
            for (int k = 0; k < QB; k++) {
                __m512 xb = _mm512_set1_ps(xk[k]);
                Q8_T512(0);
                if (P > 1)
                    Q8_T512(1);
                if (P > 2)
                    Q8_T512(2);
                if (P > 3)
                    Q8_T512(3);
            }
#undef Q8_T512
        }
        const __m512 s = _mm512_set1_ps(xs[b]);
        (void)s;
#define Q_FOLD512(j)                                                                                        \
    do {                                                                                                    \
        y##j = _mm512_fmadd_ps(t##j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp##j)), y##j);    \
        if (fmt == PW_Q4_1)                                                                                 \
            y##j = _mm512_fmadd_ps(s, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp##j + 32))), y##j); \
    } while (0)
        Q_FOLD512(0);
        if (P > 1)
            Q_FOLD512(1);
        if (P > 2)
            Q_FOLD512(2);
        if (P > 3)
            Q_FOLD512(3);
#undef Q_FOLD512
    }
    gemv_store512(y0, bias[0], c[0], nv[0]);
    if (P > 1)
        gemv_store512(y1, bias[1], c[1], nv[1]);
    if (P > 2)
        gemv_store512(y2, bias[2], c[2], nv[2]);
    if (P > 3)
        gemv_store512(y3, bias[3], c[3], nv[3]);
}

__attribute__((target(AVX512_TARGET), always_inline)) static inline void
gemv_f32_512(const int P, const float *x, Py_ssize_t K, const uint8_t *const *pan, const float *const *bias,
             float *const *c, const int *nv)
{
    const float *w0 = (const float *)pan[0], *w1 = (const float *)pan[P > 1 ? 1 : 0];
    const float *w2 = (const float *)pan[P > 2 ? 2 : 0], *w3 = (const float *)pan[P > 3 ? 3 : 0];
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (Py_ssize_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w0 + (k + 64) * NR), _MM_HINT_T0);
        if (P > 1)
            _mm_prefetch((const char *)(w1 + (k + 64) * NR), _MM_HINT_T0);
        if (P > 2)
            _mm_prefetch((const char *)(w2 + (k + 64) * NR), _MM_HINT_T0);
        if (P > 3)
            _mm_prefetch((const char *)(w3 + (k + 64) * NR), _MM_HINT_T0);
        __m512 xb = _mm512_set1_ps(x[k]);
        a0 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w0 + k * NR), a0);
        if (P > 1)
            a1 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w1 + k * NR), a1);
        if (P > 2)
            a2 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w2 + k * NR), a2);
        if (P > 3)
            a3 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w3 + k * NR), a3);
    }
    gemv_store512(a0, bias[0], c[0], nv[0]);
    if (P > 1)
        gemv_store512(a1, bias[1], c[1], nv[1]);
    if (P > 2)
        gemv_store512(a2, bias[2], c[2], nv[2]);
    if (P > 3)
        gemv_store512(a3, bias[3], c[3], nv[3]);
}

/* Panels r[0 .. P) as the kernels' argument arrays. */
typedef struct {
    const uint8_t *pan[4];
    const float *bias[4];
    float *c[4];
    int nv[4];
} panel_set;

/* One group of P (1 .. 4) panels through kernel family Q (block formats) / F (float32), with P and
 * the format constant in each call (so each is inlined for it). Shared by both ISAs. */
#define GEMV_DISPATCH(Q, F)                                                                                 \
    switch (fmt * 4 + P - 1) {                                                                              \
    case PW_F32 * 4 + 3: F(4, x, K, s->pan, s->bias, s->c, s->nv); break;                                  \
    case PW_F32 * 4 + 2: F(3, x, K, s->pan, s->bias, s->c, s->nv); break;                                  \
    case PW_F32 * 4 + 1: F(2, x, K, s->pan, s->bias, s->c, s->nv); break;                                  \
    case PW_F32 * 4 + 0: F(1, x, K, s->pan, s->bias, s->c, s->nv); break;                                  \
    case PW_Q4_1 * 4 + 3: Q(4, PW_Q4_1, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q4_1 * 4 + 2: Q(3, PW_Q4_1, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q4_1 * 4 + 1: Q(2, PW_Q4_1, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q4_1 * 4 + 0: Q(1, PW_Q4_1, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q8_0 * 4 + 3: Q(4, PW_Q8_0, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q8_0 * 4 + 2: Q(3, PW_Q8_0, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    case PW_Q8_0 * 4 + 1: Q(2, PW_Q8_0, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                    \
    default: Q(1, PW_Q8_0, x, xs, K, s->pan, s->bias, s->c, s->nv); break;                                 \
    }

__attribute__((target(AVX512_TARGET))) static void
gemv_set512(const float *x, const float *xs, Py_ssize_t K, int fmt, int P, const panel_set *s)
{
    GEMV_DISPATCH(gemv_q512, gemv_f32_512)
}

__attribute__((target("avx2,fma,f16c"))) static void
gemv_set(const float *x, const float *xs, Py_ssize_t K, int fmt, int P, const panel_set *s)
{
    GEMV_DISPATCH(gemv_q, gemv_f32)
}
#undef GEMV_DISPATCH

/* x (one row; xs its block sums, for the block formats) against np panels (any count) given as
 * refs: 4 at a time, on the ISA rk_isa says (the same bits on both). */
static void
gemv_refs(const float *x, const float *xs, Py_ssize_t K, int fmt, const panel_ref *r, int np)
{
    const int avx512 = rk_isa == ISA_AVX512;
    for (int i = 0; i < np; i += 4) {
        const int P = np - i < 4 ? np - i : 4;
        panel_set s;
        for (int j = 0; j < P; j++) {
            s.pan[j] = r[i + j].pan;
            s.bias[j] = r[i + j].bias;
            s.c[j] = r[i + j].c;
            s.nv[j] = r[i + j].nv;
        }
        if (avx512)
            gemv_set512(x, xs, K, fmt, P, &s);
        else
            gemv_set(x, xs, K, fmt, P, &s);
    }
}

/* C[0:M, panel pi] (+ bias) for one panel of w, M > 1 (one row takes gemv_refs): the micro-kernel
 * over 128-row blocks (see gemm_task). xs: the rows' block sums (K / QB a row; block formats).
 * buf: KC * NR floats, 64-byte aligned. */
__attribute__((target("avx2,fma,f16c"))) static void
gemm_panel(const float *xrows, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t pi,
           const float *bias, float *cbase, Py_ssize_t ldc, float *buf)
{
    const Py_ssize_t K = w->k, nb = K / QB;
    const int fmt = (int)w->fmt;
    const Py_ssize_t group = fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP;
    const uint8_t *panel = (const uint8_t *)(w + 1) + pi * panel_bytes(fmt, K);
    Py_ssize_t n0 = pi * NR;
    int nv = (int)(w->n - n0 < NR ? w->n - n0 : NR);
    for (Py_ssize_t k0 = 0; k0 < K; k0 += KC) {
        Py_ssize_t kc = K - k0 < KC ? K - k0 : KC;
        if (fmt == PW_F32) {
            const float *bb = bias && k0 + kc >= K ? bias + n0 : NULL;
            const float *wp = (const float *)panel + k0 * NR;
            const float *pf = wp + PF_BLOCKS * KC * NR; /* may run past the end: prefetch never faults */
            for (Py_ssize_t m0 = 0; m0 < M; m0 += MR) {
                Py_ssize_t mr = M - m0 < MR ? M - m0 : MR;
                const float *x = xrows + m0 * ldx + k0;
                float *c = cbase + m0 * ldc + n0;
                const float *pfp = m0 == 0 ? pf : NULL;
                int first = k0 == 0;
                switch (mr) {
                case 6: ukernel(6, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                case 5: ukernel(5, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                case 4: ukernel(4, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                case 3: ukernel(3, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                case 2: ukernel(2, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                default: ukernel(1, kc, x, ldx, wp, pfp, c, ldc, bb, nv, first); break;
                }
            }
            continue;
        }
        const uint8_t *g = panel + k0 / QB * group;
        const uint8_t *ahead = g + PF_BLOCKS * (KC / QB) * group;
        for (Py_ssize_t off = 0; off < kc / QB * group; off += 64)
            _mm_prefetch((const char *)(ahead + off), PF_HINT);
        dequant_block(fmt, g, kc, buf);
        for (Py_ssize_t m0 = 0; m0 < M; m0 += MR) {
            Py_ssize_t mr = M - m0 < MR ? M - m0 : MR;
            float *c = cbase + m0 * ldc + n0;
            for (Py_ssize_t b = 0; b < kc / QB; b++) {
                const uint8_t *gb = g + b * group;
                const Py_ssize_t kb = k0 + b * QB;
                const float *x = xrows + m0 * ldx + kb, *qb = buf + b * QB * NR, *s = xs + m0 * nb + kb / QB;
                const float *bb = bias && kb + QB >= K ? bias + n0 : NULL;
                int first = kb == 0;
                __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));
                __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 16)));
                __m256 mm0 = _mm256_setzero_ps(), mm1 = mm0;
                if (fmt == PW_Q4_1) {
                    mm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 32)));
                    mm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 48)));
                }
#define UKQ(R)                                                                                              \
    case R:                                                                                                 \
        if (fmt == PW_Q4_1)                                                                                 \
            ukernel_q(R, PW_Q4_1, x, ldx, qb, s, nb, d0, d1, mm0, mm1, c, ldc, bb, nv, first);              \
        else                                                                                                \
            ukernel_q(R, PW_Q8_0, x, ldx, qb, s, nb, d0, d1, mm0, mm1, c, ldc, bb, nv, first);              \
        break;
                switch (mr) {
                    UKQ(6) UKQ(5) UKQ(4) UKQ(3) UKQ(2)
                default:
                    if (fmt == PW_Q4_1)
                        ukernel_q(1, PW_Q4_1, x, ldx, qb, s, nb, d0, d1, mm0, mm1, c, ldc, bb, nv, first);
                    else
                        ukernel_q(1, PW_Q8_0, x, ldx, qb, s, nb, d0, d1, mm0, mm1, c, ldc, bb, nv, first);
                }
#undef UKQ
            }
        }
    }
}

/* Panels [p0, p1) of C = X @ W^T (+ bias): the GEMV for one row, else panel by panel. xs: the rows'
 * block sums (block_sums_rows; read only for the block formats). */
static void
gemm_range(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t p0,
           Py_ssize_t p1, const float *bias, float *c, Py_ssize_t ldc, float *buf)
{
    if (M == 1) {
        panel_ref r[8];
        for (Py_ssize_t pi = p0; pi < p1;) {
            int np = 0;
            for (; np < 8 && pi < p1; np++, pi++)
                r[np] = panel_at(w, pi, bias, c);
            gemv_refs(x, xs, w->k, (int)w->fmt, r, np);
        }
        return;
    }
    for (Py_ssize_t pi = p0; pi < p1; pi++)
        gemm_panel(x, xs, M, ldx, w, pi, bias, c, ldc, buf);
}

/* Takes the next chunk of [0, total) units from *next (atomic), guided: a chunk is 1 / (2 *
 * nthreads) of what is left (at least `align` units, a multiple of it), so chunks shrink toward
 * the end and a thread that starts late or runs slow (this VM's cores are shared) costs the
 * others at most one small chunk of waiting. Returns 0 when nothing is left. */
static inline int
take_chunk(Py_ssize_t *next, Py_ssize_t total, int nthreads, Py_ssize_t align, Py_ssize_t *u0, Py_ssize_t *u1)
{
    Py_ssize_t p0 = __atomic_load_n(next, __ATOMIC_RELAXED), c;
    do {
        if (p0 >= total)
            return 0;
        c = (total - p0) / (2 * nthreads);
        c = c < align ? align : c / align * align;
    } while (!__atomic_compare_exchange_n(next, &p0, p0 + c, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *u0 = p0;
    *u1 = p0 + c < total ? p0 + c : total;
    return 1;
}

/* Panels are taken in shrinking chunks (take_chunk). Within a panel, K is walked in blocks of KC
 * rows (KC * 64 bytes of float32, L1-resident) and every row block of X passes over a block
 * before the next is read: the weight stream from memory then advances at a steady pace with all
 * M rows' work, and each block prefetches the block PF_BLOCKS ahead in the (contiguous) packed
 * weight stream. A quantized block is first decoded into a float32 block on the stack. One row
 * (M = 1) takes the GEMV instead (same bits). */
__attribute__((target("avx2,fma,f16c"))) static void
gemm_task(void *p, int tid, int nthreads)
{
    gemm_args *a = (gemm_args *)p;
    const Py_ssize_t panels = (a->N + NR - 1) / NR;
    float buf[KC * NR] __attribute__((aligned(64)));
    Py_ssize_t p0, p1;
    while (take_chunk(&a->next, panels, nthreads, a->M == 1 ? 4 : 1, &p0, &p1))
        gemm_range(a->x, a->xs, a->M, a->ldx, a->w, p0, p1, a->bias, a->c, a->ldc, buf);
}
#endif

#if RK_X86
/* C[M, N] = X @ W^T (+ bias) on nthreads threads (see the header). xs: room for the rows' block
 * sums (M * K / QB floats) for a block-format w, else NULL. */
static void
gemm(const float *x, Py_ssize_t M, Py_ssize_t K, Py_ssize_t ldx, const pw_header *w, Py_ssize_t N, const float *bias,
     float *c, Py_ssize_t ldc, int nthreads, float *xs)
{
    Py_ssize_t panels = (N + NR - 1) / NR;
    int n = nthreads < 1 ? 1 : nthreads;
    if (panels < 2 * n) /* too little work to share */
        n = 1;
    if (xs)
        block_sums_rows(x, M, ldx, K, xs); /* once for all panels */
    gemm_args a = {x, xs, M, K, ldx, w, N, bias, c, ldc, 0};
    run_parallel(gemm_task, &a, n);
}
#endif

static int
cpu_ok(void)
{
    static int ok = -1;
    if (ok < 0) {
#if RK_X86 && defined(__GNUC__)
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        rk_has_avx512 = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
        const char *env = getenv("RADIXKV_KERNELS_ISA");
        rk_isa = rk_has_avx512 && !(env && strcmp(env, "avx2") == 0) ? ISA_AVX512 : ISA_AVX2;
#else
        ok = 0;
#endif
    }
    return ok;
}

/* 1 when the kernels can run here, else 0 with a RuntimeError naming fn set. */
static int
cpu_or_raise(const char *fn)
{
    if (cpu_ok())
        return 1;
    PyErr_Format(PyExc_RuntimeError, "%s needs a CPU with AVX2, FMA and F16C", fn);
    return 0;
}

static PyObject *
py_available(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(cpu_ok());
}

static PyObject *
py_isa(PyObject *self, PyObject *noargs)
{
    if (!cpu_ok())
        Py_RETURN_NONE;
#if RK_X86
    return PyUnicode_FromString(rk_isa == ISA_AVX512 ? "avx512" : "avx2");
#else
    Py_RETURN_NONE;
#endif
}

static PyObject *
py_set_isa(PyObject *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name) || !cpu_or_raise("set_isa"))
        return NULL;
#if RK_X86
    if (strcmp(name, "avx2") == 0) {
        rk_isa = ISA_AVX2;
    } else if (strcmp(name, "avx512") == 0) {
        if (!rk_has_avx512) {
            PyErr_SetString(PyExc_ValueError, "set_isa: isa 'avx512' needs AVX-512 F/BW/VL, which this CPU lacks");
            return NULL;
        }
        rk_isa = ISA_AVX512;
    } else {
        PyErr_Format(PyExc_ValueError, "set_isa: isa must be 'avx2' or 'avx512', got %R", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_threading(PyObject *self, PyObject *noargs)
{
#ifdef _OPENMP
    if (!forked_child)
        return PyUnicode_FromString("openmp");
#endif
    return PyUnicode_FromString("pthreads");
}

/* ------------------------------------------------------------------ weight packing */

/* Bytes of a packed [N, K] weight in format fmt (header included); 0: K does not suit fmt. */
static Py_ssize_t
pw_bytes(int fmt, Py_ssize_t N, Py_ssize_t K)
{
    Py_ssize_t panels = (N + NR - 1) / NR;
    if (fmt == PW_F32)
        return (Py_ssize_t)sizeof(pw_header) + panels * K * NR * (Py_ssize_t)sizeof(float);
    if (K % QB)
        return 0;
    return (Py_ssize_t)sizeof(pw_header) + panels * (K / QB) * (fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP);
}

static const char *
check_pw(const pw_header *w, Py_ssize_t N, Py_ssize_t K)
{
    if (!w || w->magic != PW_MAGIC || w->fmt > PW_Q8_0)
        return "a weight is not a packed weight";
    if (w->n != N || w->k != K)
        return "a packed weight's shape does not match";
    if (w->fmt != PW_F32 && K % QB)
        return "a block-format weight needs K to be a multiple of 32";
    return NULL;
}

#if RK_X86
static inline uint32_t
f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Finds fp16 d, m and q[i] in 0..15 with fmaf(q[i], d, m) == v[i] bitwise for a block of QB
 * values (the form GGUF's Q4_1 dequantizes to: m is the block minimum, the maximum has q = 15).
 * Returns 0 when there are none. */
__attribute__((target("avx2,fma,f16c"))) static int
encode_q4_1(const float *v, uint16_t *hd, uint16_t *hm, uint8_t *q)
{
    float mn = v[0], mx = v[0];
    for (int i = 0; i < QB; i++) {
        if (!isfinite(v[i]))
            return 0;
        mn = v[i] < mn ? v[i] : mn;
        mx = v[i] > mx ? v[i] : mx;
    }
    uint16_t m16 = _cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT);
    if (f32_bits(_cvtsh_ss(m16)) != f32_bits(mn))
        return 0;
    int c = _cvtss_sh((mx - mn) / 15.f, _MM_FROUND_TO_NEAREST_INT);
    static const int tries[] = {0, 1, -1, 2, -2};
    for (int t = 0; t < 5; t++) {
        int h = c + tries[t];
        if (h < 0 || h >= 0x7c00) /* +0 .. the largest finite fp16 */
            continue;
        float d = _cvtsh_ss((uint16_t)h);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float qf = d > 0.f ? nearbyintf((v[i] - mn) / d) : 0.f;
            ok = qf >= 0.f && qf <= 15.f;
            q[i] = ok ? (uint8_t)qf : 0;
            /* checked as the kernel decodes it: from the stored integer (never -0), one FMA */
            ok = ok && f32_bits(fmaf((float)q[i], d, mn)) == f32_bits(v[i]);
        }
        if (ok) {
            *hd = (uint16_t)h;
            *hm = m16;
            return 1;
        }
    }
    return 0;
}

/* Finds fp16 d and q[i] in -128..127 with q[i] * d == v[i] bitwise (GGUF's Q8_0 form: the
 * largest magnitude has |q| = 127). Returns 0 when there are none. */
__attribute__((target("avx2,fma,f16c"))) static int
encode_q8_0(const float *v, uint16_t *hd, int8_t *q)
{
    float amax = 0.f;
    for (int i = 0; i < QB; i++) {
        if (!isfinite(v[i]))
            return 0;
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
    int c = _cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT);
    static const int tries[] = {0, 1, -1};
    for (int t = 0; t < 3; t++) {
        int h = c + tries[t];
        if (h < 0 || h >= 0x7c00)
            continue;
        float d = _cvtsh_ss((uint16_t)h);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float qf = d > 0.f ? nearbyintf(v[i] / d) : 0.f;
            ok = qf >= -128.f && qf <= 127.f;
            q[i] = ok ? (int8_t)qf : 0;
            ok = ok && f32_bits((float)q[i] * d) == f32_bits(v[i]); /* as decoded: -0 is refused */
        }
        if (ok) {
            *hd = (uint16_t)h;
            return 1;
        }
    }
    return 0;
}

/* Writes W [N, K] (rows ldw floats apart) packed in format fmt to out (pw_bytes(fmt, N, K)
 * bytes). Panel p holds rows 16p .. 16p + 15 (zeros past N):
 *   PW_F32:  float32 [K][16]: k-th row of the panel, one cache line.
 *   PW_Q4_1: K / 32 groups of Q4_GROUP bytes: fp16 d[16], fp16 m[16], then 32 k rows of 8 bytes
 *            (byte j: column j in the low nibble, column j + 8 in the high one).
 *   PW_Q8_0: K / 32 groups of Q8_GROUP bytes: fp16 d[16], then 32 k rows of 16 int8.
 * The quantized forms are lossless or refused: returns 0 (out unusable) unless every block of 32
 * k of every row decodes to exactly the float32 given. */
__attribute__((target("avx2,fma,f16c"))) static int
pack_weight(const float *w, Py_ssize_t N, Py_ssize_t K, Py_ssize_t ldw, int fmt, uint8_t *out)
{
    pw_header *hdr = (pw_header *)out;
    memset(hdr, 0, sizeof *hdr);
    uint8_t *dst = out + sizeof *hdr;
    const Py_ssize_t panels = (N + NR - 1) / NR;
    if (fmt == PW_F32) {
        float *f = (float *)dst;
        for (Py_ssize_t p = 0; p < panels; p++)
            for (Py_ssize_t k = 0; k < K; k++)
                for (int j = 0; j < NR; j++) {
                    Py_ssize_t n = p * NR + j;
                    *f++ = n < N ? w[n * ldw + k] : 0.f;
                }
    } else {
        uint8_t q[NR][QB];
        for (Py_ssize_t p = 0; p < panels; p++)
            for (Py_ssize_t g = 0; g < K / QB; g++) {
                uint16_t *d16 = (uint16_t *)dst, *m16 = d16 + NR;
                for (int j = 0; j < NR; j++) {
                    Py_ssize_t n = p * NR + j;
                    const float *v = w + n * ldw + g * QB;
                    if (n >= N) {
                        d16[j] = 0;
                        if (fmt == PW_Q4_1)
                            m16[j] = 0;
                        memset(q[j], 0, QB);
                    } else if (fmt == PW_Q4_1 ? !encode_q4_1(v, d16 + j, m16 + j, q[j])
                                              : !encode_q8_0(v, d16 + j, (int8_t *)q[j])) {
                        return 0;
                    }
                }
                if (fmt == PW_Q4_1) {
                    uint8_t *qs = dst + 4 * NR;
                    for (int k = 0; k < QB; k++)
                        for (int j = 0; j < NR / 2; j++)
                            qs[k * (NR / 2) + j] = (uint8_t)(q[j][k] | q[j + NR / 2][k] << 4);
                    dst += Q4_GROUP;
                } else {
                    uint8_t *qs = dst + 2 * NR;
                    for (int k = 0; k < QB; k++)
                        for (int j = 0; j < NR; j++)
                            qs[k * NR + j] = q[j][k];
                    dst += Q8_GROUP;
                }
            }
    }
    hdr->magic = PW_MAGIC;
    hdr->fmt = (uint32_t)fmt;
    hdr->n = N;
    hdr->k = K;
    return 1;
}
#endif

static PyObject *
py_packed_bytes(PyObject *self, PyObject *args)
{
    int fmt;
    Py_ssize_t N, K;
    if (!PyArg_ParseTuple(args, "inn", &fmt, &N, &K))
        return NULL;
    if (fmt < PW_F32 || fmt > PW_Q8_0 || N < 1 || K < 1) {
        PyErr_SetString(PyExc_ValueError, "packed_bytes: bad format or shape");
        return NULL;
    }
    return PyLong_FromSsize_t(pw_bytes(fmt, N, K));
}

static PyObject *
py_pack_weight(PyObject *self, PyObject *args)
{
    Py_ssize_t w, N, K, ldw, out, out_bytes;
    int fmt;
    if (!PyArg_ParseTuple(args, "nnnninn", &w, &N, &K, &ldw, &fmt, &out, &out_bytes))
        return NULL;
    if (fmt < PW_F32 || fmt > PW_Q8_0 || N < 1 || K < 1 || ldw < K || !pw_bytes(fmt, N, K) ||
        out_bytes < pw_bytes(fmt, N, K)) {
        PyErr_SetString(PyExc_ValueError, "pack_weight: bad format, shape or buffer size");
        return NULL;
    }
    if (!cpu_or_raise("pack_weight"))
        return NULL;
    int ok = 0;
#if RK_X86
    Py_BEGIN_ALLOW_THREADS
    ok = pack_weight((const float *)w, N, K, ldw, fmt, (uint8_t *)out);
    Py_END_ALLOW_THREADS
#endif
    return PyBool_FromLong(ok);
}

static PyObject *
py_sgemm_packed(PyObject *self, PyObject *args)
{
    Py_ssize_t x, M, K, ldx, wp, N, bias, c, ldc, nthreads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &x, &M, &K, &ldx, &wp, &N, &bias, &c, &ldc, &nthreads))
        return NULL;
    const char *bad = check_pw((const pw_header *)wp, N, K);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "sgemm_packed: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("sgemm_packed"))
        return NULL;
#if RK_X86
    float *xs = NULL;
    if (((const pw_header *)wp)->fmt != PW_F32 && M > 0) {
        xs = (float *)PyMem_RawMalloc(sizeof(float) * (size_t)(M * (K / QB)));
        if (!xs)
            return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    gemm((const float *)x, M, K, ldx, (const pw_header *)wp, N, (const float *)bias, (float *)c, ldc, (int)nthreads, xs);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(xs);
#endif
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ paged attention */

#ifndef KV_PREFETCH
#define KV_PREFETCH 24 /* positions ahead whose K rows are prefetched */
#endif

typedef struct {
    const float *q;
    Py_ssize_t ldq; /* floats between query rows (>= hq * d) */
    const int32_t *q_start, *q_len, *kv_start, *kv_len;
    Py_ssize_t n_req;
    const int32_t *kv_indices;
    Py_ssize_t page_size;
    const float *k_cache, *v_cache;
    int hq, hkv, d;
    float sm_scale;
    float *out;
    Py_ssize_t units; /* query rows: sum over requests of q_len */
    Py_ssize_t max_kv;
    Py_ssize_t next; /* next untaken unit (atomic) */
} attn_args;

#if RK_X86
__attribute__((target("avx2,fma"))) static inline float
hmax256(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

__attribute__((target("avx2,fma"))) static inline float
hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* scores[p0 .. p0 + 8) of one head: q . k over d for 8 positions, reduced with a horizontal-add
 * tree into one register (8 accumulators share each q chunk). */
__attribute__((target("avx2,fma"))) static inline __m256
qk8(const float *qh, const float *const kp[8], int d)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int e = 0; e < d; e += 8) {
        __m256 qv = _mm256_loadu_ps(qh + e);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[0] + e), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[1] + e), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[2] + e), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[3] + e), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[4] + e), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[5] + e), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[6] + e), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[7] + e), a7);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* out[h0 + i][e0 + 8c ...] = inv[h0 + i] * sum_p w[h0 + i][p] v_p[e0 + 8c ...] for i < hc, c < nc:
 * hc * nc accumulators stay in registers over all positions. Inlined with constant hc, nc. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pv_block(const int hc, const int nc, const float *v_base, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n,
         const float *w, const float *inv, float *out, int d)
{
    __m256 acc[3][4];
    for (int i = 0; i < hc; i++)
        for (int c = 0; c < nc; c++)
            acc[i][c] = _mm256_setzero_ps();
    for (Py_ssize_t p = 0; p < n; p++) {
        const float *vp = v_base + slot[p] * row_len;
        __m256 wv[3]; /* 12 accumulators + 3 weights + 1 V chunk: all 16 registers, no spill */
        for (int i = 0; i < hc; i++)
            wv[i] = _mm256_broadcast_ss(w + i * n + p);
        for (int c = 0; c < nc; c++) {
            __m256 vv = _mm256_loadu_ps(vp + 8 * c);
            for (int i = 0; i < hc; i++)
                acc[i][c] = _mm256_fmadd_ps(wv[i], vv, acc[i][c]);
        }
    }
    for (int i = 0; i < hc; i++) {
        __m256 sv = _mm256_set1_ps(inv[i]);
        for (int c = 0; c < nc; c++)
            _mm256_storeu_ps(out + i * d + 8 * c, _mm256_mul_ps(sv, acc[i][c]));
    }
}

/* One query row (all heads) against its n visible positions. scratch: n slots + hq * n scores.
 * Pass 1 computes every head's scores 8 positions at a time, pass 2 the softmax weights, pass 3
 * the weighted sum of V with the outputs held in registers. */
__attribute__((target("avx2,fma"))) static void
attend_row(const attn_args *a, Py_ssize_t r, Py_ssize_t row, Py_ssize_t n, float *scratch)
{
    const int d = a->d, hq = a->hq, hkv = a->hkv, g = hq / hkv;
    const Py_ssize_t ps = a->page_size, row_len = (Py_ssize_t)hkv * d;
    const int32_t *pages = a->kv_indices + a->kv_start[r];
    const float *qrow = a->q + row * a->ldq;
    float *orow = a->out + row * hq * d;
    Py_ssize_t *slot = (Py_ssize_t *)scratch;
    float *scores = scratch + 2 * n; /* Py_ssize_t is two floats wide */
    for (Py_ssize_t p0 = 0, pg = 0; p0 < n; p0 += ps, pg++) { /* page by page: no division */
        Py_ssize_t base = (Py_ssize_t)pages[pg] * ps, m = n - p0 < ps ? n - p0 : ps;
        for (Py_ssize_t i = 0; i < m; i++)
            slot[p0 + i] = base + i;
    }
    /* pass 1: scores[h][p] = q_h . k_p * scale, 8 positions at a time for every head (their K
     * rows are read once into L1); the next block's K rows and this block's V rows (for pass 3)
     * are prefetched meanwhile */
    const __m256 vscale = _mm256_set1_ps(a->sm_scale);
    const Py_ssize_t row_bytes = row_len * (Py_ssize_t)sizeof(float);
    Py_ssize_t p = 0;
    for (; p + 8 <= n; p += 8) {
        for (Py_ssize_t j = p + KV_PREFETCH; j < p + KV_PREFETCH + 8 && j < n; j++)
            for (Py_ssize_t b = 0; b < row_bytes; b += 64)
                _mm_prefetch((const char *)(a->k_cache + slot[j] * row_len) + b, _MM_HINT_T0);
        if (p == 0) /* the first blocks */
            for (Py_ssize_t j = 0; j < KV_PREFETCH && j < n; j++)
                for (Py_ssize_t b = 0; b < row_bytes; b += 64)
                    _mm_prefetch((const char *)(a->k_cache + slot[j] * row_len) + b, _MM_HINT_T0);
        for (Py_ssize_t j = p; j < p + 8; j++)
            for (Py_ssize_t b = 0; b < row_bytes; b += 64)
                _mm_prefetch((const char *)(a->v_cache + slot[j] * row_len) + b, _MM_HINT_T1);
        for (int h = 0; h < hq; h++) {
            const float *kb = a->k_cache + (Py_ssize_t)(h / g) * d;
            const float *kp[8];
            for (int j = 0; j < 8; j++)
                kp[j] = kb + slot[p + j] * row_len;
            _mm256_storeu_ps(scores + (Py_ssize_t)h * n + p, _mm256_mul_ps(qk8(qrow + (Py_ssize_t)h * d, kp, d), vscale));
        }
    }
    for (; p < n; p++) {
        for (int h = 0; h < hq; h++) {
            const float *kp = a->k_cache + slot[p] * row_len + (Py_ssize_t)(h / g) * d, *qh = qrow + (Py_ssize_t)h * d;
            __m256 acc = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), _mm256_loadu_ps(kp + e), acc);
            scores[(Py_ssize_t)h * n + p] = hsum256(acc) * a->sm_scale;
        }
    }
    /* pass 2: unnormalized softmax weights exp(s - max) per head, and 1 / their sum */
    float inv_stack[64];
    float *inv = hq <= 64 ? inv_stack : scores + (Py_ssize_t)hq * n; /* scratch has room (see attn_task) */
    for (int h = 0; h < hq; h++) {
        float *s = scores + (Py_ssize_t)h * n;
        Py_ssize_t p = 0;
        __m256 vmx = _mm256_set1_ps(s[0]);
        for (; p + 8 <= n; p += 8)
            vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + p));
        float mx = hmax256(vmx);
        for (; p < n; p++)
            mx = s[p] > mx ? s[p] : mx;
        __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
        for (p = 0; p + 8 <= n; p += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + p), vm));
            _mm256_storeu_ps(s + p, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        if (p < n) { /* tail through a padded buffer: same exp as the vector lanes */
            float t[8];
            int m = (int)(n - p);
            for (int i = 0; i < 8; i++)
                t[i] = i < m ? s[p + i] - mx : -87.3f;
            __m256 e = exp256(_mm256_loadu_ps(t));
            _mm256_storeu_ps(t, e);
            for (int i = 0; i < m; i++)
                s[p + i] = t[i];
            vsum = _mm256_add_ps(vsum, _mm256_blendv_ps(_mm256_setzero_ps(), e,
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
        }
        inv[h] = 1.f / hsum256(vsum);
    }
    /* pass 3: out_h = inv_h * sum_p w_hp v_p, by (KV head, <= 3 query heads, <= 32 dims) blocks */
    for (int kvh = 0; kvh < hkv; kvh++) {
        const float *vb = a->v_cache + (Py_ssize_t)kvh * d;
        for (int h0 = kvh * g; h0 < (kvh + 1) * g; h0 += 3) {
            int hc = (kvh + 1) * g - h0 < 3 ? (kvh + 1) * g - h0 : 3;
            for (int e0 = 0; e0 < d; e0 += 32) {
                int nc = (d - e0) / 8 < 4 ? (d - e0) / 8 : 4;
                const float *w = scores + (Py_ssize_t)h0 * n;
                float *o = orow + (Py_ssize_t)h0 * d + e0;
                const float *vbe = vb + e0;
                switch (hc * 4 + nc) {
#define PV(HC, NC) case HC * 4 + NC: pv_block(HC, NC, vbe, slot, row_len, n, w, inv + h0, o, d); break;
                PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
                PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4)
#undef PV
                }
            }
        }
    }
}

/* Work units are query rows, numbered request by request, taken one at a time (atomic). */
__attribute__((target("avx2,fma"))) static void
attn_task(void *p, int tid, int nthreads)
{
    attn_args *a = (attn_args *)p;
    size_t per = (size_t)(a->max_kv > 0 ? a->max_kv : 1);
    float *scratch = NULL;
    Py_ssize_t r = 0, first = 0; /* request r owns units [first, first + q_len[r]) */
    for (;;) {
        Py_ssize_t u = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (u >= a->units)
            break;
        if (!scratch && !(scratch = (float *)malloc(sizeof(float) * (per * (size_t)(2 + a->hq) + (size_t)a->hq))))
            abort();
        while (u >= first + a->q_len[r]) /* units only grow: walk forward */
            first += a->q_len[r++];
        Py_ssize_t j = u - first, nq = a->q_len[r];
        attend_row(a, r, a->q_start[r] + j, a->kv_len[r] - nq + j + 1, scratch);
    }
    free(scratch);
}
#endif

/* NULL when the attention metadata is in range, else what is wrong: O(requests + pages), run
 * before every kernel so a bad batch raises instead of reading out of bounds. T: query rows;
 * n_indices: entries of kv_indices; num_pages: pages of the pool. */
static const char *
check_attn_meta(const int32_t *meta, Py_ssize_t n_req, Py_ssize_t T, const int32_t *kv_indices, Py_ssize_t n_indices,
                Py_ssize_t page_size, Py_ssize_t num_pages)
{
    if (page_size < 1)
        return "page_size must be >= 1";
    for (Py_ssize_t r = 0; r < n_req; r++) {
        Py_ssize_t qs = meta[r], ql = meta[n_req + r], ks = meta[2 * n_req + r], kl = meta[3 * n_req + r];
        if (ql < 0 || kl < ql)
            return "every request needs 0 <= q_len <= kv_len";
        if (qs < 0 || qs + ql > T)
            return "a request's query rows fall outside q";
        Py_ssize_t np = (kl + page_size - 1) / page_size;
        if (ks < 0 || ks + np > n_indices)
            return "a request's pages fall outside kv_indices";
        for (Py_ssize_t i = 0; i < np; i++)
            if (kv_indices[ks + i] < 0 || kv_indices[ks + i] >= num_pages)
                return "a page id is outside the pool";
    }
    return NULL;
}

#if RK_X86
/* meta: [4, n_req] int32 (first query row, query count, kv_indptr, KV length) per request. */
static void
paged_attention(const float *q, Py_ssize_t ldq, const int32_t *meta, Py_ssize_t n_req, const int32_t *kv_indices,
                Py_ssize_t page_size, const float *k_cache, const float *v_cache, int hq, int hkv, int d,
                float sm_scale, float *out, int nthreads)
{
    attn_args a = {q, ldq, meta, meta + n_req, meta + 2 * n_req, meta + 3 * n_req, n_req, kv_indices, page_size,
                   k_cache, v_cache, hq, hkv, d, sm_scale, out, 0, 0, 0};
    for (Py_ssize_t r = 0; r < n_req; r++) {
        a.units += a.q_len[r];
        if (a.kv_len[r] > a.max_kv)
            a.max_kv = a.kv_len[r];
    }
    int n = nthreads < 1 ? 1 : nthreads;
    if (a.units < n)
        n = (int)(a.units > 0 ? a.units : 1);
    run_parallel(attn_task, &a, n);
}
#endif

static PyObject *
py_paged_attention(PyObject *self, PyObject *args)
{
    Py_ssize_t q, T, q_start, n_req, kv_indices, n_indices, page_size, num_pages, k_cache, v_cache;
    Py_ssize_t hq, hkv, d, out, nthreads;
    double sm_scale;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnndnn", &q, &T, &q_start, &n_req, &kv_indices, &n_indices, &page_size,
                          &num_pages, &k_cache, &v_cache, &hq, &hkv, &d, &sm_scale, &out, &nthreads))
        return NULL;
    const char *bad = check_attn_meta((const int32_t *)q_start, n_req, T, (const int32_t *)kv_indices, n_indices,
                                      page_size, num_pages);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "paged_attention: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("paged_attention"))
        return NULL;
#if RK_X86
    Py_BEGIN_ALLOW_THREADS
    paged_attention((const float *)q, hq * d, (const int32_t *)q_start, n_req, (const int32_t *)kv_indices, page_size,
                    (const float *)k_cache, (const float *)v_cache, (int)hq, (int)hkv, (int)d, (float)sm_scale,
                    (float *)out, (int)nthreads);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ elementwise (one thread) */

#if RK_X86
/* residual += delta (when delta); out = w * residual / sqrt(mean(residual^2) + eps), per row. */
__attribute__((target("avx2,fma"))) static void
add_rms_norm(const float *delta, float *res, float *out, Py_ssize_t M, Py_ssize_t K, const float *w, float eps)
{
    for (Py_ssize_t m = 0; m < M; m++) {
        float *r = res + m * K, *o = out + m * K;
        if (delta) {
            const float *dl = delta + m * K;
            for (Py_ssize_t k = 0; k < K; k++)
                r[k] += dl[k];
        }
        __m256 acc = _mm256_setzero_ps();
        Py_ssize_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(r + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; k < K; k++)
            ss += r[k] * r[k];
        float scale = 1.f / sqrtf(ss / (float)K + eps);
        for (k = 0; k < K; k++)
            o[k] = w[k] * (r[k] * scale);
    }
}

/* Rotate-half RoPE in place on T rows of nh heads (head h of row t at x + t * ldx + h * d):
 * x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2, with cos / sin [T, d] (halves 1 and 2). */
__attribute__((target("avx2,fma"))) static void
rope_inplace(float *x, Py_ssize_t T, Py_ssize_t nh, Py_ssize_t d, Py_ssize_t ldx, const float *cos, const float *sin)
{
    Py_ssize_t half = d / 2;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *c = cos + t * d, *sn = sin + t * d;
        for (Py_ssize_t h = 0; h < nh; h++) {
            float *x1 = x + t * ldx + h * d, *x2 = x1 + half;
            for (Py_ssize_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * sn[i];
                x2[i] = b * c[half + i] + a * sn[half + i];
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i], silu(g) = g / (1 + exp(-g)). */
__attribute__((target("avx2,fma"))) static void
silu_mul(const float *gu, float *out, Py_ssize_t M, Py_ssize_t I)
{
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (Py_ssize_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        Py_ssize_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++)
            o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Grammar masks: logits[rows[i], j] = -inf wherever bit j (LSB first, 32 tokens per int32 word) of
 * bitmask row rows[i] is 0 (xgrammar's token bitmask layout). Words that allow all 32 tokens are
 * skipped, words that allow none are stored as -inf at once; the others blend 8 lanes at a time. */
__attribute__((target("avx2,fma"))) static void
apply_token_bitmask(float *logits, Py_ssize_t ldl, const int32_t *bitmask, Py_ssize_t ldb, const int64_t *rows,
                    Py_ssize_t n_rows, Py_ssize_t vocab)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i zero = _mm256_setzero_si256();
    const Py_ssize_t words = vocab / 32;
    for (Py_ssize_t r = 0; r < n_rows; r++) {
        float *x = logits + rows[r] * ldl;
        const uint32_t *bm = (const uint32_t *)(bitmask + rows[r] * ldb);
        for (Py_ssize_t w = 0; w < words; w++) {
            const uint32_t m = bm[w];
            float *p = x + w * 32;
            if (m == 0xFFFFFFFFu)
                continue;
            if (m == 0) {
                for (int q = 0; q < 4; q++)
                    _mm256_storeu_ps(p + 8 * q, ninf);
                continue;
            }
            for (int q = 0; q < 4; q++) {
                const __m256i b = _mm256_set1_epi32((int)((m >> (8 * q)) & 0xFFu));
                const __m256i off = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), zero);
                _mm256_storeu_ps(p + 8 * q, _mm256_blendv_ps(_mm256_loadu_ps(p + 8 * q), ninf, _mm256_castsi256_ps(off)));
            }
        }
        for (Py_ssize_t j = words * 32; j < vocab; j++)
            if (!((bm[j / 32] >> (j % 32)) & 1u))
                x[j] = -INFINITY;
    }
}
#endif

static PyObject *
py_add_rms_norm(PyObject *self, PyObject *args)
{
    Py_ssize_t delta, res, out, M, K, w;
    double eps;
    if (!PyArg_ParseTuple(args, "nnnnnnd", &delta, &res, &out, &M, &K, &w, &eps))
        return NULL;
#if RK_X86
    if (cpu_ok())
        add_rms_norm((const float *)delta, (float *)res, (float *)out, M, K, (const float *)w, (float)eps);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_rope_inplace(PyObject *self, PyObject *args)
{
    Py_ssize_t x, T, nh, d, ldx, cos, sin;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &x, &T, &nh, &d, &ldx, &cos, &sin))
        return NULL;
#if RK_X86
    if (cpu_ok())
        rope_inplace((float *)x, T, nh, d, ldx, (const float *)cos, (const float *)sin);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_silu_mul(PyObject *self, PyObject *args)
{
    Py_ssize_t gu, out, M, I;
    if (!PyArg_ParseTuple(args, "nnnn", &gu, &out, &M, &I))
        return NULL;
#if RK_X86
    if (cpu_ok())
        silu_mul((const float *)gu, (float *)out, M, I);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_apply_token_bitmask(PyObject *self, PyObject *args)
{
    Py_ssize_t logits, ldl, bitmask, ldb, rows, n_rows, vocab;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &logits, &ldl, &bitmask, &ldb, &rows, &n_rows, &vocab))
        return NULL;
#if RK_X86
    if (cpu_ok()) {
        Py_BEGIN_ALLOW_THREADS
        apply_token_bitmask((float *)logits, ldl, (const int32_t *)bitmask, ldb, (const int64_t *)rows, n_rows, vocab);
        Py_END_ALLOW_THREADS
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_advise_hugepages(PyObject *self, PyObject *args)
{
    Py_ssize_t addr, nbytes;
    if (!PyArg_ParseTuple(args, "nn", &addr, &nbytes))
        return NULL;
#ifdef MADV_HUGEPAGE
    /* only whole 2 MiB pages inside the range; pages not yet touched get transparent huge pages */
    uintptr_t lo = ((uintptr_t)addr + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)nbytes) & ~(uintptr_t)((2u << 20) - 1);
    if (hi > lo && madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0)
        Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

/* ------------------------------------------------------------------ the whole decode step
 *
 * decode_step runs one forward pass of a decode-sized batch (at most STEP_MAX_ROWS new tokens, any
 * mix of decodes and short extends) through every layer and the output projection in ONE call and
 * ONE parallel region: the embeddings, per layer RMSNorm (+ residual), the q/k/v GEMM with RoPE
 * and the K/V write, paged attention, the o GEMM, RMSNorm, gate|up with SiLU-and-multiply, down,
 * then the final norm and the logits of the rows asked for. The threads meet at a spin barrier
 * between the phases that need each other's results (5 a layer). The row-wise steps that are
 * cheap (norms, the residual, the attention merge) run on every thread over all rows, each into
 * its own copy (the same operations on the same inputs give the same bits), so no barrier waits
 * for them. The GEMM and attention work units are taken in guided chunks (take_chunk), so a
 * thread that runs late costs the others little.
 *
 * The numbers are those of the module path's kernels (gemm_range, attend_unit below, add_rms_norm,
 * rope_inplace, silu_mul): every output element is computed by one thread in a fixed order, so the
 * logits do not depend on the thread count nor on the other requests of the batch. Attention is
 * split into chunks of ATT_CHUNK positions per (query row, KV head), merged in order; a request
 * with at most ATT_CHUNK positions gets exactly the bits of paged_attention.
 *
 * The plan (step_plan, a capsule) holds the model's addresses, taken once by
 * radixkv/executor/cpu_decode.py (which keeps the tensors alive and rebuilds the plan when a weight
 * changes); the block table is read directly: slot of position p of a token's request =
 * req_to_token[row, p]. Every call checks its rows, positions, tokens and every slot it will read
 * or write before the region starts. */

#define STEP_MAX_ROWS 64
#ifndef ATT_CHUNK
#define ATT_CHUNK 256 /* positions per attention work unit */
#endif

typedef struct {
    const float *norm_in, *norm_post;
    float eps_in, eps_post;
    const pw_header *w[4]; /* qkv, o, gate|up, down */
    const float *b[4];
    float *k_cache, *v_cache; /* [num_slots, hkv, d] */
} layer_plan;

typedef struct {
    int L, H, hq, hkv, d, inter, V;
    layer_plan *layer;
    const float *embed; /* [V, H] */
    const float *final_norm;
    float final_eps;
    const pw_header *lm_head; /* [V, H] packed */
    const float *cos, *sin;   /* [rope_len, d] */
    Py_ssize_t rope_len;
    const int32_t *r2t; /* [r2t_rows, r2t_cols] */
    Py_ssize_t r2t_rows, r2t_cols;
    Py_ssize_t page_size, num_slots;
    float sm_scale;
    int nt_max; /* threads with a private buffer */
    Py_ssize_t priv_floats;
    float *shared; /* qkv, delta, gu, act: STEP_MAX_ROWS rows each */
    float *priv;   /* per thread: residual, x, att [STEP_MAX_ROWS rows each], attention scratch */
    float *part;   /* attention partials: [T, hq, max chunks, d + 2] */
    Py_ssize_t part_cap;
    int32_t *units; /* attention units: (token row, KV head, chunk) */
    Py_ssize_t units_cap;
    Py_ssize_t *counters;
    int n_counters;
    pthread_mutex_t mu; /* one step at a time on a plan (its scratch) */
} step_plan;

typedef struct {
    int count, sense;
    char pad[56];
} step_barrier;

typedef struct {
    step_plan *p;
    int T, S;
    const int64_t *tok;   /* [T] token ids */
    const int32_t *t_row; /* [T] block-table row of each token row */
    const int32_t *t_pos; /* [T] its position */
    const int32_t *lrows; /* [S] rows whose logits are computed */
    float *logits;        /* [S, V] */
    Py_ssize_t n_units;
    int max_chunks;
    step_barrier bar __attribute__((aligned(64)));
} step_args;

/* All threads of the region meet here (sense-reversing counter; local: the thread's sense). */
static void
step_sync(step_barrier *b, int n, int *local)
{
    if (n <= 1)
        return;
    int s = *local ^= 1;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
    } else {
        for (long spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; spins++)
            wait_backoff(spins);
    }
}

#if RK_X86
/* One attention unit: token row t, KV head g (its G = hq / hkv query heads), positions
 * [c * ATT_CHUNK, ...) of the row's visible ones, against layer lp's cache. Writes per query head
 * its partial (max, sum, unnormalized weighted sum of V: d floats) to part. The three passes are
 * attend_row's, with the same operations (pv_block with inv = 1 gives the unnormalized sum
 * exactly; step_merge then scales by 1 / sum as attend_row does). */
__attribute__((target("avx2,fma"))) static void
attend_unit(const step_args *sa, const layer_plan *lp, int t, int g, int c, float *scratch)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq, hkv = p->hkv, G = hq / hkv;
    const Py_ssize_t row_len = (Py_ssize_t)hkv * d, nqkv = (Py_ssize_t)(hq + 2 * hkv) * d;
    const Py_ssize_t vis = (Py_ssize_t)sa->t_pos[t] + 1, p0 = (Py_ssize_t)c * ATT_CHUNK;
    const Py_ssize_t n = vis - p0 < ATT_CHUNK ? vis - p0 : ATT_CHUNK;
    const int32_t *r2t = p->r2t + (Py_ssize_t)sa->t_row[t] * p->r2t_cols + p0;
    const float *qrow = p->shared + t * nqkv + (Py_ssize_t)g * G * d; /* q heads of group g */
    const float *kb = lp->k_cache + (Py_ssize_t)g * d, *vb = lp->v_cache + (Py_ssize_t)g * d;
    Py_ssize_t *slot = (Py_ssize_t *)scratch;
    float *scores = scratch + 2 * ATT_CHUNK; /* [G][n] */
    for (Py_ssize_t i = 0; i < n; i++)
        slot[i] = r2t[i];
    const __m256 vscale = _mm256_set1_ps(p->sm_scale);
    Py_ssize_t q = 0;
    for (; q + 8 <= n; q += 8) {
        const float *kp[8];
        for (int j = 0; j < 8; j++)
            kp[j] = kb + slot[q + j] * row_len;
        for (int h = 0; h < G; h++)
            _mm256_storeu_ps(scores + (Py_ssize_t)h * n + q, _mm256_mul_ps(qk8(qrow + (Py_ssize_t)h * d, kp, d), vscale));
    }
    for (; q < n; q++) {
        const float *kp = kb + slot[q] * row_len;
        for (int h = 0; h < G; h++) {
            const float *qh = qrow + (Py_ssize_t)h * d;
            __m256 acc = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), _mm256_loadu_ps(kp + e), acc);
            scores[(Py_ssize_t)h * n + q] = hsum256(acc) * p->sm_scale;
        }
    }
    const Py_ssize_t ldp = (Py_ssize_t)sa->max_chunks * (d + 2);
    float *part = p->part + ((Py_ssize_t)t * hq + (Py_ssize_t)g * G) * ldp + (Py_ssize_t)c * (d + 2);
    float ones[64];
    for (int h = 0; h < G; h++) {
        float *sc = scores + (Py_ssize_t)h * n;
        Py_ssize_t i = 0;
        __m256 vmx = _mm256_set1_ps(sc[0]);
        for (; i + 8 <= n; i += 8)
            vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + i));
        float mx = hmax256(vmx);
        for (; i < n; i++)
            mx = sc[i] > mx ? sc[i] : mx;
        __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
        for (i = 0; i + 8 <= n; i += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), vm));
            _mm256_storeu_ps(sc + i, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        if (i < n) {
            float tt[8];
            int m = (int)(n - i);
            for (int k = 0; k < 8; k++)
                tt[k] = k < m ? sc[i + k] - mx : -87.3f;
            __m256 e = exp256(_mm256_loadu_ps(tt));
            _mm256_storeu_ps(tt, e);
            for (int k = 0; k < m; k++)
                sc[i + k] = tt[k];
            vsum = _mm256_add_ps(vsum, _mm256_blendv_ps(_mm256_setzero_ps(), e,
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
        }
        float *ph = part + (Py_ssize_t)h * ldp;
        ph[0] = mx;
        ph[1] = hsum256(vsum);
        ones[h] = 1.f;
    }
    for (int h0 = 0; h0 < G; h0 += 3) {
        int hc = G - h0 < 3 ? G - h0 : 3;
        for (int e0 = 0; e0 < d; e0 += 32) {
            int nc = (d - e0) / 8 < 4 ? (d - e0) / 8 : 4;
            const float *w = scores + (Py_ssize_t)h0 * n;
            float *o = part + (Py_ssize_t)h0 * ldp + 2 + e0;
            const float *vbe = vb + e0;
            switch (hc * 4 + nc) {
#define PV(HC, NC) case HC * 4 + NC: pv_block(HC, NC, vbe, slot, row_len, n, w, ones + h0, o, ldp); break;
            PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
            PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4)
#undef PV
            }
        }
    }
}

/* att[t, h] = the merged partials of every chunk of row t, head h (in chunk order): one chunk is
 * attend_row's inv * acc, bit for bit; more are rescaled to their common maximum. */
__attribute__((target("avx2,fma"))) static void
step_merge(const step_args *sa, float *att)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq;
    const Py_ssize_t ldp = (Py_ssize_t)sa->max_chunks * (d + 2);
    for (int t = 0; t < sa->T; t++) {
        int nc = (sa->t_pos[t] + ATT_CHUNK) / ATT_CHUNK;
        for (int h = 0; h < hq; h++) {
            const float *ph = p->part + ((Py_ssize_t)t * hq + h) * ldp;
            float *o = att + ((Py_ssize_t)t * hq + h) * d;
            if (nc == 1) {
                __m256 sv = _mm256_set1_ps(1.f / ph[1]);
                for (int e = 0; e < d; e += 8)
                    _mm256_storeu_ps(o + e, _mm256_mul_ps(sv, _mm256_loadu_ps(ph + 2 + e)));
                continue;
            }
            float mx = ph[0];
            for (int c = 1; c < nc; c++)
                mx = ph[c * (d + 2)] > mx ? ph[c * (d + 2)] : mx;
            float sum = 0.f;
            for (int e = 0; e < d; e += 8)
                _mm256_storeu_ps(o + e, _mm256_setzero_ps());
            for (int c = 0; c < nc; c++) {
                const float *pc = ph + c * (d + 2);
                float f = expf(pc[0] - mx);
                sum += f * pc[1];
                __m256 fv = _mm256_set1_ps(f);
                for (int e = 0; e < d; e += 8)
                    _mm256_storeu_ps(o + e, _mm256_fmadd_ps(fv, _mm256_loadu_ps(pc + 2 + e), _mm256_loadu_ps(o + e)));
            }
            __m256 sv = _mm256_set1_ps(1.f / sum);
            for (int e = 0; e < d; e += 8)
                _mm256_storeu_ps(o + e, _mm256_mul_ps(sv, _mm256_loadu_ps(o + e)));
        }
    }
}

/* RoPE on head hd (< hq + hkv) of every row of qkv, then k / v heads (hd >= hq) into the cache. */
static void
step_rope_kv(const step_args *sa, const layer_plan *lp, int hd, int t0, int t1)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq, hkv = p->hkv;
    const Py_ssize_t nqkv = (Py_ssize_t)(hq + 2 * hkv) * d, row_len = (Py_ssize_t)hkv * d;
    for (int t = t0; t < t1; t++) {
        float *hp = p->shared + t * nqkv + (Py_ssize_t)hd * d;
        const Py_ssize_t pos = sa->t_pos[t];
        if (hd < hq + hkv)
            rope_inplace(hp, 1, 1, d, d, p->cos + pos * d, p->sin + pos * d);
        if (hd >= hq) {
            const Py_ssize_t slot = p->r2t[(Py_ssize_t)sa->t_row[t] * p->r2t_cols + pos];
            float *dst = hd < hq + hkv ? lp->k_cache + slot * row_len + (Py_ssize_t)(hd - hq) * d
                                       : lp->v_cache + slot * row_len + (Py_ssize_t)(hd - hq - hkv) * d;
            memcpy(dst, hp, sizeof(float) * (size_t)d);
        }
    }
}

/* act[:, 16u ... 16u + 16) = silu(gate) * up for the rows of gu (as silu_mul, vector lanes). */
__attribute__((target("avx2,fma"))) static void
silu_cols(const float *gu, float *act, int M, Py_ssize_t I, Py_ssize_t col)
{
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I + col, *u = g + I;
        float *o = act + m * I + col;
        for (int i = 0; i < NR; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
    }
}

/* All panels of C = X @ W^T (+ bias), shared out in chunks (groups of 4 for one row: the GEMV's P). */
static void
step_gemm(const float *x, const float *xs, int M, Py_ssize_t ldx, const pw_header *w, const float *bias, float *c,
          Py_ssize_t ldc, Py_ssize_t *counter, int n, float *buf)
{
    const Py_ssize_t panels = (w->n + NR - 1) / NR;
    Py_ssize_t p0, p1;
    while (take_chunk(counter, panels, n, M == 1 ? 4 : 1, &p0, &p1))
        gemm_range(x, xs, M, ldx, w, p0, p1, bias, c, ldc, buf);
}

__attribute__((target("avx2,fma,f16c"))) static void
step_task(void *arg, int tid, int n)
{
    step_args *sa = (step_args *)arg;
    step_plan *p = sa->p;
    const int T = sa->T, H = p->H, hq = p->hq, hkv = p->hkv, d = p->d, G = hq / hkv;
    const Py_ssize_t I = p->inter, nqkv = (Py_ssize_t)(hq + 2 * hkv) * d;
    float *qkv = p->shared, *delta = qkv + STEP_MAX_ROWS * nqkv, *gu = delta + STEP_MAX_ROWS * H;
    float *act = gu + STEP_MAX_ROWS * 2 * I;
    float *res = p->priv + (Py_ssize_t)tid * p->priv_floats, *x = res + STEP_MAX_ROWS * H;
    float *att = x + STEP_MAX_ROWS * H, *scratch = att + (Py_ssize_t)STEP_MAX_ROWS * hq * d;
    float *xs = scratch + (2 + G) * ATT_CHUNK + 64 + H; /* block sums of the GEMM input at hand */
    float buf[KC * NR] __attribute__((aligned(64)));
    int sense = 0, ph = 0;
    const int head_units = d % NR == 0, pair_units = I % NR == 0;
    for (int t = 0; t < T; t++)
        memcpy(res + (Py_ssize_t)t * H, p->embed + sa->tok[t] * H, sizeof(float) * (size_t)H);
    for (int l = 0; l < p->L; l++) {
        const layer_plan *lp = &p->layer[l];
        add_rms_norm(l ? delta : NULL, res, x, T, H, lp->norm_in, lp->eps_in);
        block_sums_rows(x, T, H, H, xs);
        /* q/k/v: whole heads per unit, each then rotated and its K/V stored by the same thread */
        Py_ssize_t *ctr = &p->counters[ph++], u0, u1;
        if (head_units) {
            const Py_ssize_t hp = d / NR;
            while (take_chunk(ctr, hq + 2 * hkv, n, 1, &u0, &u1))
                for (Py_ssize_t u = u0; u < u1; u++) {
                    gemm_range(x, xs, T, H, lp->w[0], u * hp, (u + 1) * hp, lp->b[0], qkv, nqkv, buf);
                    step_rope_kv(sa, lp, (int)u, 0, T);
                }
            step_sync(&sa->bar, n, &sense);
        } else {
            step_gemm(x, xs, T, H, lp->w[0], lp->b[0], qkv, nqkv, ctr, n, buf);
            step_sync(&sa->bar, n, &sense);
            int t0 = T * tid / n, t1 = T * (tid + 1) / n;
            for (int hd = 0; hd < hq + 2 * hkv; hd++)
                step_rope_kv(sa, lp, hd, t0, t1);
            step_sync(&sa->bar, n, &sense);
        }
        /* attention units, then every thread merges all of them into its own att */
        ctr = &p->counters[ph++];
        while (take_chunk(ctr, sa->n_units, n, 1, &u0, &u1))
            for (Py_ssize_t u = u0; u < u1; u++) {
                const int32_t *un = p->units + 3 * u;
                attend_unit(sa, lp, un[0], un[1], un[2], scratch);
            }
        step_sync(&sa->bar, n, &sense);
        step_merge(sa, att);
        block_sums_rows(att, T, (Py_ssize_t)hq * d, (Py_ssize_t)hq * d, xs);
        step_gemm(att, xs, T, (Py_ssize_t)hq * d, lp->w[1], lp->b[1], delta, H, &p->counters[ph++], n, buf);
        step_sync(&sa->bar, n, &sense);
        add_rms_norm(delta, res, x, T, H, lp->norm_post, lp->eps_post);
        block_sums_rows(x, T, H, H, xs);
        /* gate|up: a unit is a gate panel and its up panel, so SiLU-and-multiply follows at once */
        ctr = &p->counters[ph++];
        if (pair_units) {
            /* one row: two gate panels and their up panels at a time (the GEMV's 4) */
            const Py_ssize_t np = I / NR, two = T == 1 && np % 2 == 0 ? 2 : 1;
            while (take_chunk(ctr, np, n, two, &u0, &u1))
                for (Py_ssize_t u = u0; u < u1; u += two) {
                    if (T == 1) {
                        panel_ref r[4] = {panel_at(lp->w[2], u, lp->b[2], gu), panel_at(lp->w[2], u + two - 1, lp->b[2], gu),
                                          panel_at(lp->w[2], u + np, lp->b[2], gu),
                                          panel_at(lp->w[2], u + np + two - 1, lp->b[2], gu)};
                        if (two == 1)
                            r[1] = r[2];
                        gemv_refs(x, xs, H, (int)lp->w[2]->fmt, r, 2 * (int)two);
                    } else {
                        gemm_panel(x, xs, T, H, lp->w[2], u, lp->b[2], gu, 2 * I, buf);
                        gemm_panel(x, xs, T, H, lp->w[2], u + np, lp->b[2], gu, 2 * I, buf);
                    }
                    for (Py_ssize_t v = u; v < u + two; v++)
                        silu_cols(gu, act, T, I, v * NR);
                }
            step_sync(&sa->bar, n, &sense);
        } else {
            step_gemm(x, xs, T, H, lp->w[2], lp->b[2], gu, 2 * I, ctr, n, buf);
            step_sync(&sa->bar, n, &sense);
            int t0 = T * tid / n, t1 = T * (tid + 1) / n;
            if (t1 > t0)
                silu_mul(gu + t0 * 2 * I, act + t0 * I, t1 - t0, I);
            step_sync(&sa->bar, n, &sense);
        }
        block_sums_rows(act, T, I, I, xs);
        step_gemm(act, xs, T, I, lp->w[3], lp->b[3], delta, H, &p->counters[ph++], n, buf);
        step_sync(&sa->bar, n, &sense);
    }
    /* final norm of the rows asked for, into x, then the output projection */
    float *tmp = scratch + (2 + G) * ATT_CHUNK + 64; /* the residual row (a row may be asked for twice) */
    for (int s = 0; s < sa->S; s++) {
        const Py_ssize_t r = sa->lrows[s];
        memcpy(tmp, res + r * H, sizeof(float) * (size_t)H);
        add_rms_norm(delta + r * H, tmp, x + (Py_ssize_t)s * H, 1, H, p->final_norm, p->final_eps);
    }
    block_sums_rows(x, sa->S, H, H, xs);
    if (sa->S > 0)
        step_gemm(x, xs, sa->S, H, p->lm_head, NULL, sa->logits, p->V, &p->counters[ph++], n, buf);
}
#endif

static void
step_plan_free(PyObject *cap)
{
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (!p)
        return;
    free(p->layer);
    free(p->shared);
    free(p->priv);
    free(p->part);
    free(p->units);
    free(p->counters);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* step_plan(dims, layers, embed, final_norm, final_eps, lm_head, r2t, r2t_rows, r2t_cols,
 *           page_size, num_slots, sm_scale) -> capsule
 * dims: (L, H, hq, hkv, d, inter, V). layers: L tuples (norm_in, norm_post, eps_in, eps_post,
 * qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b, k_cache, v_cache): addresses (0 for no
 * bias) and floats. Every packed weight's header is checked against its shape. The RoPE tables
 * are set with step_set_rope before the first step. */
static PyObject *
py_step_plan(PyObject *self, PyObject *args)
{
    int L, H, hq, hkv, d, inter, V;
    PyObject *layers;
    Py_ssize_t embed, fnorm, lm_head, r2t, r2t_rows, r2t_cols, page_size, num_slots;
    double feps, sm_scale;
    if (!PyArg_ParseTuple(args, "(iiiiiii)Onndnnnnnnd", &L, &H, &hq, &hkv, &d, &inter, &V, &layers, &embed, &fnorm,
                          &feps, &lm_head, &r2t, &r2t_rows, &r2t_cols, &page_size, &num_slots, &sm_scale))
        return NULL;
    if (!cpu_or_raise("step_plan"))
        return NULL;
    if (L < 1 || H < 1 || hq < 1 || hkv < 1 || hq % hkv || d < 8 || d % 8 || d > 256 || inter < 1 || V < 1 ||
        hq / hkv > 64 || page_size < 1 || num_slots < 1 || r2t_rows < 1 || r2t_cols < 1 ||
        !PyTuple_Check(layers) || PyTuple_GET_SIZE(layers) != L) {
        PyErr_SetString(PyExc_ValueError, "step_plan: bad dimensions or layer table");
        return NULL;
    }
    const char *bad = check_pw((const pw_header *)lm_head, V, H);
    step_plan *p = (step_plan *)calloc(1, sizeof *p);
    if (!p)
        return PyErr_NoMemory();
    p->L = L, p->H = H, p->hq = hq, p->hkv = hkv, p->d = d, p->inter = inter, p->V = V;
    p->layer = (layer_plan *)calloc((size_t)L, sizeof(layer_plan));
    pthread_mutex_init(&p->mu, NULL);
    PyObject *cap = PyCapsule_New(p, "radixkv.step_plan", step_plan_free);
    if (!cap) {
        free(p->layer);
        free(p);
        return NULL;
    }
    if (!p->layer) {
        Py_DECREF(cap);
        return PyErr_NoMemory();
    }
    for (int l = 0; l < L && !bad; l++) {
        Py_ssize_t a[12];
        double e0, e1;
        PyObject *item = PyTuple_GET_ITEM(layers, l);
        if (!PyArg_ParseTuple(item, "nnddnnnnnnnnnn", &a[0], &a[1], &e0, &e1, &a[2], &a[3], &a[4], &a[5], &a[6],
                              &a[7], &a[8], &a[9], &a[10], &a[11])) {
            Py_DECREF(cap);
            return NULL;
        }
        layer_plan *lp = &p->layer[l];
        lp->norm_in = (const float *)a[0], lp->norm_post = (const float *)a[1];
        lp->eps_in = (float)e0, lp->eps_post = (float)e1;
        for (int i = 0; i < 4; i++) {
            lp->w[i] = (const pw_header *)a[2 + 2 * i];
            lp->b[i] = (const float *)a[3 + 2 * i];
        }
        lp->k_cache = (float *)a[10], lp->v_cache = (float *)a[11];
        bad = check_pw(lp->w[0], (Py_ssize_t)(hq + 2 * hkv) * d, H);
        if (!bad)
            bad = check_pw(lp->w[1], H, (Py_ssize_t)hq * d);
        if (!bad)
            bad = check_pw(lp->w[2], 2 * (Py_ssize_t)inter, H);
        if (!bad)
            bad = check_pw(lp->w[3], H, inter);
        if (!bad && (!lp->norm_in || !lp->norm_post || !lp->k_cache || !lp->v_cache))
            bad = "a layer's address is 0";
    }
    if (bad || !embed || !fnorm || !r2t) {
        PyErr_Format(PyExc_ValueError, "step_plan: %s", bad ? bad : "an address is 0");
        Py_DECREF(cap);
        return NULL;
    }
    p->embed = (const float *)embed, p->final_norm = (const float *)fnorm, p->final_eps = (float)feps;
    p->lm_head = (const pw_header *)lm_head;
    p->r2t = (const int32_t *)r2t, p->r2t_rows = r2t_rows, p->r2t_cols = r2t_cols;
    p->page_size = page_size, p->num_slots = num_slots, p->sm_scale = (float)sm_scale;
    p->nt_max = usable_cpus() < MAX_THREADS ? usable_cpus() : MAX_THREADS;
    const Py_ssize_t nqkv = (Py_ssize_t)(hq + 2 * hkv) * d;
    Py_ssize_t kmax = H > (Py_ssize_t)hq * d ? H : (Py_ssize_t)hq * d;
    kmax = kmax > inter ? kmax : inter;
    p->priv_floats = STEP_MAX_ROWS * (2 * (Py_ssize_t)H + (Py_ssize_t)hq * d) + 2 * ATT_CHUNK +
                     (Py_ssize_t)(hq / hkv) * ATT_CHUNK + 64 + H + STEP_MAX_ROWS * (kmax / QB + 1);
    p->priv_floats = (p->priv_floats + 15) / 16 * 16; /* each thread's buffers on their own lines */
    p->shared = (float *)aligned_alloc(64, sizeof(float) * (size_t)(STEP_MAX_ROWS * (nqkv + H + 3 * (Py_ssize_t)inter) + 16));
    p->priv = (float *)aligned_alloc(64, sizeof(float) * (size_t)(p->priv_floats * p->nt_max));
    p->n_counters = 5 * L + 2;
    p->counters = (Py_ssize_t *)calloc((size_t)p->n_counters, sizeof(Py_ssize_t));
    if (!p->shared || !p->priv || !p->counters) {
        Py_DECREF(cap);
        return PyErr_NoMemory();
    }
    return cap;
}

/* step_set_rope(plan, cos, sin, rope_len, width): the RoPE tables [rope_len, d] (positions 0 ..);
 * width must be the plan's head_dim. */
static PyObject *
py_step_set_rope(PyObject *self, PyObject *args)
{
    PyObject *cap;
    Py_ssize_t cos, sin, len, width;
    if (!PyArg_ParseTuple(args, "Onnnn", &cap, &cos, &sin, &len, &width))
        return NULL;
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (!p)
        return NULL;
    if (!cos || !sin || len < 0 || width != p->d) {
        PyErr_SetString(PyExc_ValueError, "step_set_rope: bad table");
        return NULL;
    }
    pthread_mutex_lock(&p->mu);
    p->cos = (const float *)cos, p->sin = (const float *)sin, p->rope_len = len;
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_NONE;
}

/* Reads a sequence of ints into out[0 .. n) (n <= cap); returns n, or -1 with an exception. */
static Py_ssize_t
read_ints(PyObject *seq, int64_t *out, Py_ssize_t cap, const char *name)
{
    PyObject *fast = PySequence_Fast(seq, name);
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > cap) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "decode_step: %s has more than %zd entries", name, cap);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return n;
}

/* decode_step(plan, tokens, rows, prefix_lens, extend_lens, logits_rows, logits, nthreads): one
 * forward pass (see the section's comment). tokens: T ids (request after request); rows /
 * prefix_lens / extend_lens: per request its block-table row, K/V already in the pool and new
 * tokens; logits_rows: S token rows; logits: address of float32 [S, V]. Raises ValueError for any
 * value that would read or write outside the buffers (nothing is written then). */
static PyObject *
py_decode_step(PyObject *self, PyObject *args)
{
    PyObject *cap, *otok, *orows, *opre, *oext, *olr;
    Py_ssize_t logits, nthreads;
    if (!PyArg_ParseTuple(args, "OOOOOOnn", &cap, &otok, &orows, &opre, &oext, &olr, &logits, &nthreads))
        return NULL;
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (!p)
        return NULL;
    int64_t tok[STEP_MAX_ROWS], rows[STEP_MAX_ROWS], pre[STEP_MAX_ROWS], ext[STEP_MAX_ROWS], lr[STEP_MAX_ROWS];
    Py_ssize_t T = read_ints(otok, tok, STEP_MAX_ROWS, "tokens");
    Py_ssize_t B = T < 0 ? -1 : read_ints(orows, rows, STEP_MAX_ROWS, "rows");
    Py_ssize_t B2 = B < 0 ? -1 : read_ints(opre, pre, STEP_MAX_ROWS, "prefix_lens");
    Py_ssize_t B3 = B2 < 0 ? -1 : read_ints(oext, ext, STEP_MAX_ROWS, "extend_lens");
    Py_ssize_t S = B3 < 0 ? -1 : read_ints(olr, lr, STEP_MAX_ROWS, "logits_rows");
    if (S < 0)
        return NULL;
    const char *bad = NULL;
    if (B < 1 || B2 != B || B3 != B)
        bad = "rows, prefix_lens and extend_lens need the same length >= 1";
    int32_t t_row[STEP_MAX_ROWS], t_pos[STEP_MAX_ROWS], lrows[STEP_MAX_ROWS];
    Py_ssize_t t = 0;
    for (Py_ssize_t r = 0; r < B && !bad; r++) {
        if (rows[r] < 0 || rows[r] >= p->r2t_rows)
            bad = "a row is outside the block table";
        else if (pre[r] < 0 || ext[r] < 1 || pre[r] + ext[r] > p->r2t_cols)
            bad = "every request needs prefix_len >= 0, extend_len >= 1 and prefix_len + extend_len <= max_context_len";
        else if (pre[r] + ext[r] > p->rope_len)
            bad = "a position is beyond the RoPE table";
        else if (t + ext[r] > T)
            bad = "tokens has fewer entries than sum(extend_lens)";
        else {
            const int32_t *r2t = p->r2t + rows[r] * p->r2t_cols;
            for (Py_ssize_t q = 0; q < pre[r] + ext[r] && !bad; q++)
                if (r2t[q] < 0 || r2t[q] >= p->num_slots)
                    bad = "a slot in the block table is outside the KV pool";
            const Py_ssize_t ps = p->page_size;
            for (Py_ssize_t j = 0; j < ext[r] && !bad; j++, t++) {
                Py_ssize_t pos = pre[r] + j, s = r2t[pos];
                if (ps > 1 && (s % ps != pos % ps || s - pos % ps != r2t[pos - pos % ps]))
                    bad = "slots in req_to_token are not aligned to page_size";
                t_row[t] = (int32_t)rows[r];
                t_pos[t] = (int32_t)pos;
            }
        }
    }
    if (!bad && t != T)
        bad = "tokens must have sum(extend_lens) entries";
    for (Py_ssize_t i = 0; i < T && !bad; i++)
        if (tok[i] < 0 || tok[i] >= p->V)
            bad = "a token id is outside the vocabulary";
    for (Py_ssize_t i = 0; i < S && !bad; i++) {
        if (lr[i] < 0 || lr[i] >= T)
            bad = "a logits row is outside the batch";
        lrows[i] = (int32_t)lr[i];
    }
    if (!bad && S > 0 && !logits)
        bad = "logits address is 0";
    if (!bad && (!p->cos || !p->sin))
        bad = "the RoPE tables are not set";
    if (bad) {
        PyErr_Format(PyExc_ValueError, "decode_step: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("decode_step"))
        return NULL;
#if RK_X86
    int fail = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    step_args sa;
    memset(&sa, 0, sizeof sa);
    sa.p = p, sa.T = (int)T, sa.S = (int)S, sa.tok = tok, sa.t_row = t_row, sa.t_pos = t_pos, sa.lrows = lrows;
    sa.logits = (float *)logits;
    /* attention units and partials for this batch */
    Py_ssize_t units = 0;
    int max_chunks = 1;
    for (Py_ssize_t i = 0; i < T; i++) {
        int nc = (t_pos[i] + ATT_CHUNK) / ATT_CHUNK;
        units += (Py_ssize_t)nc * p->hkv;
        max_chunks = nc > max_chunks ? nc : max_chunks;
    }
    Py_ssize_t part = T * (Py_ssize_t)p->hq * max_chunks * (p->d + 2);
    if (units > p->units_cap) {
        free(p->units);
        p->units = (int32_t *)malloc(sizeof(int32_t) * 3 * (size_t)units);
        p->units_cap = p->units ? units : 0;
    }
    if (part > p->part_cap) {
        free(p->part);
        p->part = (float *)aligned_alloc(64, sizeof(float) * (size_t)((part + 15) / 16 * 16));
        p->part_cap = p->part ? part : 0;
    }
    if (!p->units || !p->part) {
        fail = 1;
    } else {
        Py_ssize_t u = 0;
        for (int i = 0; i < (int)T; i++)
            for (int c = 0; c <= t_pos[i] / ATT_CHUNK; c++)
                for (int g = 0; g < p->hkv; g++, u++) {
                    p->units[3 * u] = i;
                    p->units[3 * u + 1] = g;
                    p->units[3 * u + 2] = c;
                }
        sa.n_units = units;
        sa.max_chunks = max_chunks;
        memset(p->counters, 0, sizeof(Py_ssize_t) * (size_t)p->n_counters);
        int nt = (int)nthreads < p->nt_max ? (int)nthreads : p->nt_max;
        run_parallel(step_task, &sa, nt < 1 ? 1 : nt);
    }
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    if (fail)
        return PyErr_NoMemory();
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", py_available, METH_NOARGS, "True when the CPU has AVX2, FMA and F16C."},
    {"isa", py_isa, METH_NOARGS, "'avx512' or 'avx2': the vector kernels in use (None: no kernels)."},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa('avx2' | 'avx512'): choose the vector kernels."},
    {"threading", py_threading, METH_NOARGS, "'openmp' or 'pthreads': what the kernels' threads are now."},
    {"sgemm_packed", py_sgemm_packed, METH_VARARGS, "C = X @ W^T (+ bias) with W packed in 16-column panels."},
    {"packed_bytes", py_packed_bytes, METH_VARARGS, "Bytes of a packed [N, K] weight in a format (0: K does not suit it)."},
    {"pack_weight", py_pack_weight, METH_VARARGS, "Pack W [N, K] in a format; False when it is not exact there."},
    {"advise_hugepages", py_advise_hugepages, METH_VARARGS, "madvise(MADV_HUGEPAGE) the whole 2 MiB pages of a range."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS, "residual += delta; out = RMSNorm(residual) * w."},
    {"rope_inplace", py_rope_inplace, METH_VARARGS, "Rotate-half RoPE in place."},
    {"silu_mul", py_silu_mul, METH_VARARGS, "out = silu(gate) * up."},
    {"apply_token_bitmask", py_apply_token_bitmask, METH_VARARGS, "-inf where a token bitmask bit is 0."},
    {"step_plan", py_step_plan, METH_VARARGS, "The addresses of a model for decode_step (a capsule)."},
    {"step_set_rope", py_step_set_rope, METH_VARARGS, "Set a step plan's RoPE tables."},
    {"decode_step", py_decode_step, METH_VARARGS, "One whole forward pass of a decode batch (see the source)."},
    {"paged_attention", py_paged_attention, METH_VARARGS, "Causal paged attention (FlashInfer semantics)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "radixkv.kernels._ckernels", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__ckernels(void)
{
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork_done = 1;
    }
    return PyModule_Create(&moddef);
}
