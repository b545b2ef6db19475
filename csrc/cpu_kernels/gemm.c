/* Packed-weight GEMM, C[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]), on the panels pack_weight writes
 * (quant.c): the register-blocked micro-kernel of Goto & van de Geijn (2008) / BLIS (Van Zee & van
 * de Geijn 2015) for M > 1, the one-row GEMV (AVX2 and AVX-512) for M = 1, the same bits on both,
 * and the CPU feature check that chooses between them (cpu_ok). */
#include "internal.h"

int rk_isa = ISA_AVX2;
int rk_has_avx512 = 0;

int
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

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef PF_BLOCKS
#define PF_BLOCKS 2 /* blocks ahead that are prefetched */
#endif

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
void
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
void
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

/* C[0:M, panel r] (+ bias) for one panel, M > 1 (one row takes gemv_refs): the micro-kernel over
 * 128-row blocks (see gemm_task). xs: the rows' block sums (K / QB a row; block formats). buf: KC *
 * NR floats, 64-byte aligned. */
__attribute__((target("avx2,fma,f16c"))) static void
gemm_panel_ref(const float *xrows, const float *xs, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, int fmt,
               const panel_ref *r, Py_ssize_t ldc, float *buf)
{
    const Py_ssize_t nb = K / QB;
    const Py_ssize_t group = fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP;
    const uint8_t *panel = r->pan;
    const float *bias = r->bias;
    const int nv = r->nv;
    for (Py_ssize_t k0 = 0; k0 < K; k0 += KC) {
        Py_ssize_t kc = K - k0 < KC ? K - k0 : KC;
        if (fmt == PW_F32) {
            const float *bb = bias && k0 + kc >= K ? bias : NULL;
            const float *wp = (const float *)panel + k0 * NR;
            const float *pf = wp + PF_BLOCKS * KC * NR; /* may run past the end: prefetch never faults */
            for (Py_ssize_t m0 = 0; m0 < M; m0 += MR) {
                Py_ssize_t mr = M - m0 < MR ? M - m0 : MR;
                const float *x = xrows + m0 * ldx + k0;
                float *c = r->c + m0 * ldc;
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
            float *c = r->c + m0 * ldc;
            for (Py_ssize_t b = 0; b < kc / QB; b++) {
                const uint8_t *gb = g + b * group;
                const Py_ssize_t kb = k0 + b * QB;
                const float *x = xrows + m0 * ldx + kb, *qb = buf + b * QB * NR, *s = xs + m0 * nb + kb / QB;
                const float *bb = bias && kb + QB >= K ? bias : NULL;
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

/* The micro-kernel for panel pi of w. */
void
gemm_panel(const float *xrows, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t pi,
           const float *bias, float *cbase, Py_ssize_t ldc, float *buf)
{
    const panel_ref r = panel_at(w, pi, bias, cbase);
    gemm_panel_ref(xrows, xs, M, ldx, w->k, (int)w->fmt, &r, ldc, buf);
}

/* The path for M rows (internal.h): one row the GEMV, AVX-512 the small-M GEMM, else the micro-kernel. */
void
gemm_refs(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, int fmt, const panel_ref *r,
          int np, Py_ssize_t ldc, float *buf)
{
    if (M == 1)
        gemv_refs(x, xs, K, fmt, r, np);
    else if (rk_isa == ISA_AVX512)
        gemm_small_refs(x, xs, M, ldx, K, fmt, r, np, ldc);
    else
        for (int j = 0; j < np; j++)
            gemm_panel_ref(x, xs, M, ldx, K, fmt, &r[j], ldc, buf);
}

/* Panels [p0, p1) of C = X @ W^T (+ bias), 8 at a time through gemm_refs. xs: the rows' block sums
 * (block_sums_rows; read only for the block formats). */
void
gemm_range(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, const pw_header *w, Py_ssize_t p0,
           Py_ssize_t p1, const float *bias, float *c, Py_ssize_t ldc, float *buf)
{
    panel_ref r[8];
    for (Py_ssize_t pi = p0; pi < p1;) {
        int np = 0;
        for (; np < 8 && pi < p1; np++, pi++)
            r[np] = panel_at(w, pi, bias, c);
        gemm_refs(x, xs, M, ldx, w->k, (int)w->fmt, r, np, ldc, buf);
    }
}

/* Panels are taken in shrinking chunks (take_chunk). Within a panel, K is walked in blocks of KC
 * rows (KC * 64 bytes of float32, L1-resident) and every row block of X passes over a block
 * before the next is read: the weight stream from memory then advances at a steady pace with all
 * M rows' work, and each block prefetches the block PF_BLOCKS ahead in the (contiguous) packed
 * weight stream. A quantized block is first decoded into a float32 block on the stack. One row
 * (M = 1) takes the GEMV instead, and on AVX-512 every M the small-M GEMM (gemm_small.c; both the
 * same bits); those take panels in groups of up to 4, so chunks are whole groups. */
__attribute__((target("avx2,fma,f16c"))) static void
gemm_task(void *p, int tid, int nthreads)
{
    gemm_args *a = (gemm_args *)p;
    const Py_ssize_t panels = (a->N + NR - 1) / NR;
    float buf[KC * NR] __attribute__((aligned(64)));
    Py_ssize_t p0, p1;
    const Py_ssize_t align = a->M == 1 || rk_isa == ISA_AVX512 ? 4 : 1;
    while (take_chunk(&a->next, panels, nthreads, align, &p0, &p1))
        gemm_range(a->x, a->xs, a->M, a->ldx, a->w, p0, p1, a->bias, a->c, a->ldc, buf);
}

/* C[M, N] = X @ W^T (+ bias) on nthreads threads (sgemm_packed in bindings.c). xs: room for the rows' block
 * sums (M * K / QB floats) for a block-format w, else NULL. */
void
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
