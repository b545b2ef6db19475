/* What the parts of radixkv.kernels._ckernels share (one file per concern, linked into one module):
 *
 *   threadpool.c  run_parallel: OpenMP (torch's libgomp) or the pthread pool
 *   gemm.c        packed-weight GEMM: the micro-kernel, the one-row GEMV (AVX2 and AVX-512), the ISA choice
 *   quant.c       weight packing: the float32 panels and the lossless Q4_1 / Q8_0 block formats
 *   attention.c   paged attention: the K/V row loader, scores, the one softmax, the weighted sum of V
 *   ops.c         RMSNorm, RoPE, SwiGLU, grammar bitmasks (one thread each)
 *   step.c        the whole decode step of a batch in one parallel region (decode_step)
 *   bindings.c    the Python functions (argument parsing, GIL release) and the module
 *
 * The module's Python API and its contracts are described at the top of bindings.c. Every symbol
 * declared here is hidden: only PyInit__ckernels leaves the shared object. */
#ifndef RK_INTERNAL_H
#define RK_INTERNAL_H

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define RK_X86 1
#include <immintrin.h>
#else
#define RK_X86 0
#endif

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ threads (threadpool.c) */

#define MAX_THREADS 64

typedef void (*task_fn)(void *arg, int tid, int nthreads);

/* Runs fn(arg, tid, n) for tid in [0, n) on n threads (the caller is tid 0); n is capped at the
 * usable CPUs (OpenMP may give fewer threads: fn gets the count that runs). One region at a time. */
void run_parallel(task_fn fn, void *arg, int n);
/* CPUs this process may run on (its affinity mask), counted once. */
int usable_cpus(void);
/* "openmp" or "pthreads": what run_parallel uses in this process now. */
const char *pool_threading(void);
/* pthread_atfork child handler: the workers did not survive fork(). */
void pool_after_fork_child(void);

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

/* ------------------------------------------------------------------ vector math */

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
#endif

/* ------------------------------------------------------------------ packed weights (quant.c, gemm.c) */

#define NR 16 /* output columns of a panel */
#define MR 6  /* rows of X per micro-kernel call */
#ifndef KC
#define KC 128 /* rows of a weight panel per block (8 KiB) */
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

/* Bytes of a packed [N, K] weight in format fmt (header included); 0: K does not suit fmt. */
Py_ssize_t pw_bytes(int fmt, Py_ssize_t N, Py_ssize_t K);
/* NULL when w is a packed [N, K] weight, else what is wrong. */
const char *check_pw(const pw_header *w, Py_ssize_t N, Py_ssize_t K);
#if RK_X86
/* Writes W [N, K] (rows ldw floats apart) packed in format fmt to out; 0 when a block format is
 * not exact for it (see quant.c). */
int pack_weight(const float *w, Py_ssize_t N, Py_ssize_t K, Py_ssize_t ldw, int fmt, uint8_t *out);
#endif

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

/* ------------------------------------------------------------------ GEMM (gemm.c) */

/* Which vector kernels run (set once by cpu_ok, changed by set_isa): ISA_AVX512 when the CPU has
 * AVX-512 F/BW/VL and RADIXKV_KERNELS_ISA is not "avx2", else ISA_AVX2. Only the one-row GEMV has
 * an AVX-512 form; every other kernel is AVX2 on both. */
enum { ISA_AVX2 = 1, ISA_AVX512 = 2 };
extern int rk_isa;
extern int rk_has_avx512;
/* 1 when this CPU has AVX2, FMA and F16C (checked once; also chooses rk_isa), else 0. */
int cpu_ok(void);

#if RK_X86
/* Block sums of M rows of x (ldx apart) into xs (K / QB per row); nothing when K % QB. */
void block_sums_rows(const float *x, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, float *xs);
/* x (one row; xs its block sums) against np panels given as refs, on the ISA rk_isa says. */
void gemv_refs(const float *x, const float *xs, Py_ssize_t K, int fmt, const panel_ref *r, int np);
/* C[0:M, panel pi] (+ bias) for one panel of w, M > 1. buf: KC * NR floats, 64-byte aligned. */
void gemm_panel(const float *xrows, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t pi,
                const float *bias, float *cbase, Py_ssize_t ldc, float *buf);
/* Panels [p0, p1) of C = X @ W^T (+ bias): the GEMV for one row, else panel by panel. */
void gemm_range(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t p0,
                Py_ssize_t p1, const float *bias, float *c, Py_ssize_t ldc, float *buf);
/* C[M, N] = X @ W^T (+ bias) on nthreads threads. xs: room for M * K / QB block sums (block
 * formats), else NULL. */
void gemm(const float *x, Py_ssize_t M, Py_ssize_t K, Py_ssize_t ldx, const pw_header *w, Py_ssize_t N,
          const float *bias, float *c, Py_ssize_t ldc, int nthreads, float *xs);
#endif

/* ------------------------------------------------------------------ attention (attention.c) */

/* The element type of the K/V pool tensors ([num_slots, hkv, d]): attention.c's kv_row and
 * kv_load8 are the only code that reads them, kv_store the only code that writes them. */
typedef float kv_elem;

/* dst[0 .. d) = src[0 .. d): one head's new K or V row into the pool. */
static inline void
kv_store(kv_elem *dst, const float *src, int d)
{
    memcpy(dst, src, sizeof(float) * (size_t)d);
}

/* NULL when the attention metadata is in range, else what is wrong (see attention.c). */
const char *check_attn_meta(const int32_t *meta, Py_ssize_t n_req, Py_ssize_t T, const int32_t *kv_indices,
                            Py_ssize_t n_indices, Py_ssize_t page_size, Py_ssize_t num_pages);
#if RK_X86
/* Causal paged attention of a batch on nthreads threads (paged_attention in bindings.c). meta:
 * [4, n_req] int32 (first query row, query count, kv_indptr, KV length) per request. */
void paged_attention(const float *q, Py_ssize_t ldq, const int32_t *meta, Py_ssize_t n_req, const int32_t *kv_indices,
                     Py_ssize_t page_size, const kv_elem *k_cache, const kv_elem *v_cache, int hq, int hkv, int d,
                     float sm_scale, float *out, int nthreads);
/* One chunk of a query row's attention for one KV head: G (<= 64) query heads at q (d apart), n
 * positions in slots[0 .. n), whose K / V rows (that head's part) are at k_base / v_base +
 * slot * row_len. Writes per head h its partial (max, sum, unnormalized weighted sum of V: d
 * floats) at part + h * ldp. scratch: (2 + G) * n floats. */
void attend_chunk(const float *q, int G, const int32_t *slots, Py_ssize_t n, const kv_elem *k_base,
                  const kv_elem *v_base, Py_ssize_t row_len, int d, float sm_scale, float *part, Py_ssize_t ldp,
                  float *scratch);
/* o[0 .. d) = the nc partials at ph (d + 2 floats apart) merged in order (one: attend_row's bits). */
void merge_partials(const float *ph, int nc, int d, float *o);
#endif

/* ------------------------------------------------------------------ elementwise (ops.c) */

#if RK_X86
void add_rms_norm(const float *delta, float *res, float *out, Py_ssize_t M, Py_ssize_t K, const float *w, float eps);
void rope_inplace(float *x, Py_ssize_t T, Py_ssize_t nh, Py_ssize_t d, Py_ssize_t ldx, const float *cos,
                  const float *sin);
void silu_mul(const float *gu, float *out, Py_ssize_t M, Py_ssize_t I);
void silu_cols(const float *gu, float *act, int M, Py_ssize_t I, Py_ssize_t col);
void apply_token_bitmask(float *logits, Py_ssize_t ldl, const int32_t *bitmask, Py_ssize_t ldb, const int64_t *rows,
                         Py_ssize_t n_rows, Py_ssize_t vocab);
#endif

/* ------------------------------------------------------------------ the whole decode step (step.c) */

#define STEP_MAX_ROWS 64

typedef struct {
    int L, H, hq, hkv, d, inter, V;
} step_dims;

typedef struct {
    const float *norm_in, *norm_post;
    float eps_in, eps_post;
    const pw_header *w[4]; /* qkv, o, gate|up, down */
    const float *b[4];
    kv_elem *k_cache, *v_cache; /* [num_slots, hkv, d] */
} layer_plan;

typedef struct step_plan step_plan; /* opaque: the model's addresses and the step's scratch */

/* 1 when dims suit the step (every size >= 1, head_dim a multiple of 8 up to 256, at most 64 query
 * heads per KV head), else 0. */
int step_dims_ok(const step_dims *dm);
/* NULL when layer lp's weights are packed in the shapes dm gives and its addresses are set. */
const char *step_check_layer(const step_dims *dm, const layer_plan *lp);
/* A plan owning a copy of layers[0 .. L); NULL when out of memory. */
step_plan *step_plan_new(const step_dims *dm, const layer_plan *layers, const float *embed, const float *final_norm,
                         float final_eps, const pw_header *lm_head, const int32_t *r2t, Py_ssize_t r2t_rows,
                         Py_ssize_t r2t_cols, Py_ssize_t page_size, Py_ssize_t num_slots, float sm_scale);
void step_plan_free(step_plan *p);
int step_plan_head_dim(const step_plan *p);
void step_plan_set_rope(step_plan *p, const float *cos, const float *sin, Py_ssize_t len);
/* NULL when a batch (T tokens, B requests, S logits rows) reads and writes only inside the plan's
 * buffers, else what is wrong; fills t_row / t_pos (per token row) and lrows. */
const char *step_check_batch(const step_plan *p, const int64_t *tok, Py_ssize_t T, const int64_t *rows,
                             const int64_t *pre, const int64_t *ext, Py_ssize_t B, const int64_t *lr, Py_ssize_t S,
                             int have_logits, int32_t *t_row, int32_t *t_pos, int32_t *lrows);
#if RK_X86
/* One forward pass of a checked batch on up to nthreads threads; 0, or -1 when out of memory. */
int step_run(step_plan *p, const int64_t *tok, int T, const int32_t *t_row, const int32_t *t_pos,
             const int32_t *lrows, int S, float *logits, int nthreads);
#endif

#pragma GCC visibility pop

#endif
