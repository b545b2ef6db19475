/* Paged attention over the KV pool: causal, GQA by head groups, softmax in float32 (max
 * subtracted, two passes, not online). Two callers share every piece, so a row gets the same bits
 * from both:
 *
 *   paged_attention   a batch's query rows (prefill and decode on the module path): attend_row
 *   attend_chunk      one chunk of positions of one KV head group, for the fused decode step
 *                     (step.c), whose chunks merge_partials joins
 *
 * The pieces: kv_load8 (the one place that reads a float32 pool: 8 elements of a K or V row),
 * qk8 / qk1 (scores), softmax_weights (the one softmax), pv_heads (the weighted sum of V for the
 * query heads of one KV head).
 *
 * A pool in another dtype (bfloat16, float16, fp8) is read by attention_lowp.c's two passes
 * (kv_scores_lp, kv_pv_lp: K/V widened to float32 in registers, AVX2 or AVX-512 form with the same
 * bits); the softmax between them is this file's. fp8 scales are factored out: a score is
 * (q . k8) * (s_k * 2^8 * sm_scale) (2^8 for e4m3 only: attention_lowp.c reads e4m3 as value
 * times 2^-8), and the weight of V row p is exp(score - max) * s_v * 2^8, applied after the
 * softmax sum is taken. float32 pools take the code below unchanged (the same bits as before the
 * other dtypes existed). */
#include "internal.h"

typedef struct {
    const float *q;
    Py_ssize_t ldq; /* floats between query rows (>= hq * d) */
    const int32_t *q_start, *q_len, *kv_start, *kv_len;
    Py_ssize_t n_req;
    const int32_t *kv_indices;
    Py_ssize_t page_size;
    const uint8_t *k_cache, *v_cache;
    const uint16_t *k_scale, *v_scale; /* fp8: [num_slots, hkv] bfloat16; else NULL */
    int dt;                            /* the pool's dtype (KV_F32 ...) */
    int hq, hkv, d;
    float sm_scale;
    float *out;
    Py_ssize_t units; /* query rows: sum over requests of q_len */
    Py_ssize_t max_kv;
    Py_ssize_t next; /* next untaken unit (atomic) */
} attn_args;

#if RK_X86
/* The row of slot `slot` in a float32 K or V pool tensor ([num_slots, hkv, d]: row_len = hkv * d
 * elements), or of one head's part of it when cache points at that part of slot 0. */
static inline const float *
f32_row(const float *cache, Py_ssize_t slot, Py_ssize_t row_len)
{
    return cache + slot * row_len;
}

/* 8 consecutive elements of a float32 K or V row. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256
kv_load8(const float *p)
{
    return _mm256_loadu_ps(p);
}

/* scores[p0 .. p0 + 8) of one head: q . k over d for 8 positions, reduced with a horizontal-add
 * tree into one register (8 accumulators share each q chunk). */
__attribute__((target("avx2,fma"))) static inline __m256
qk8(const float *qh, const float *const kp[8], int d)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int e = 0; e < d; e += 8) {
        __m256 qv = _mm256_loadu_ps(qh + e);
        a0 = _mm256_fmadd_ps(qv, kv_load8(kp[0] + e), a0);
        a1 = _mm256_fmadd_ps(qv, kv_load8(kp[1] + e), a1);
        a2 = _mm256_fmadd_ps(qv, kv_load8(kp[2] + e), a2);
        a3 = _mm256_fmadd_ps(qv, kv_load8(kp[3] + e), a3);
        a4 = _mm256_fmadd_ps(qv, kv_load8(kp[4] + e), a4);
        a5 = _mm256_fmadd_ps(qv, kv_load8(kp[5] + e), a5);
        a6 = _mm256_fmadd_ps(qv, kv_load8(kp[6] + e), a6);
        a7 = _mm256_fmadd_ps(qv, kv_load8(kp[7] + e), a7);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* q . k over d for one position. */
__attribute__((target("avx2,fma"), always_inline)) static inline float
qk1(const float *qh, const float *kp, int d)
{
    __m256 acc = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), kv_load8(kp + e), acc);
    return hsum256(acc);
}

/* sc[h * n .. + 8) = scale * q_h . k_p for the nh query heads of one KV head (qg: their queries, d
 * apart) and the 8 positions whose K rows (that head's part) kp points at. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
scores8(const float *qg, int nh, const float *const kp[8], int d, __m256 vscale, float *sc, Py_ssize_t n)
{
    for (int h = 0; h < nh; h++)
        _mm256_storeu_ps(sc + (Py_ssize_t)h * n, _mm256_mul_ps(qk8(qg + (Py_ssize_t)h * d, kp, d), vscale));
}

/* sc[h * n] = scale * q_h . k for the nh query heads of one KV head and one position. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
scores1(const float *qg, int nh, const float *kp, int d, float scale, float *sc, Py_ssize_t n)
{
    for (int h = 0; h < nh; h++)
        sc[(Py_ssize_t)h * n] = qk1(qg + (Py_ssize_t)h * d, kp, d) * scale;
}

/* The softmax of one head's scores s[0 .. n) (n >= 1) up to the division: s[p] = exp(s[p] - max)
 * in place. Returns the sum of those weights and the maximum in *mx. The tail past the last 8
 * goes through a padded buffer, so every weight is the same exp256 lane. */
__attribute__((target("avx2,fma"), always_inline)) static inline float
softmax_weights(float *s, Py_ssize_t n, float *mx_out)
{
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
    if (p < n) {
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
    *mx_out = mx;
    return hsum256(vsum);
}

/* out[i * ldo + 8c ...] = inv[i] * sum_p w[i * n + p] v_p[8c ...] for i < hc, c < nc: hc * nc
 * accumulators stay in registers over all positions. Inlined with constant hc, nc. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pv_block(const int hc, const int nc, const float *v_base, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n,
         const float *w, const float *inv, float *out, Py_ssize_t ldo)
{
    __m256 acc[3][4];
    for (int i = 0; i < hc; i++)
        for (int c = 0; c < nc; c++)
            acc[i][c] = _mm256_setzero_ps();
    for (Py_ssize_t p = 0; p < n; p++) {
        const float *vp = f32_row(v_base, slot[p], row_len);
        __m256 wv[3]; /* 12 accumulators + 3 weights + 1 V chunk: all 16 registers, no spill */
        for (int i = 0; i < hc; i++)
            wv[i] = _mm256_broadcast_ss(w + i * n + p);
        for (int c = 0; c < nc; c++) {
            __m256 vv = kv_load8(vp + 8 * c);
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

/* out[h * ldo .. + d) = inv[h] * sum_p w[h * n + p] v_p for the nh query heads of one KV head
 * (v_base: that head's part of slot 0's V row), by blocks of <= 3 query heads x <= 32 dims. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pv_heads(int nh, const float *v_base, const Py_ssize_t *slot, Py_ssize_t row_len, Py_ssize_t n, const float *w,
         const float *inv, float *out, Py_ssize_t ldo, int d)
{
    for (int h0 = 0; h0 < nh; h0 += 3) {
        int hc = nh - h0 < 3 ? nh - h0 : 3;
        for (int e0 = 0; e0 < d; e0 += 32) {
            int nc = (d - e0) / 8 < 4 ? (d - e0) / 8 : 4;
            const float *wh = w + (Py_ssize_t)h0 * n;
            float *o = out + (Py_ssize_t)h0 * ldo + e0;
            const float *vbe = v_base + e0;
            switch (hc * 4 + nc) {
#define PV(HC, NC) case HC * 4 + NC: pv_block(HC, NC, vbe, slot, row_len, n, wh, inv + h0, o, ldo); break;
            PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
            PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4)
#undef PV
            }
        }
    }
}

/* Prefetches the whole rows of positions [j0, j1) of a pool tensor (inlined: hint is a constant). */
__attribute__((always_inline)) static inline void
prefetch_rows(const float *cache, const Py_ssize_t *slot, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t row_len, int hint)
{
    const Py_ssize_t row_bytes = row_len * (Py_ssize_t)sizeof(float);
    for (Py_ssize_t j = j0; j < j1; j++)
        for (Py_ssize_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch((const char *)f32_row(cache, slot[j], row_len) + b, hint);
}

/* fp8: ks[p] = s_k(p) * fold * sm_scale and vs[p] = s_v(p) * fold (fold 2^8 for e4m3, else 1) for
 * the n positions of slot[] of one KV head, whose scales (slot 0's) are at kscale / vscale, hkv
 * apart per slot. */
static void
fp8_scales(const uint16_t *kscale, const uint16_t *vscale, const Py_ssize_t *slot, Py_ssize_t n, int hkv, int dt,
           float sm_scale, float *ks, float *vs)
{
    const float fold = dt == KV_E4M3 ? 256.f : 1.f, kf = fold * sm_scale;
    for (Py_ssize_t p = 0; p < n; p++) {
        const Py_ssize_t i = slot[p] * hkv;
        ks[p] = bf16_to_f32(kscale[i]) * kf;
        vs[p] = bf16_to_f32(vscale[i]) * fold;
    }
}

/* w[0 .. n) *= vs[0 .. n): an fp8 head's softmax weights times its positions' V scales. */
__attribute__((target("avx2,fma"))) static void
scale_weights(float *w, const float *vs, Py_ssize_t n)
{
    Py_ssize_t p = 0;
    for (; p + 8 <= n; p += 8)
        _mm256_storeu_ps(w + p, _mm256_mul_ps(_mm256_loadu_ps(w + p), _mm256_loadu_ps(vs + p)));
    for (; p < n; p++)
        w[p] *= vs[p];
}

/* attend_row's scratch (floats) for n positions: slots, scores, inv (hq > 64), fp8 scales. */
static inline size_t
attend_row_scratch(Py_ssize_t n, int hq, int hkv)
{
    return (size_t)(n * (2 + hq + 2 * (Py_ssize_t)hkv) + hq);
}

/* attend_row's pass 1 on a pool that is not float32: per block of LOWP_BLOCK positions, every KV
 * head's scores (attention_lowp.c; head 0 prefetches the block's whole K and V rows, which the
 * other heads then find in L2), fp8 scales first. ks / vs: room for hkv * n floats each. */
__attribute__((target("avx2,fma"))) static void
scores_row_lowp(const attn_args *a, const float *qrow, const Py_ssize_t *slot, Py_ssize_t n, float *scores, float *ks,
                float *vs)
{
    const int d = a->d, hkv = a->hkv, g = a->hq / hkv, dt = a->dt, wide = rk_isa == ISA_AVX512;
    const Py_ssize_t row_len = (Py_ssize_t)hkv * d, hb = (Py_ssize_t)d * kv_elem_size(dt);
    const int scaled = kv_has_scale(dt);
    if (scaled)
        for (int kvh = 0; kvh < hkv; kvh++)
            fp8_scales(a->k_scale + kvh, a->v_scale + kvh, slot, n, hkv, dt, a->sm_scale, ks + kvh * n, vs + kvh * n);
    for (Py_ssize_t p0 = 0; p0 < n; p0 += LOWP_BLOCK) {
        const Py_ssize_t m = n - p0 < LOWP_BLOCK ? n - p0 : LOWP_BLOCK;
        for (int kvh = 0; kvh < hkv; kvh++)
            kv_scores_lp(wide, dt, qrow + (Py_ssize_t)kvh * g * d, g, a->k_cache + kvh * hb, a->k_cache, a->v_cache,
                         kvh == 0 ? row_len * kv_elem_size(dt) : 0, slot + p0, m, row_len, d, a->sm_scale,
                         scaled ? ks + kvh * n + p0 : NULL, scores + (Py_ssize_t)kvh * g * n + p0, n);
    }
}

/* attend_row's passes 2 and 3 on a pool that is not float32: the softmax weights (times the fp8 V
 * scales vs) and their weighted sum of V (attention_lowp.c), per KV head. */
__attribute__((target("avx2,fma"))) static void
attend_row_rest(const attn_args *a, const Py_ssize_t *slot, Py_ssize_t n, float *scores, const float *vs, float *orow)
{
    const int d = a->d, hq = a->hq, hkv = a->hkv, g = hq / hkv, dt = a->dt;
    const Py_ssize_t row_len = (Py_ssize_t)hkv * d, hb = (Py_ssize_t)d * kv_elem_size(dt);
    float inv_stack[64];
    float *inv = hq <= 64 ? inv_stack : scores + (Py_ssize_t)hq * n; /* scratch has room (see attn_task) */
    for (int h = 0; h < hq; h++) {
        float mx;
        inv[h] = 1.f / softmax_weights(scores + (Py_ssize_t)h * n, n, &mx);
        if (kv_has_scale(dt))
            scale_weights(scores + (Py_ssize_t)h * n, vs + (Py_ssize_t)(h / g) * n, n);
    }
    for (int kvh = 0; kvh < hkv; kvh++)
        kv_pv_lp(rk_isa == ISA_AVX512, dt, g, a->v_cache + kvh * hb, slot, row_len, n, scores + (Py_ssize_t)kvh * g * n,
                 n, inv + kvh * g, orow + (Py_ssize_t)kvh * g * d, d, d);
}

/* One query row (all heads) against its n visible positions. scratch: attend_row_scratch floats.
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
    float *ks = scores + (Py_ssize_t)hq * n + hq, *vs = ks + (Py_ssize_t)hkv * n;
    for (Py_ssize_t p0 = 0, pg = 0; p0 < n; p0 += ps, pg++) { /* page by page: no division */
        Py_ssize_t base = (Py_ssize_t)pages[pg] * ps, m = n - p0 < ps ? n - p0 : ps;
        for (Py_ssize_t i = 0; i < m; i++)
            slot[p0 + i] = base + i;
    }
    if (a->dt != KV_F32) {
        scores_row_lowp(a, qrow, slot, n, scores, ks, vs);
        attend_row_rest(a, slot, n, scores, vs, orow);
        return;
    }
    const float *k_cache = (const float *)a->k_cache, *v_cache = (const float *)a->v_cache;
    /* pass 1: scores[h][p] = q_h . k_p * scale, 8 positions at a time for every head (their K
     * rows are read once into L1); the next block's K rows and this block's V rows (for pass 3)
     * are prefetched meanwhile */
    const __m256 vscale = _mm256_set1_ps(a->sm_scale);
    Py_ssize_t p = 0;
    for (; p + 8 <= n; p += 8) {
        prefetch_rows(k_cache, slot, p + KV_PREFETCH, p + KV_PREFETCH + 8 < n ? p + KV_PREFETCH + 8 : n, row_len,
                      _MM_HINT_T0);
        if (p == 0) /* the first blocks */
            prefetch_rows(k_cache, slot, 0, KV_PREFETCH < n ? KV_PREFETCH : n, row_len, _MM_HINT_T0);
        prefetch_rows(v_cache, slot, p, p + 8, row_len, _MM_HINT_T1);
        for (int kvh = 0; kvh < hkv; kvh++) {
            const float *kp[8];
            for (int j = 0; j < 8; j++)
                kp[j] = f32_row(k_cache, slot[p + j], row_len) + (Py_ssize_t)kvh * d;
            scores8(qrow + (Py_ssize_t)kvh * g * d, g, kp, d, vscale, scores + (Py_ssize_t)kvh * g * n + p, n);
        }
    }
    for (; p < n; p++)
        for (int kvh = 0; kvh < hkv; kvh++)
            scores1(qrow + (Py_ssize_t)kvh * g * d, g, f32_row(k_cache, slot[p], row_len) + (Py_ssize_t)kvh * d, d,
                    a->sm_scale, scores + (Py_ssize_t)kvh * g * n + p, n);
    /* pass 2: unnormalized softmax weights exp(s - max) per head, and 1 / their sum */
    float inv_stack[64];
    float *inv = hq <= 64 ? inv_stack : scores + (Py_ssize_t)hq * n; /* scratch has room (see attn_task) */
    for (int h = 0; h < hq; h++) {
        float mx;
        inv[h] = 1.f / softmax_weights(scores + (Py_ssize_t)h * n, n, &mx);
    }
    /* pass 3: out_h = inv_h * sum_p w_hp v_p, by (KV head, <= 3 query heads, <= 32 dims) blocks */
    for (int kvh = 0; kvh < hkv; kvh++)
        pv_heads(g, v_cache + (Py_ssize_t)kvh * d, slot, row_len, n, scores + (Py_ssize_t)kvh * g * n,
                 inv + kvh * g, orow + (Py_ssize_t)kvh * g * d, d, d);
}

/* Work units are query rows, numbered request by request, taken one at a time (atomic). */
__attribute__((target("avx2,fma"))) static void
attn_task(void *p, int tid, int nthreads)
{
    attn_args *a = (attn_args *)p;
    Py_ssize_t per = a->max_kv > 0 ? a->max_kv : 1;
    float *scratch = NULL;
    Py_ssize_t r = 0, first = 0; /* request r owns units [first, first + q_len[r]) */
    for (;;) {
        Py_ssize_t u = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (u >= a->units)
            break;
        if (!scratch && !(scratch = (float *)malloc(sizeof(float) * attend_row_scratch(per, a->hq, a->hkv))))
            abort();
        while (u >= first + a->q_len[r]) /* units only grow: walk forward */
            first += a->q_len[r++];
        Py_ssize_t j = u - first, nq = a->q_len[r];
        attend_row(a, r, a->q_start[r] + j, a->kv_len[r] - nq + j + 1, scratch);
    }
    free(scratch);
}

void
paged_attention(const float *q, Py_ssize_t ldq, const int32_t *meta, Py_ssize_t n_req, const int32_t *kv_indices,
                Py_ssize_t page_size, kv_tensor k, kv_tensor v, int dt, int hq, int hkv, int d, float sm_scale,
                float *out, int nthreads)
{
    attn_args a = {q, ldq, meta, meta + n_req, meta + 2 * n_req, meta + 3 * n_req, n_req, kv_indices, page_size,
                   (const uint8_t *)k.data, (const uint8_t *)v.data, k.scale, v.scale, dt, hq, hkv, d, sm_scale,
                   out, 0, 0, 0};
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

/* attend_chunk on a pool that is not float32 (see attention_lowp.c): scores (head 0's unit
 * prefetches the chunk's whole K and V rows, which the other heads' units then find in L2), the
 * softmax, fp8 V scales, the unnormalized weighted sum of V. scratch (after the slots): G * n
 * scores, then n K and n V scale factors. */
__attribute__((target("avx2,fma"))) static void
attend_chunk_lowp(const float *q, int G, const Py_ssize_t *slot, Py_ssize_t n, const kv_head *kv, int d,
                  float sm_scale, float *part, Py_ssize_t ldp, float *scores)
{
    const int dt = kv->dt, scaled = kv_has_scale(dt), wide = rk_isa == ISA_AVX512;
    float *ks = scores + (Py_ssize_t)G * n, *vs = ks + n;
    if (scaled)
        fp8_scales(kv->ks, kv->vs, slot, n, kv->hkv, dt, sm_scale, ks, vs);
    const Py_ssize_t pf_bytes = (kv->g == 0 ? kv->row_len : d) * kv_elem_size(dt);
    kv_scores_lp(wide, dt, q, G, kv->k, kv->k, kv->v, pf_bytes, slot, n, kv->row_len, d, sm_scale, scaled ? ks : NULL,
                 scores, n);
    float ones[64];
    for (int h = 0; h < G; h++) {
        float *ph = part + (Py_ssize_t)h * ldp;
        ph[1] = softmax_weights(scores + (Py_ssize_t)h * n, n, &ph[0]);
        if (scaled)
            scale_weights(scores + (Py_ssize_t)h * n, vs, n);
        ones[h] = 1.f;
    }
    kv_pv_lp(wide, dt, G, kv->v, slot, kv->row_len, n, scores, n, ones, part + 2, ldp, d);
}

/* The three passes of attend_row for G (<= 64) query heads of one KV head over n positions, with
 * inv = 1 in pass 3: the unnormalized weighted sum (merge_partials divides by the sum, as
 * attend_row does). The positions' K rows are not prefetched (a chunk's rows are few). */
__attribute__((target("avx2,fma"))) void
attend_chunk(const float *q, int G, const int32_t *slots, Py_ssize_t n, const kv_head *kv, int d, float sm_scale,
             float *part, Py_ssize_t ldp, float *scratch)
{
    Py_ssize_t *slot = (Py_ssize_t *)scratch;
    float *scores = scratch + 2 * n; /* [G][n] */
    for (Py_ssize_t i = 0; i < n; i++)
        slot[i] = slots[i];
    if (kv->dt != KV_F32) {
        attend_chunk_lowp(q, G, slot, n, kv, d, sm_scale, part, ldp, scores);
        return;
    }
    const float *k_base = (const float *)kv->k, *v_base = (const float *)kv->v;
    const Py_ssize_t row_len = kv->row_len;
    const __m256 vscale = _mm256_set1_ps(sm_scale);
    Py_ssize_t p = 0;
    for (; p + 8 <= n; p += 8) {
        const float *kp[8];
        for (int j = 0; j < 8; j++)
            kp[j] = f32_row(k_base, slot[p + j], row_len);
        scores8(q, G, kp, d, vscale, scores + p, n);
    }
    for (; p < n; p++)
        scores1(q, G, f32_row(k_base, slot[p], row_len), d, sm_scale, scores + p, n);
    float ones[64];
    for (int h = 0; h < G; h++) {
        float *ph = part + (Py_ssize_t)h * ldp;
        ph[1] = softmax_weights(scores + (Py_ssize_t)h * n, n, &ph[0]);
        ones[h] = 1.f;
    }
    pv_heads(G, v_base, slot, row_len, n, scores, ones, part + 2, ldp, d);
}

/* o[0 .. d) = the nc chunk partials at ph ((max, sum, weighted sum of V), d + 2 floats apart)
 * merged in chunk order: one chunk is attend_row's inv * acc, bit for bit; more are rescaled to
 * their common maximum. */
__attribute__((target("avx2,fma"))) void
merge_partials(const float *ph, int nc, int d, float *o)
{
    if (nc == 1) {
        __m256 sv = _mm256_set1_ps(1.f / ph[1]);
        for (int e = 0; e < d; e += 8)
            _mm256_storeu_ps(o + e, _mm256_mul_ps(sv, _mm256_loadu_ps(ph + 2 + e)));
        return;
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
#endif

/* NULL when the attention metadata is in range, else what is wrong: O(requests + pages), run
 * before every kernel so a bad batch raises instead of reading out of bounds. T: query rows;
 * n_indices: entries of kv_indices; num_pages: pages of the pool. */
const char *
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
