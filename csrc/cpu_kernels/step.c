/* The whole decode step: decode_step runs one forward pass of a decode-sized batch (at most
 * STEP_MAX_ROWS new tokens, any mix of decodes and short extends) through every layer and the
 * output projection in ONE call and ONE parallel region: the embeddings, per layer RMSNorm
 * (+ residual), the q/k/v GEMM with RoPE and the K/V write, paged attention, the o GEMM, RMSNorm,
 * gate|up with SiLU-and-multiply, down, then the final norm and the logits of the rows asked for.
 * The threads meet at a spin barrier between the phases that need each other's results (5 a
 * layer). The row-wise steps that are cheap (norms, the residual, the attention merge) run on
 * every thread over all rows, each into its own copy (the same operations on the same inputs give
 * the same bits), so no barrier waits for them. The GEMM and attention work units are taken in
 * guided chunks (take_chunk), so a thread that runs late costs the others little.
 *
 * The numbers are those of the module path's kernels (gemm_range, attend_chunk, add_rms_norm,
 * rope_inplace, silu_mul): every output element is computed by one thread in a fixed order, so the
 * logits do not depend on the thread count nor on the other requests of the batch. Attention is
 * split into chunks of ATT_CHUNK positions per (query row, KV head), merged in order; a request
 * with at most ATT_CHUNK positions gets exactly the bits of paged_attention.
 *
 * The plan (step_plan; a capsule in bindings.c) holds the model's addresses, taken once by
 * radixkv/executor/cpu_decode.py (which keeps the tensors alive and rebuilds the plan when a weight
 * changes); the block table is read directly: slot of position p of a token's request =
 * req_to_token[row, p]. Every call checks its rows, positions, tokens and every slot it will read
 * or write before the region starts. */

#include "internal.h"

#ifndef ATT_CHUNK
#define ATT_CHUNK 256 /* positions per attention work unit */
#endif

struct step_plan {
    int L, H, hq, hkv, d, inter, V;
    int kv_dt; /* the pool's K/V dtype */
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
};

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

#if RK_X86
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

/* att[t, h] = the merged partials of every chunk of row t, head h (in chunk order). */
static void
step_merge(const step_args *sa, float *att)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq;
    const Py_ssize_t ldp = (Py_ssize_t)sa->max_chunks * (d + 2);
    for (int t = 0; t < sa->T; t++) {
        int nc = (sa->t_pos[t] + ATT_CHUNK) / ATT_CHUNK;
        for (int h = 0; h < hq; h++)
            merge_partials(p->part + ((Py_ssize_t)t * hq + h) * ldp, nc, d, att + ((Py_ssize_t)t * hq + h) * d);
    }
}

/* One attention unit: token row t, KV head g (its G = hq / hkv query heads), positions
 * [c * ATT_CHUNK, ...) of the row's visible ones, against layer lp's cache, into the partials. */
static void
step_attend(const step_args *sa, const layer_plan *lp, int t, int g, int c, float *scratch)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq, hkv = p->hkv, G = hq / hkv;
    const Py_ssize_t nqkv = (Py_ssize_t)(hq + 2 * hkv) * d, ldp = (Py_ssize_t)sa->max_chunks * (d + 2);
    const Py_ssize_t vis = (Py_ssize_t)sa->t_pos[t] + 1, p0 = (Py_ssize_t)c * ATT_CHUNK;
    const Py_ssize_t n = vis - p0 < ATT_CHUNK ? vis - p0 : ATT_CHUNK;
    const float *q = p->shared + t * nqkv + (Py_ssize_t)g * G * d; /* the q heads of group g */
    const int32_t *slots = p->r2t + (Py_ssize_t)sa->t_row[t] * p->r2t_cols + p0;
    float *part = p->part + ((Py_ssize_t)t * hq + (Py_ssize_t)g * G) * ldp + (Py_ssize_t)c * (d + 2);
    const Py_ssize_t hb = (Py_ssize_t)g * d * kv_elem_size(p->kv_dt); /* head g's bytes into a row */
    const kv_head kv = {(const uint8_t *)lp->k_cache.data + hb, (const uint8_t *)lp->v_cache.data + hb,
                        lp->k_cache.scale ? lp->k_cache.scale + g : NULL, lp->v_cache.scale ? lp->v_cache.scale + g : NULL,
                        (Py_ssize_t)hkv * d, hkv, p->kv_dt, g};
    attend_chunk(q, G, slots, n, &kv, d, p->sm_scale, part, ldp, scratch);
}

/* RoPE on head hd (< hq + hkv) of every row of qkv, then k / v heads (hd >= hq) into the cache
 * (rounded to its dtype by kv_store). */
static void
step_rope_kv(const step_args *sa, const layer_plan *lp, int hd, int t0, int t1)
{
    const step_plan *p = sa->p;
    const int d = p->d, hq = p->hq, hkv = p->hkv;
    const Py_ssize_t nqkv = (Py_ssize_t)(hq + 2 * hkv) * d;
    for (int t = t0; t < t1; t++) {
        float *hp = p->shared + t * nqkv + (Py_ssize_t)hd * d;
        const Py_ssize_t pos = sa->t_pos[t];
        if (hd < hq + hkv)
            rope_inplace(hp, 1, 1, d, d, p->cos + pos * d, p->sin + pos * d);
        if (hd >= hq) {
            const Py_ssize_t slot = p->r2t[(Py_ssize_t)sa->t_row[t] * p->r2t_cols + pos];
            if (hd < hq + hkv)
                kv_store(&lp->k_cache, p->kv_dt, slot, hkv, hd - hq, hp, d);
            else
                kv_store(&lp->v_cache, p->kv_dt, slot, hkv, hd - hq - hkv, hp, d);
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
    while (take_chunk(counter, panels, n, M == 1 || rk_isa == ISA_AVX512 ? 4 : 1, &p0, &p1))
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
    float *xs = scratch + attend_chunk_scratch(ATT_CHUNK, G) + 64 + H; /* block sums of the GEMM input at hand */
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
                step_attend(sa, lp, un[0], un[1], un[2], scratch);
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
            /* two gate panels and their up panels at a time (the GEMV's 4) for one row, and on
             * AVX-512 for the small-M GEMM's row counts that take 4 panels a group */
            const int wide = T == 1 || (rk_isa == ISA_AVX512 && T <= 3);
            const Py_ssize_t np = I / NR, two = wide && np % 2 == 0 ? 2 : 1;
            while (take_chunk(ctr, np, n, two, &u0, &u1))
                for (Py_ssize_t u = u0; u < u1; u += two) {
                    panel_ref r[4] = {panel_at(lp->w[2], u, lp->b[2], gu), panel_at(lp->w[2], u + two - 1, lp->b[2], gu),
                                      panel_at(lp->w[2], u + np, lp->b[2], gu),
                                      panel_at(lp->w[2], u + np + two - 1, lp->b[2], gu)};
                    if (two == 1)
                        r[1] = r[2];
                    gemm_refs(x, xs, T, H, H, (int)lp->w[2]->fmt, r, 2 * (int)two, 2 * I, buf);
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
    /* the residual row (a row may be asked for twice) */
    float *tmp = scratch + attend_chunk_scratch(ATT_CHUNK, G) + 64;
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

/* ------------------------------------------------------------------ the plan and its checks */

int
step_dims_ok(const step_dims *dm)
{
    return !(dm->L < 1 || dm->H < 1 || dm->hq < 1 || dm->hkv < 1 || dm->hq % dm->hkv || dm->d < 8 || dm->d % 8 ||
             dm->d > 256 || dm->inter < 1 || dm->V < 1 || dm->hq / dm->hkv > 64 || dm->kv_dt < 0 ||
             dm->kv_dt >= KV_NDTYPES);
}

const char *
step_check_layer(const step_dims *dm, const layer_plan *lp)
{
    const int H = dm->H, hq = dm->hq, hkv = dm->hkv, d = dm->d, inter = dm->inter;
    const char *bad = check_pw(lp->w[0], (Py_ssize_t)(hq + 2 * hkv) * d, H);
    if (!bad)
        bad = check_pw(lp->w[1], H, (Py_ssize_t)hq * d);
    if (!bad)
        bad = check_pw(lp->w[2], 2 * (Py_ssize_t)inter, H);
    if (!bad)
        bad = check_pw(lp->w[3], H, inter);
    if (!bad && (!lp->norm_in || !lp->norm_post || !lp->k_cache.data || !lp->v_cache.data))
        bad = "a layer's address is 0";
    if (!bad && kv_has_scale(dm->kv_dt) != (lp->k_cache.scale != NULL))
        bad = kv_has_scale(dm->kv_dt) ? "an fp8 pool needs its scales" : "only an fp8 pool has scales";
    if (!bad && (lp->k_cache.scale != NULL) != (lp->v_cache.scale != NULL))
        bad = "K and V need scales alike";
    return bad;
}

step_plan *
step_plan_new(const step_dims *dm, const layer_plan *layers, const float *embed, const float *final_norm,
              float final_eps, const pw_header *lm_head, const int32_t *r2t, Py_ssize_t r2t_rows, Py_ssize_t r2t_cols,
              Py_ssize_t page_size, Py_ssize_t num_slots, float sm_scale)
{
    const int L = dm->L, H = dm->H, hq = dm->hq, hkv = dm->hkv, d = dm->d, inter = dm->inter;
    step_plan *p = (step_plan *)calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->L = L, p->H = H, p->hq = hq, p->hkv = hkv, p->d = d, p->inter = inter, p->V = dm->V, p->kv_dt = dm->kv_dt;
    pthread_mutex_init(&p->mu, NULL);
    p->layer = (layer_plan *)calloc((size_t)L, sizeof(layer_plan));
    if (!p->layer) {
        step_plan_free(p);
        return NULL;
    }
    memcpy(p->layer, layers, sizeof(layer_plan) * (size_t)L);
    p->embed = embed, p->final_norm = final_norm, p->final_eps = final_eps;
    p->lm_head = lm_head;
    p->r2t = r2t, p->r2t_rows = r2t_rows, p->r2t_cols = r2t_cols;
    p->page_size = page_size, p->num_slots = num_slots, p->sm_scale = sm_scale;
    p->nt_max = usable_cpus() < MAX_THREADS ? usable_cpus() : MAX_THREADS;
    const Py_ssize_t nqkv = (Py_ssize_t)(hq + 2 * hkv) * d;
    Py_ssize_t kmax = H > (Py_ssize_t)hq * d ? H : (Py_ssize_t)hq * d;
    kmax = kmax > inter ? kmax : inter;
    p->priv_floats = STEP_MAX_ROWS * (2 * (Py_ssize_t)H + (Py_ssize_t)hq * d) + attend_chunk_scratch(ATT_CHUNK, hq / hkv) +
                     64 + H + STEP_MAX_ROWS * (kmax / QB + 1);
    p->priv_floats = (p->priv_floats + 15) / 16 * 16; /* each thread's buffers on their own lines */
    p->shared = (float *)aligned_alloc(64, sizeof(float) * (size_t)(STEP_MAX_ROWS * (nqkv + H + 3 * (Py_ssize_t)inter) + 16));
    p->priv = (float *)aligned_alloc(64, sizeof(float) * (size_t)(p->priv_floats * p->nt_max));
    p->n_counters = 5 * L + 2;
    p->counters = (Py_ssize_t *)calloc((size_t)p->n_counters, sizeof(Py_ssize_t));
    if (!p->shared || !p->priv || !p->counters) {
        step_plan_free(p);
        return NULL;
    }
    return p;
}

void
step_plan_free(step_plan *p)
{
    free(p->layer);
    free(p->shared);
    free(p->priv);
    free(p->part);
    free(p->units);
    free(p->counters);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int
step_plan_head_dim(const step_plan *p)
{
    return p->d;
}

void
step_plan_set_rope(step_plan *p, const float *cos, const float *sin, Py_ssize_t len)
{
    pthread_mutex_lock(&p->mu);
    p->cos = cos, p->sin = sin, p->rope_len = len;
    pthread_mutex_unlock(&p->mu);
}

const char *
step_check_batch(const step_plan *p, const int64_t *tok, Py_ssize_t T, const int64_t *rows, const int64_t *pre,
                 const int64_t *ext, Py_ssize_t B, const int64_t *lr, Py_ssize_t S, int have_logits, int32_t *t_row,
                 int32_t *t_pos, int32_t *lrows)
{
    const char *bad = NULL;
    Py_ssize_t t = 0;
    for (Py_ssize_t r = 0; r < B && !bad; r++) {
        if (rows[r] < 0 || rows[r] >= p->r2t_rows)
            bad = "a row is outside the block table";
        /* compared without adding: prefix_len + extend_len could overflow int64 and pass */
        else if (pre[r] < 0 || ext[r] < 1 || ext[r] > p->r2t_cols || pre[r] > p->r2t_cols - ext[r])
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
    if (!bad && S > 0 && !have_logits)
        bad = "logits address is 0";
    if (!bad && (!p->cos || !p->sin))
        bad = "the RoPE tables are not set";
    return bad;
}

#if RK_X86
int
step_run(step_plan *p, const int64_t *tok, int T, const int32_t *t_row, const int32_t *t_pos, const int32_t *lrows,
         int S, float *logits, int nthreads)
{
    int fail = 0;
    pthread_mutex_lock(&p->mu);
    step_args sa;
    memset(&sa, 0, sizeof sa);
    sa.p = p, sa.T = T, sa.S = S, sa.tok = tok, sa.t_row = t_row, sa.t_pos = t_pos, sa.lrows = lrows;
    sa.logits = logits;
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
        for (int i = 0; i < T; i++)
            for (int c = 0; c <= t_pos[i] / ATT_CHUNK; c++)
                for (int g = 0; g < p->hkv; g++, u++) {
                    p->units[3 * u] = i;
                    p->units[3 * u + 1] = g;
                    p->units[3 * u + 2] = c;
                }
        sa.n_units = units;
        sa.max_chunks = max_chunks;
        memset(p->counters, 0, sizeof(Py_ssize_t) * (size_t)p->n_counters);
        int nt = nthreads < p->nt_max ? nthreads : p->nt_max;
        run_parallel(step_task, &sa, nt < 1 ? 1 : nt);
    }
    pthread_mutex_unlock(&p->mu);
    return fail ? -1 : 0;
}
#endif
