/* The small-M GEMM on AVX-512: C[0:M, panels] = X[0:M] @ W^T (+ bias) for a few rows (a verify
 * forward's k + 1 rows of one request, a decode batch) with each weight block read and decoded ONCE
 * for all M rows.
 *
 * At M = 1 the GEMV (gemm.c) reads each packed block, decodes its q in registers and FMAs it into
 * one row; the micro-kernel of gemm.c (M > 1, AVX2) decodes a block into an L1 buffer and runs 8
 * columns per FMA. Here a group of up to SM_P panels is decoded in 512-bit registers (16 columns a
 * register, as the AVX-512 GEMV) and every decoded register is FMA'd into the accumulators of every
 * row of a group of up to SM_ROWS rows (x broadcast from memory): one decode per 16 weights for all
 * rows, one FMA per 16 weights and row, so a verify forward of k + 1 rows costs the weight stream
 * once plus (k + 1) x the FMAs.
 *
 * Bits: every output (row, column) is the same sequence of float32 operations as in the GEMV and
 * the micro-kernel (gemm.c's "factored sum" for the block formats: per block of 32 k a fresh FMA
 * chain t over k in order, then y = fma(t, d, y) (+ fma(S, m, y) for Q4_1); float32 panels one FMA
 * chain over k; bias added last). Lanes are columns and rows are separate accumulators, so neither
 * the row count, the row group, the panel group, the thread count nor the ISA changes a bit of any
 * row: a row computed with M - 1 others is the row computed alone (tests/test_verify_rows.py,
 * tests/test_decode_step.py). */
#include "internal.h"

#if RK_X86

#define SM_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#ifndef SM_PF
#define SM_PF 8 /* blocks ahead that each panel prefetches (as the AVX-512 GEMV) */
#endif

/* Panels per group for a row group of m rows: 2 m P accumulators (t and y) of the 32 registers. */
static inline int
sm_panels(int m)
{
    return m <= 3 ? 4 : m <= 6 ? 2 : 1;
}

/* 16 floats of a panel (nv real) from accumulator a (+ bias) into c. */
__attribute__((target(SM_TARGET), always_inline)) static inline void
sm_store(__m512 a, const float *bias, float *c, int nv)
{
    const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
    if (bias)
        a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mk, bias));
    _mm512_mask_storeu_ps(c, mk, a);
}

/* Q4_1 lanes: lane L holds column SM_LANE_COL[L] of the panel (not L), so that a step's 8 bytes
 * decode in two vector ops: broadcast as a qword (a load), its even dwords are bytes 0-3 (columns
 * 0-3 low nibbles, 8-11 high), its odd ones bytes 4-7 (columns 4-7, 12-15); a per-lane shift
 * (SM_Q4_SHIFT) brings lane L's nibble to the low 4 bits, and vpermps (which reads only those) turns
 * it into a float. Per-lane arithmetic is unchanged, so the bits are the GEMV's; the block scales
 * are permuted into lane order once per block and the sums back into column order once per output. */
static const int32_t SM_LANE_COL[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
static const int32_t SM_COL_LANE[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
static const int32_t SM_Q4_SHIFT[16] = {0, 0, 8, 8, 16, 16, 24, 24, 4, 4, 12, 12, 20, 20, 28, 28};

/* q of step k of a block-format group at gp (Q4_1: 8 bytes of nibbles, low nibbles columns 0-7,
 * high 8-15, as 16 float32 in SM_LANE_COL's lane order; Q8_0: 16 int8, in column order). */
__attribute__((target(SM_TARGET), always_inline)) static inline __m512
sm_q(const int fmt, const uint8_t *qs, int k, __m512i sh, __m512 qtab)
{
    if (fmt == PW_Q4_1) {
        long long b;
        memcpy(&b, qs + 8 * k, 8);
        __m512i q = _mm512_srlv_epi32(_mm512_set1_epi64(b), sh);
        return _mm512_permutexvar_ps(q, qtab); /* vpermps reads the low 4 bits of each index */
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * k))));
}

/* Rows [0, M) of x (ldx apart; xs their block sums, ldxs apart) against the P panels r[0 .. P) of a
 * block format fmt (K deep), into r[j].c + i * ldc. M, P and fmt are constants where inlined. */
__attribute__((target(SM_TARGET), always_inline)) static inline void
sm_block(const int M, const int P, const int fmt, const float *x, Py_ssize_t ldx, const float *xs, Py_ssize_t ldxs,
         Py_ssize_t K, const panel_ref *r, Py_ssize_t ldc)
{
    const Py_ssize_t group = fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP, qoff = fmt == PW_Q4_1 ? 64 : 32;
    const __m512i sh = _mm512_loadu_si512(SM_Q4_SHIFT);
    const __m512i lane_col = _mm512_loadu_si512(SM_LANE_COL), col_lane = _mm512_loadu_si512(SM_COL_LANE);
    const __m512 qtab = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 y[SM_ROWS][4];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            y[i][j] = _mm512_setzero_ps();
    for (Py_ssize_t g0 = 0, b = 0; g0 < K; g0 += QB, b++) {
        const uint8_t *gp[4];
#pragma GCC unroll 4
        for (int j = 0; j < P; j++) {
            gp[j] = r[j].pan + b * group;
            for (int off = 0; off < group; off += 64)
                _mm_prefetch((const char *)(gp[j] + SM_PF * group + off), _MM_HINT_T0);
        }
        __m512 t[SM_ROWS][4];
#pragma GCC unroll 8
        for (int i = 0; i < M; i++)
#pragma GCC unroll 4
            for (int j = 0; j < P; j++)
                t[i][j] = _mm512_setzero_ps();
        const float *xk = x + g0;
        for (int k = 0; k < QB; k++) {
            __m512 q[4];
#pragma GCC unroll 4
            for (int j = 0; j < P; j++)
                q[j] = sm_q(fmt, gp[j] + qoff, k, sh, qtab);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const __m512 xb = _mm512_set1_ps(xk[i * ldx + k]);
#pragma GCC unroll 4
                for (int j = 0; j < P; j++)
                    t[i][j] = _mm512_fmadd_ps(xb, q[j], t[i][j]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < P; j++) {
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp[j]));
            __m512 m = _mm512_setzero_ps();
            if (fmt == PW_Q4_1) {
                d = _mm512_permutexvar_ps(lane_col, d);
                m = _mm512_permutexvar_ps(lane_col, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp[j] + 32))));
            }
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                y[i][j] = _mm512_fmadd_ps(t[i][j], d, y[i][j]);
                if (fmt == PW_Q4_1)
                    y[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * ldxs + b]), m, y[i][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            sm_store(fmt == PW_Q4_1 ? _mm512_permutexvar_ps(col_lane, y[i][j]) : y[i][j], r[j].bias, r[j].c + i * ldc,
                     r[j].nv);
}

/* The same for float32 panels: one FMA chain over k per output. */
__attribute__((target(SM_TARGET), always_inline)) static inline void
sm_f32(const int M, const int P, const float *x, Py_ssize_t ldx, Py_ssize_t K, const panel_ref *r, Py_ssize_t ldc)
{
    __m512 t[SM_ROWS][4];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            t[i][j] = _mm512_setzero_ps();
    for (Py_ssize_t k = 0; k < K; k++) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int j = 0; j < P; j++) {
            const float *wp = (const float *)r[j].pan + k * NR;
            _mm_prefetch((const char *)(wp + 64 * NR), _MM_HINT_T0);
            w[j] = _mm512_loadu_ps(wp);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
            for (int j = 0; j < P; j++)
                t[i][j] = _mm512_fmadd_ps(xb, w[j], t[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            sm_store(t[i][j], r[j].bias, r[j].c + i * ldc, r[j].nv);
}

/* One (row group, panel group) with constants M (2 .. SM_ROWS) and P (1 or sm_panels(M)). */
#define SM_CASE(M_, P_)                                                                                     \
    case (M_) * 8 + (P_):                                                                                   \
        if (fmt == PW_Q4_1)                                                                                 \
            sm_block(M_, P_, PW_Q4_1, x, ldx, xs, ldxs, K, r, ldc);                                          \
        else if (fmt == PW_Q8_0)                                                                            \
            sm_block(M_, P_, PW_Q8_0, x, ldx, xs, ldxs, K, r, ldc);                                          \
        else                                                                                                \
            sm_f32(M_, P_, x, ldx, K, r, ldc);                                                              \
        break;

__attribute__((target(SM_TARGET))) static void
sm_dispatch(int m, int p, int fmt, const float *x, Py_ssize_t ldx, const float *xs, Py_ssize_t ldxs, Py_ssize_t K,
            const panel_ref *r, Py_ssize_t ldc)
{
    switch (m * 8 + p) {
        SM_CASE(1, 4) SM_CASE(1, 2) SM_CASE(1, 1)
        SM_CASE(2, 4) SM_CASE(2, 2) SM_CASE(2, 1)
        SM_CASE(3, 4) SM_CASE(3, 2) SM_CASE(3, 1)
        SM_CASE(4, 2) SM_CASE(4, 1)
        SM_CASE(5, 2) SM_CASE(5, 1)
        SM_CASE(6, 2) SM_CASE(6, 1)
        SM_CASE(7, 1)
        SM_CASE(8, 1)
    default: abort(); /* unreachable: m and p come from sm_group_rows / sm_panels */
    }
}
#undef SM_CASE

/* Rows [0, M) of x against the np panels r[0 .. np) (any counts; xs: the rows' block sums, K / QB a
 * row), on AVX-512: rows in groups of at most SM_ROWS, panels in groups of sm_panels. */
void
gemm_small_refs(const float *x, const float *xs, Py_ssize_t M, Py_ssize_t ldx, Py_ssize_t K, int fmt,
                const panel_ref *r, int np, Py_ssize_t ldc)
{
    const Py_ssize_t ldxs = K / QB, groups = (M + SM_ROWS - 1) / SM_ROWS; /* rows split evenly */
    for (int j0 = 0; j0 < np;) {
        int p = sm_panels((int)((M + groups - 1) / groups));
        while (p > np - j0)
            p /= 2;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const Py_ssize_t i0 = g * M / groups;
            const int m = (int)((g + 1) * M / groups - i0);
            const int pm = p < sm_panels(m) ? p : sm_panels(m); /* 1, 2 or 4: divides p */
            for (int j = j0; j < j0 + p; j += pm) {
                panel_ref rr[4];
                for (int u = 0; u < pm; u++) {
                    rr[u] = r[j + u];
                    rr[u].c += i0 * ldc;
                }
                sm_dispatch(m, pm, fmt, x + i0 * ldx, ldx, xs ? xs + i0 * ldxs : NULL, ldxs, K, rr, ldc);
            }
        }
        j0 += p;
    }
}
#endif
