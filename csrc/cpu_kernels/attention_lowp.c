/* Attention's passes over K/V rows stored in the 16- and 8-bit pool dtypes (bfloat16, float16,
 * float8_e4m3fn, float8_e5m2): the one place that reads them (kv_load8 / kv_load16 widen 8 / 16
 * elements of a row to float32, exactly), and the two passes of attention.c that read the pool:
 *
 *   kv_scores_lp   the scores of the G query heads of one KV head over n positions
 *   kv_pv_lp       their weighted sum of V
 *
 * The widening: bfloat16 by a 16-bit shift; float16 by F16C (vcvtph2ps); float8_e5m2 is the top
 * byte of a float16 (a byte shift, then vcvtph2ps); float8_e4m3fn becomes the float16 with the
 * same sign, exponent and mantissa bits ((x & 0x80) << 8 | (x & 0x7F) << 7: as a float16 that is
 * the e4m3 value times 2^-8, subnormals included, exactly; the caller folds the 2^8 into the
 * row's scale). The NaN codes 0x7F / 0xFF would read as +-480; the writer never produces them
 * from finite values.
 *
 * Each pass comes in an AVX2 form and an AVX-512 form (rk_isa chooses; the caller passes it as
 * `wide`) that give the same bits: a score is 16 lane sums added in one fixed tree (see "scores"
 * below), which AVX-512 holds in one register and AVX2 in two; a weighted sum of V is one FMA
 * chain over the positions per output element, which 8- or 16-float registers compute alike. The
 * K rows of 4 (AVX2: 2) positions are widened once, in registers, for up to 3 query heads; a V
 * row once per position for up to 3 query heads. */

#include "internal.h"

#if RK_X86
#define T256 "avx2,fma,f16c"
#define T512 "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

/* Elements e .. e + 8 of a K or V row of dtype dt as float32 (fp8_e4m3: the value times 2^-8). */
__attribute__((target(T256), always_inline)) static inline __m256
kv_load8(const uint8_t *row, Py_ssize_t e, const int dt)
{
    if (dt == KV_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + e));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + e)));
    /* fp8: each byte to the top byte of a 16-bit lane */
    __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(row + e)));
    if (dt == KV_E4M3) /* s eeee mmm -> s 0eeee mmm0000000: shift right 1 keeping the sign, clear bit 14 */
        w = _mm_and_si128(_mm_srai_epi16(w, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(w);
}

/* kv_load8 for 16 elements. */
__attribute__((target(T512), always_inline)) static inline __m512
kv_load16(const uint8_t *row, Py_ssize_t e, const int dt)
{
    if (dt == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + e));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + e)));
    __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + e))), 8);
    if (dt == KV_E4M3)
        w = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(w);
}

/* kv_load16 for elements e .. e + 32, into two registers (fp8: the byte shifts on 32 lanes at once). */
__attribute__((target(T512), always_inline)) static inline void
kv_load32(const uint8_t *row, Py_ssize_t e, const int dt, __m512 *lo, __m512 *hi)
{
    if (dt != KV_E4M3 && dt != KV_E5M2) {
        *lo = kv_load16(row, e, dt);
        *hi = kv_load16(row, e + 16, dt);
        return;
    }
    __m512i w = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + e))), 8);
    if (dt == KV_E4M3)
        w = _mm512_and_si512(_mm512_srai_epi16(w, 1), _mm512_set1_epi16((short)0xBFFF));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
}

/* ------------------------------------------------------------------ scores
 *
 * A score q . k (d floats) is computed as 16 lane sums, lane i summing q[e] k[e] over e = 16 g + i
 * (g = 0, 1, ...: one FMA chain per lane, in order of g; when d % 16 == 8 the last 8 elements
 * join lanes 0-7 only), then those 16 sums are added in one fixed tree: per quarter (lanes 4k ..
 * 4k + 3) ((l0 + l1) + (l2 + l3)), then (Q0 + Q1) + (Q2 + Q3). The AVX-512 form holds the 16
 * lanes in one register (4 positions x <= 3 heads at a time); the AVX2 form in two (2 positions x
 * <= 3 heads), its hadd steps adding the same pairs. */

/* The arguments of kv_scores_lp (see internal.h). */
typedef struct {
    const float *qg;
    int G, d;
    const uint8_t *k_head, *k_pf, *v_pf;
    Py_ssize_t pf_bytes, n, row_len, ldsc;
    const Py_ssize_t *slot;
    float sm_scale;
    const float *ks;
    float *sc;
} scores_args;

/* Prefetches, for the block of cnt positions at p: the K rows KV_PREFETCH positions ahead (to L1)
 * and this block's V rows (to L2), pf_bytes of each from k_pf / v_pf; the first rows at p == 0. */
__attribute__((always_inline)) static inline void
prefetch_block(const scores_args *a, Py_ssize_t p, int cnt, const int dt)
{
    const Py_ssize_t n = a->n, pf = a->pf_bytes;
    const Py_ssize_t j0 = p == 0 ? 0 : p + KV_PREFETCH, j1 = p + KV_PREFETCH + cnt < n ? p + KV_PREFETCH + cnt : n;
    for (Py_ssize_t j = j0; j < j1; j++)
        for (Py_ssize_t b = 0; b < pf; b += 64)
            _mm_prefetch((const char *)kv_row(a->k_pf, a->slot[j], a->row_len, dt) + b, _MM_HINT_T0);
    for (Py_ssize_t j = p; j < p + cnt; j++)
        for (Py_ssize_t b = 0; b < pf; b += 64)
            _mm_prefetch((const char *)kv_row(a->v_pf, a->slot[j], a->row_len, dt) + b, _MM_HINT_T1);
}

/* The K rows of the B positions at p (a tail of cnt < B repeats its last position: its scores are
 * dropped). */
__attribute__((always_inline)) static inline void
block_rows(const scores_args *a, Py_ssize_t p, int cnt, const int B, const uint8_t **kr, const int dt)
{
    for (int j = 0; j < B; j++)
        kr[j] = kv_row(a->k_head, a->slot[p + (j < cnt ? j : cnt - 1)], a->row_len, dt);
}

/* The score factors of the 4 positions at p: ks[p ..] (the tail repeating its last), or sm_scale. */
__attribute__((target(T256), always_inline)) static inline __m128
block_factors(const scores_args *a, Py_ssize_t p, int cnt)
{
    if (!a->ks)
        return _mm_set1_ps(a->sm_scale);
    if (cnt == 4)
        return _mm_loadu_ps(a->ks + p);
    const float *k = a->ks + p;
    return _mm_setr_ps(k[0], k[cnt > 1 ? 1 : 0], k[cnt > 2 ? 2 : cnt - 1], k[cnt - 1]);
}

/* The scores of the query heads [h0, h0 + hc) for a block of B positions, computed into o (ldo
 * apart per head), written to sc (ldsc apart) at p: in place when the block is whole. */
__attribute__((always_inline)) static inline void
copy_tail(const scores_args *a, int h0, int hc, Py_ssize_t p, int cnt, const int B, const float *o)
{
    if (cnt < B)
        for (int h = 0; h < hc; h++)
            for (int j = 0; j < cnt; j++)
                a->sc[(Py_ssize_t)(h0 + h) * a->ldsc + p + j] = o[h * B + j];
}

/* AVX-512: per 128-bit lane [x0 + x1, x2 + x3, y0 + y1, y2 + y3] (what vhaddps does per lane). */
__attribute__((target(T512), always_inline)) static inline __m512
hadd512(__m512 x, __m512 y)
{
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

/* AVX-512: out[h * ldo + j] = score(q_h, k_j) * sv[j] for hc (1..3) heads at qg (d apart) and the
 * 4 positions whose K rows are kr[0 .. 4) (see the tree above). */
__attribute__((target(T512), always_inline)) static inline void
qk4_512(const int hc, const float *qg, const uint8_t *const kr[4], int d, __m128 s, float *out, Py_ssize_t ldo,
        const int dt)
{
    __m512 acc[3][4];
    for (int h = 0; h < hc; h++)
        for (int j = 0; j < 4; j++)
            acc[h][j] = _mm512_setzero_ps();
    int e = 0;
    for (; e + 32 <= d; e += 32) { /* two 16-float groups: fp8 widened 32 at a time */
        __m512 k0[4], k1[4];
        for (int j = 0; j < 4; j++)
            kv_load32(kr[j], e, dt, &k0[j], &k1[j]);
        for (int h = 0; h < hc; h++) {
            __m512 qv = _mm512_loadu_ps(qg + (Py_ssize_t)h * d + e);
            for (int j = 0; j < 4; j++)
                acc[h][j] = _mm512_fmadd_ps(qv, k0[j], acc[h][j]);
        }
        for (int h = 0; h < hc; h++) {
            __m512 qv = _mm512_loadu_ps(qg + (Py_ssize_t)h * d + e + 16);
            for (int j = 0; j < 4; j++)
                acc[h][j] = _mm512_fmadd_ps(qv, k1[j], acc[h][j]);
        }
    }
    for (; e + 16 <= d; e += 16) {
        __m512 k[4];
        for (int j = 0; j < 4; j++)
            k[j] = kv_load16(kr[j], e, dt);
        for (int h = 0; h < hc; h++) {
            __m512 qv = _mm512_loadu_ps(qg + (Py_ssize_t)h * d + e);
            for (int j = 0; j < 4; j++)
                acc[h][j] = _mm512_fmadd_ps(qv, k[j], acc[h][j]);
        }
    }
    if (e < d) { /* the last 8: lanes 0-7 */
        __m512 k[4];
        for (int j = 0; j < 4; j++)
            k[j] = _mm512_zextps256_ps512(kv_load8(kr[j], e, dt));
        for (int h = 0; h < hc; h++) {
            __m512 qv = _mm512_maskz_loadu_ps(0x00FF, qg + (Py_ssize_t)h * d + e);
            for (int j = 0; j < 4; j++)
                acc[h][j] = _mm512_mask3_fmadd_ps(qv, k[j], acc[h][j], 0x00FF);
        }
    }
    for (int h = 0; h < hc; h++) {
        __m512 y = hadd512(hadd512(acc[h][0], acc[h][1]), hadd512(acc[h][2], acc[h][3]));
        y = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, 0xB1)); /* quarters (0 + 1), (2 + 3) */
        __m128 r = _mm_add_ps(_mm512_castps512_ps128(y), _mm512_extractf32x4_ps(y, 2));
        _mm_storeu_ps(out + (Py_ssize_t)h * ldo, _mm_mul_ps(r, s));
    }
}

/* AVX2: qk4_512 for 2 positions, each position's 16 lanes in two registers (lanes 0-7, 8-15). */
__attribute__((target(T256), always_inline)) static inline void
qk2_256(const int hc, const float *qg, const uint8_t *const kr[2], int d, __m128 s, float *out, Py_ssize_t ldo,
        const int dt)
{
    __m256 lo[3][2], hi[3][2];
    for (int h = 0; h < hc; h++)
        for (int j = 0; j < 2; j++)
            lo[h][j] = hi[h][j] = _mm256_setzero_ps();
    int e = 0;
    for (; e + 16 <= d; e += 16) {
        __m256 kl[2], kh[2];
        for (int j = 0; j < 2; j++) {
            kl[j] = kv_load8(kr[j], e, dt);
            kh[j] = kv_load8(kr[j], e + 8, dt);
        }
        for (int h = 0; h < hc; h++) {
            const float *qh = qg + (Py_ssize_t)h * d + e;
            __m256 ql = _mm256_loadu_ps(qh), qhi = _mm256_loadu_ps(qh + 8);
            for (int j = 0; j < 2; j++) {
                lo[h][j] = _mm256_fmadd_ps(ql, kl[j], lo[h][j]);
                hi[h][j] = _mm256_fmadd_ps(qhi, kh[j], hi[h][j]);
            }
        }
    }
    if (e < d) /* the last 8: lanes 0-7 */
        for (int j = 0; j < 2; j++) {
            __m256 k = kv_load8(kr[j], e, dt);
            for (int h = 0; h < hc; h++)
                lo[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + (Py_ssize_t)h * d + e), k, lo[h][j]);
        }
    for (int h = 0; h < hc; h++) {
        /* per 128-bit lane, pairs then quarters: [S0(k0), S0(k1), S2(k0), S2(k1) | S1 .., S3 ..] */
        __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(lo[h][0], lo[h][1]), _mm256_hadd_ps(hi[h][0], hi[h][1]));
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1)); /* S0+S1, S2+S3 */
        r = _mm_mul_ps(_mm_add_ps(r, _mm_movehl_ps(r, r)), s);
        out[(Py_ssize_t)h * ldo] = _mm_cvtss_f32(r);
        out[(Py_ssize_t)h * ldo + 1] = _mm_cvtss_f32(_mm_movehdup_ps(r));
    }
}

/* kv_scores_lp's AVX-512 form for dtype dt: blocks of 4 positions, heads by blocks of <= 3. */
__attribute__((target(T512), always_inline)) static inline void
scores_dt512(const scores_args *a, const int dt)
{
    for (Py_ssize_t p = 0; p < a->n; p += 4) {
        const int cnt = a->n - p < 4 ? (int)(a->n - p) : 4;
        prefetch_block(a, p, cnt, dt);
        const uint8_t *kr[4];
        float tail[3 * 4];
        block_rows(a, p, cnt, 4, kr, dt);
        const __m128 sv = block_factors(a, p, cnt);
        for (int h0 = 0; h0 < a->G; h0 += 3) {
            const int hc = a->G - h0 < 3 ? a->G - h0 : 3;
            const float *qh = a->qg + (Py_ssize_t)h0 * a->d;
            float *o = cnt == 4 ? a->sc + (Py_ssize_t)h0 * a->ldsc + p : tail;
            const Py_ssize_t ldo = cnt == 4 ? a->ldsc : 4;
            if (hc == 3)
                qk4_512(3, qh, kr, a->d, sv, o, ldo, dt);
            else if (hc == 2)
                qk4_512(2, qh, kr, a->d, sv, o, ldo, dt);
            else
                qk4_512(1, qh, kr, a->d, sv, o, ldo, dt);
            copy_tail(a, h0, hc, p, cnt, 4, tail);
        }
    }
}

/* kv_scores_lp's AVX2 form for dtype dt: blocks of 2 positions, heads by blocks of <= 3. */
__attribute__((target(T256), always_inline)) static inline void
scores_dt256(const scores_args *a, const int dt)
{
    for (Py_ssize_t p = 0; p < a->n; p += 2) {
        const int cnt = a->n - p < 2 ? (int)(a->n - p) : 2;
        prefetch_block(a, p, cnt, dt);
        const uint8_t *kr[2];
        float tail[3 * 2];
        block_rows(a, p, cnt, 2, kr, dt);
        const __m128 sv = block_factors(a, p, cnt); /* lanes 0, 1: this block's (cnt 1: both the one) */
        for (int h0 = 0; h0 < a->G; h0 += 3) {
            const int hc = a->G - h0 < 3 ? a->G - h0 : 3;
            const float *qh = a->qg + (Py_ssize_t)h0 * a->d;
            float *o = cnt == 2 ? a->sc + (Py_ssize_t)h0 * a->ldsc + p : tail;
            const Py_ssize_t ldo = cnt == 2 ? a->ldsc : 2;
            if (hc == 3)
                qk2_256(3, qh, kr, a->d, sv, o, ldo, dt);
            else if (hc == 2)
                qk2_256(2, qh, kr, a->d, sv, o, ldo, dt);
            else
                qk2_256(1, qh, kr, a->d, sv, o, ldo, dt);
            copy_tail(a, h0, hc, p, cnt, 2, tail);
        }
    }
}

#define DISPATCH_DT(dt, CALL)                                                                                        \
    switch (dt) {                                                                                                    \
    case KV_BF16: CALL(KV_BF16); break;                                                                              \
    case KV_F16: CALL(KV_F16); break;                                                                                \
    case KV_E4M3: CALL(KV_E4M3); break;                                                                              \
    case KV_E5M2: CALL(KV_E5M2); break;                                                                              \
    }

__attribute__((target(T256))) static void
scores256(const scores_args *a, int dt)
{
#define CALL(DT) scores_dt256(a, DT)
    DISPATCH_DT(dt, CALL)
#undef CALL
}

__attribute__((target(T512))) static void
scores512(const scores_args *a, int dt)
{
#define CALL(DT) scores_dt512(a, DT)
    DISPATCH_DT(dt, CALL)
#undef CALL
}

void
kv_scores_lp(int wide, int dt, const float *qg, int G, const uint8_t *k_head, const uint8_t *k_pf,
             const uint8_t *v_pf, Py_ssize_t pf_bytes, const Py_ssize_t *slot, Py_ssize_t n, Py_ssize_t row_len, int d,
             float sm_scale, const float *ks, float *sc, Py_ssize_t ldsc)
{
    const scores_args a = {qg, G, d, k_head, k_pf, v_pf, pf_bytes, n, row_len, ldsc, slot, sm_scale, ks, sc};
    if (wide)
        scores512(&a, dt);
    else
        scores256(&a, dt);
}

/* ------------------------------------------------------------------ the weighted sum of V */

/* out[i * ldo + 8c ...] = inv[i] * sum_p w[i * n + p] v_p[8c ...] for i < hc, c < nc: hc * nc
 * accumulators in registers over all positions (AVX2: at most 3 x 3 with the widening's
 * constants, no spill). Inlined with constant hc, nc and dtype dt. */
__attribute__((target(T256), always_inline)) static inline void
pv_block8(const int hc, const int nc, const uint8_t *v_base, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n,
          const float *w, Py_ssize_t ldw, const float *inv, float *out, Py_ssize_t ldo, const int dt)
{
    __m256 acc[3][4];
    for (int i = 0; i < hc; i++)
        for (int c = 0; c < nc; c++)
            acc[i][c] = _mm256_setzero_ps();
    for (Py_ssize_t p = 0; p < n; p++) {
        const uint8_t *vp = kv_row(v_base, slot[p], row_len, dt);
        __m256 wv[3];
        for (int i = 0; i < hc; i++)
            wv[i] = _mm256_broadcast_ss(w + i * ldw + p);
        for (int c = 0; c < nc; c++) {
            __m256 vv = kv_load8(vp, 8 * c, dt);
            for (int i = 0; i < hc; i++)
                acc[i][c] = _mm256_fmadd_ps(wv[i], vv, acc[i][c]);
        }
    }
    for (int i = 0; i < hc; i++) {
        __m256 sv = _mm256_set1_ps(inv[i]);
        for (int c = 0; c < nc; c++)
            _mm256_storeu_ps(out + i * ldo + 8 * c, _mm256_mul_ps(sv, acc[i][c]));
    }
}

/* pv_block8 with 16-float chunks (AVX-512: at most 3 heads x 4 chunks = 64 dims). */
__attribute__((target(T512), always_inline)) static inline void
pv_block16(const int hc, const int nc, const uint8_t *v_base, const Py_ssize_t *slot, Py_ssize_t row_len,
           Py_ssize_t n, const float *w, Py_ssize_t ldw, const float *inv, float *out, Py_ssize_t ldo, const int dt)
{
    __m512 acc[3][4];
    for (int i = 0; i < hc; i++)
        for (int c = 0; c < nc; c++)
            acc[i][c] = _mm512_setzero_ps();
    for (Py_ssize_t p = 0; p < n; p++) {
        const uint8_t *vp = kv_row(v_base, slot[p], row_len, dt);
        __m512 wv[3];
        for (int i = 0; i < hc; i++)
            wv[i] = _mm512_set1_ps(w[i * ldw + p]);
        int c = 0;
        for (; c + 2 <= nc; c += 2) {
            __m512 v0, v1;
            kv_load32(vp, 16 * c, dt, &v0, &v1);
            for (int i = 0; i < hc; i++) {
                acc[i][c] = _mm512_fmadd_ps(wv[i], v0, acc[i][c]);
                acc[i][c + 1] = _mm512_fmadd_ps(wv[i], v1, acc[i][c + 1]);
            }
        }
        if (c < nc) {
            __m512 vv = kv_load16(vp, 16 * c, dt);
            for (int i = 0; i < hc; i++)
                acc[i][c] = _mm512_fmadd_ps(wv[i], vv, acc[i][c]);
        }
    }
    for (int i = 0; i < hc; i++) {
        __m512 sv = _mm512_set1_ps(inv[i]);
        for (int c = 0; c < nc; c++)
            _mm512_storeu_ps(out + i * ldo + 16 * c, _mm512_mul_ps(sv, acc[i][c]));
    }
}

/* The arguments of kv_pv_lp (see internal.h). */
typedef struct {
    int nh, d;
    const uint8_t *v_head;
    const Py_ssize_t *slot;
    Py_ssize_t row_len, n, ldw, ldo;
    const float *w, *inv;
    float *out;
} pv_args;

/* kv_pv_lp's AVX2 form for dtype dt: blocks of <= 3 heads x <= 24 dims. */
__attribute__((target(T256), always_inline)) static inline void
pv_dt8(const pv_args *a, const int dt)
{
    for (int h0 = 0; h0 < a->nh; h0 += 3) {
        const int hc = a->nh - h0 < 3 ? a->nh - h0 : 3;
        for (int e0 = 0; e0 < a->d; e0 += 24) {
            const int nc = (a->d - e0) / 8 < 3 ? (a->d - e0) / 8 : 3;
            const float *wh = a->w + (Py_ssize_t)h0 * a->ldw;
            float *o = a->out + (Py_ssize_t)h0 * a->ldo + e0;
            const uint8_t *vbe = a->v_head + (Py_ssize_t)e0 * kv_elem_size(dt);
            switch (hc * 4 + nc) {
#define PV(HC, NC)                                                                                                   \
    case HC * 4 + NC: pv_block8(HC, NC, vbe, a->slot, a->row_len, a->n, wh, a->ldw, a->inv + h0, o, a->ldo, dt); break;
                PV(1, 1) PV(1, 2) PV(1, 3) PV(2, 1) PV(2, 2) PV(2, 3) PV(3, 1) PV(3, 2) PV(3, 3)
#undef PV
            }
        }
    }
}

/* kv_pv_lp's AVX-512 form: blocks of <= 3 heads x <= 64 dims, a last 8 dims (d % 16) as in pv_dt8. */
__attribute__((target(T512), always_inline)) static inline void
pv_dt16(const pv_args *a, const int dt)
{
    for (int h0 = 0; h0 < a->nh; h0 += 3) {
        const int hc = a->nh - h0 < 3 ? a->nh - h0 : 3;
        const float *wh = a->w + (Py_ssize_t)h0 * a->ldw;
        for (int e0 = 0; e0 < a->d; e0 += 64) {
            const int nc = (a->d - e0) / 16 < 4 ? (a->d - e0) / 16 : 4;
            float *o = a->out + (Py_ssize_t)h0 * a->ldo + e0;
            const uint8_t *vbe = a->v_head + (Py_ssize_t)e0 * kv_elem_size(dt);
            switch (hc * 8 + nc) {
#define PV(HC, NC)                                                                                                   \
    case HC * 8 + NC: pv_block16(HC, NC, vbe, a->slot, a->row_len, a->n, wh, a->ldw, a->inv + h0, o, a->ldo, dt); break;
                PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
                PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4)
#undef PV
            }
        }
        if (a->d % 16) { /* the last 8 dims */
            const int e0 = a->d - 8;
            float *o = a->out + (Py_ssize_t)h0 * a->ldo + e0;
            const uint8_t *vbe = a->v_head + (Py_ssize_t)e0 * kv_elem_size(dt);
            if (hc == 3)
                pv_block8(3, 1, vbe, a->slot, a->row_len, a->n, wh, a->ldw, a->inv + h0, o, a->ldo, dt);
            else if (hc == 2)
                pv_block8(2, 1, vbe, a->slot, a->row_len, a->n, wh, a->ldw, a->inv + h0, o, a->ldo, dt);
            else
                pv_block8(1, 1, vbe, a->slot, a->row_len, a->n, wh, a->ldw, a->inv + h0, o, a->ldo, dt);
        }
    }
}

__attribute__((target(T256))) static void
pv256(const pv_args *a, int dt)
{
#define CALL(DT) pv_dt8(a, DT)
    DISPATCH_DT(dt, CALL)
#undef CALL
}

__attribute__((target(T512))) static void
pv512(const pv_args *a, int dt)
{
#define CALL(DT) pv_dt16(a, DT)
    DISPATCH_DT(dt, CALL)
#undef CALL
}

void
kv_pv_lp(int wide, int dt, int nh, const uint8_t *v_head, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n,
         const float *w, Py_ssize_t ldw, const float *inv, float *out, Py_ssize_t ldo, int d)
{
    const pv_args a = {nh, d, v_head, slot, row_len, n, ldw, ldo, w, inv, out};
    if (wide)
        pv512(&a, dt);
    else
        pv256(&a, dt);
}
#endif
