/* What the parts of radixkv.kernels._ckernels share (one file per concern, linked into one module):
 *
 *   threadpool.c  run_parallel: OpenMP (torch's libgomp) or the pthread pool
 *   gemm.c        packed-weight GEMM: the micro-kernel, the one-row GEMV (AVX2 and AVX-512), the ISA choice
 *   gemm_small.c  the small-M GEMM on AVX-512 (2 .. 64 rows: each weight block decoded once for 8 rows)
 *   quant.c       weight packing: the float32 panels and the lossless Q4_1 / Q8_0 block formats
 *   kvformat.c    the K/V pool's element formats: float32 rows rounded to bf16 / fp16 / fp8 (the one writer)
 *   attention.c   paged attention: the float32 K/V row loader, scores, the one softmax, the weighted sum of V
 *   attention_lowp.c  attention's scores and weighted sum of V over bf16 / fp16 / fp8 K/V rows (their loader)
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
 * AVX-512 F/BW/VL and RADIXKV_KERNELS_ISA is not "avx2", else ISA_AVX2. The one-row GEMV and the
 * attention passes over bf16 / fp16 / fp8 K/V (attention_lowp.c) have AVX-512 forms with the AVX2
 * forms' bits; every other kernel is AVX2 on both. */
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
#define SM_ROWS 8 /* rows of a row group of the small-M GEMM */
/* Rows [0, M) of x (ldx apart; xs their block sums, K / QB a row, block formats only) against np
 * panels given as refs (row i of panel j into r[j].c + i * ldc), on AVX-512 (gemm_small.c): the
 * GEMV's and the micro-kernel's bits, each weight block decoded once per group of SM_ROWS rows. */
void gemm_small_refs(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, int fmt,
                     const panel_ref *r, int np, Py_ssize_t ldc);
/* Rows [0, M) of x against np panels given as refs, on the path the ISA and M choose (the GEMV for
 * one row, the small-M GEMM on AVX-512, else the micro-kernel panel by panel: the same bits on
 * all). buf: KC * NR floats, 64-byte aligned (the micro-kernel's). */
void gemm_refs(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, int fmt,
               const panel_ref *r, int np, Py_ssize_t ldc, float *buf);
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

/* ------------------------------------------------------------------ the K/V pool (kvformat.c, attention.c) */

/* The element types of the K/V pool tensors ([num_slots, hkv, d]). The kv_load8 of attention.c
 * (float32) and of attention_lowp.c (the others) are the only code that reads them, kvformat.c's
 * kv_quantize_rows (kv_store for one head) the only code that writes them. fp8 tensors carry one bfloat16 scale per (slot, KV head) ([num_slots, hkv]):
 * the value of element x is fp8(x) * scale. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4, KV_NDTYPES = 5 };

/* Bytes of one element of dtype dt. */
static inline int
kv_elem_size(int dt)
{
    return dt == KV_F32 ? 4 : dt <= KV_F16 ? 2 : 1;
}

/* 1 when dtype dt carries per (slot, head) scales (the fp8 formats). */
static inline int
kv_has_scale(int dt)
{
    return dt >= KV_E4M3;
}

/* The float32 value of a bfloat16 (its bits, widened exactly). */
static inline float
bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One layer's K or V pool tensor: data [num_slots, hkv, d] elements of the pool's dtype, scale
 * [num_slots, hkv] bfloat16 for the fp8 dtypes (else NULL). */
typedef struct {
    void *data;
    uint16_t *scale;
} kv_tensor;

#if RK_X86
/* rows rows of d floats (d a multiple of 8) at x, written in dtype dt: q gets rows * d elements,
 * scale (fp8 only) one bfloat16 per row. The rounding (the contract of radixkv/kernels/cpu.py's
 * kv_quantize): float32 copied; bfloat16 and float16 round to nearest even; fp8 per row scale =
 * the bfloat16 ceiling of amax / FP8_MAX (1 for an all-zero row), then x / scale rounded to nearest
 * even (saturating at FP8_MAX). The same instructions on both ISAs. */
void kv_quantize_rows(int dt, const float *x, Py_ssize_t rows, int d, void *q, uint16_t *scale);

/* One head's new K or V row (d floats at src) into slot `slot`, head h of a pool tensor
 * (kvformat.c). */
void kv_store(const kv_tensor *t, int dt, Py_ssize_t slot, int hkv, int h, const float *src, int d);
#endif

/* The pool as one KV head of the attention sees it: that head's part of slot 0's K and V rows
 * (slot s at + s * row_len elements) and, for fp8, that head's scale of slot 0 (slot s at + s *
 * hkv). g: which head (head 0's unit prefetches whole rows, for the other heads' units). */
typedef struct {
    const uint8_t *k, *v;
    const uint16_t *ks, *vs;
    Py_ssize_t row_len;
    int hkv, dt, g;
} kv_head;

/* Floats of attend_chunk's scratch for n positions and G query heads: slots, scores, fp8 scales. */
static inline Py_ssize_t
attend_chunk_scratch(Py_ssize_t n, int G)
{
    return (4 + (Py_ssize_t)G) * n + 16;
}

#ifndef KV_PREFETCH
#define KV_PREFETCH 24 /* positions ahead whose K rows are prefetched */
#endif
#ifndef LOWP_BLOCK
#define LOWP_BLOCK 256 /* positions per block of a bf16 / fp16 / fp8 row's scores (their rows in L2) */
#endif

/* The row of slot `slot` in a K or V pool tensor of dtype dt ([num_slots, hkv, d]: row_len = hkv *
 * d elements), or of one head's part of it when cache points at that part of slot 0. */
__attribute__((always_inline)) static inline const uint8_t *
kv_row(const uint8_t *cache, Py_ssize_t slot, Py_ssize_t row_len, const int dt)
{
    return cache + slot * row_len * kv_elem_size(dt);
}

#if RK_X86
/* The scores (attention_lowp.c) of the G query heads at qg (d apart) of one KV head, dtype dt
 * (not float32), over n positions slot[0 .. n): sc[h * ldsc + p] = (q_h . k_p) * (ks ? ks[p] :
 * sm_scale). k_head: that head's part of slot 0's K row. Meanwhile the first pf_bytes of each
 * position's K row from k_pf (KV_PREFETCH positions ahead, to L1) and V row from v_pf (to L2) are
 * prefetched (0: none). wide: the AVX-512 form (the same bits). */
void kv_scores_lp(int wide, int dt, const float *qg, int G, const uint8_t *k_head, const uint8_t *k_pf,
                  const uint8_t *v_pf, Py_ssize_t pf_bytes, const Py_ssize_t *slot, Py_ssize_t n, Py_ssize_t row_len,
                  int d, float sm_scale, const float *ks, float *sc, Py_ssize_t ldsc);
/* out[h * ldo .. + d) = inv[h] * sum_p w[h * ldw + p] v_p for the nh query heads of one KV head,
 * dtype dt (not float32), over n positions slot[0 .. n) (v_head: that head's part of slot 0's V
 * row). wide: the AVX-512 form (the same bits). */
void kv_pv_lp(int wide, int dt, int nh, const uint8_t *v_head, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n,
              const float *w, Py_ssize_t ldw, const float *inv, float *out, Py_ssize_t ldo, int d);
#endif

/* NULL when the attention metadata is in range, else what is wrong (see attention.c). */
const char *check_attn_meta(const int32_t *meta, Py_ssize_t n_req, Py_ssize_t T, const int32_t *kv_indices,
                            Py_ssize_t n_indices, Py_ssize_t page_size, Py_ssize_t num_pages);
#if RK_X86
/* Causal paged attention of a batch on nthreads threads (paged_attention in bindings.c). meta:
 * [4, n_req] int32 (first query row, query count, kv_indptr, KV length) per request. k / v: one
 * layer's pool tensors in dtype dt. */
void paged_attention(const float *q, Py_ssize_t ldq, const int32_t *meta, Py_ssize_t n_req, const int32_t *kv_indices,
                     Py_ssize_t page_size, kv_tensor k, kv_tensor v, int dt, int hq, int hkv, int d, float sm_scale,
                     float *out, int nthreads);
/* One chunk of a query row's attention for one KV head: G (<= 64) query heads at q (d apart), n
 * positions in slots[0 .. n) of the pool kv. Writes per head h its partial (max, sum,
 * unnormalized weighted sum of V: d floats) at part + h * ldp. scratch: attend_chunk_scratch(n,
 * G) floats. */
void attend_chunk(const float *q, int G, const int32_t *slots, Py_ssize_t n, const kv_head *kv, int d, float sm_scale,
                  float *part, Py_ssize_t ldp, float *scratch);
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
    int kv_dt; /* the pool's K/V dtype (KV_F32 ...) */
} step_dims;

typedef struct {
    const float *norm_in, *norm_post;
    float eps_in, eps_post;
    const pw_header *w[4]; /* qkv, o, gate|up, down */
    const float *b[4];
    kv_tensor k_cache, v_cache; /* [num_slots, hkv, d] in the plan's K/V dtype (+ fp8 scales) */
} layer_plan;

typedef struct step_plan step_plan; /* opaque: the model's addresses and the step's scratch */

/* 1 when dims suit the step (every size >= 1, head_dim a multiple of 8 up to 256, at most 64 query
 * heads per KV head, a known K/V dtype), else 0. */
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
